//! The queue's ring of live partitions (`migrations/0028_job_ring.sql`): slots made current
//! in turn and truncated once done with, whatever transaction pins the xmin horizon; live
//! jobs that outlive their slot moved out of it, never lost nor run twice; unique keys held
//! across the slots; the plans it leaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use airlock_core::ids::JobId;
use airlock_queue::ring::{self, Recycled};
use airlock_queue::{self as queue, ClaimFilter, JobState, NewJob, QueueError};
use airlock_worker::runtime::ring::{Pass, RingSettings, run_once};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(30);

/// The ring's settings in these tests: the slot's time is the tests' to decide ([`make_due`]).
fn settings() -> RingSettings {
    RingSettings { slot_seconds: 3600, lock_timeout: Duration::from_millis(200), move_batch: 2 }
}

/// Makes the current slot due for a switch, as if it had been current for two hours.
async fn make_due(pool: &PgPool) {
    current_for(pool, 7200).await;
}

/// Makes the current slot look current for `seconds`.
async fn current_for(pool: &PgPool, seconds: i32) {
    sqlx::query("UPDATE job_ring SET since = now() - make_interval(secs => $1)")
        .bind(seconds)
        .execute(pool)
        .await
        .unwrap();
}

async fn pass(pool: &PgPool) -> Pass {
    run_once(pool, &settings(), &CancellationToken::new()).await.unwrap()
}

/// The current slot.
async fn current(pool: &PgPool) -> i16 {
    sqlx::query_scalar("SELECT current FROM job_ring").fetch_one(pool).await.unwrap()
}

/// Each slot's heap on disk, in bytes, in slot order.
async fn sizes(pool: &PgPool) -> Vec<(i16, i64)> {
    sqlx::query_as("SELECT slot, pg_relation_size(leaf) FROM airlock_job_ring() ORDER BY slot")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The partition job `id` lies in.
async fn partition_of(pool: &PgPool, id: JobId) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn enqueue(pool: &PgPool, job: NewJob) -> queue::Enqueued {
    let mut tx = pool.begin().await.unwrap();
    let e = queue::enqueue(&mut tx, &job).await.unwrap();
    tx.commit().await.unwrap();
    e
}

async fn claim(pool: &PgPool, n: i64) -> Vec<queue::Job> {
    queue::claim_batch(pool, "w", &ClaimFilter::default(), n, LEASE).await.unwrap()
}

/// Claims and completes every job that can be claimed now; returns how many.
async fn drain(pool: &PgPool) -> usize {
    let mut n = 0;
    loop {
        let jobs = claim(pool, 500).await;
        if jobs.is_empty() {
            return n;
        }
        let leases: Vec<queue::Lease> = jobs.iter().map(|j| j.lease()).collect();
        assert_eq!(queue::complete_many(pool, &leases).await.unwrap().len(), leases.len());
        n += jobs.len();
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn under_a_pinned_horizon_every_slot_left_is_truncated_and_every_job_done_once(pool: PgPool) {
    // A transaction with an xid, left open: no vacuum may remove a version written after it
    // began, anywhere, for as long as it stays open.
    let mut pin = pool.begin().await.unwrap();
    let pinned: i64 = sqlx::query_scalar("SELECT txid_current()").fetch_one(&mut *pin).await.unwrap();
    let mut done = 0;
    for round in 0..8 {
        let jobs: Vec<NewJob> = (0..1500).map(|i| NewJob::new("t", json!({ "round": round, "i": i }))).collect();
        let mut tx = pool.begin().await.unwrap();
        queue::enqueue_many(&mut tx, &jobs).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(drain(&pool).await, 1500);
        done += 1500;
        // What the claims and completions left in the current slot: versions no one but
        // the pin can see, which only a truncation can remove now.
        let left = current(&pool).await;
        let full = sizes(&pool).await.into_iter().find(|(s, _)| *s == left).unwrap().1;
        assert!(full > 0, "round {round}: the slot holds what its jobs left");

        make_due(&pool).await;
        let p = pass(&pool).await;
        assert!(p.switched.is_some_and(|s| s != left), "round {round}: the next slot is current: {p:?}");
        assert!(p.truncated.contains(&left), "round {round}: the slot left is truncated at once: {p:?}");
        // Nothing of the round's 3,000 versions remains in the ring, pin or no pin.
        assert!(sizes(&pool).await.iter().all(|(_, b)| *b == 0), "round {round}: {:?}", sizes(&pool).await);
        let finished: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs_done WHERE state = 'completed'")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(finished, done, "round {round}: every job finished is kept");
    }
    // The pin held the horizon all along.
    let (xid, horizon): (i64, Option<String>) = sqlx::query_as(
        "SELECT txid_current(), (SELECT backend_xid::text FROM pg_stat_activity WHERE pid = pg_backend_pid())",
    )
    .fetch_one(&mut *pin)
    .await
    .unwrap();
    assert_eq!(xid, pinned);
    assert!(horizon.is_some(), "the pinned transaction still holds its xid");
    pin.rollback().await.unwrap();

    let (total, once): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND attempt = 1) FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((total, once), (done, done), "every job completed, each exactly once");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn jobs_that_outlive_their_slot_move_out_of_the_ring_and_finish_once(pool: PgPool) {
    // Slot 0: a job its holder is still running, one parked for a human, one in the paused
    // send queue, one due in an hour.
    let running = enqueue(&pool, NewJob::new("t", json!({"job": "running"}))).await.id;
    let held = claim(&pool, 1).await.pop().unwrap();
    assert_eq!(held.id, running);
    let parked = enqueue(&pool, NewJob::new("t", json!({"job": "parked"}))).await.id;
    let p = claim(&pool, 1).await.pop().unwrap();
    queue::park(&pool, p.lease(), "the effect may have happened").await.unwrap();
    let paused = enqueue(&pool, NewJob::new("t", json!({"job": "paused"})).queue("send")).await.id;
    let later = enqueue(
        &pool,
        NewJob::new("t", json!({"job": "later"})).run_at(chrono::Utc::now() + chrono::TimeDelta::hours(1)),
    )
    .await
    .id;
    // Every other slot gets a job that stays too, so none is fit when slot 0's turn comes.
    let mut others = Vec::new();
    for slot in 1..=3 {
        make_due(&pool).await;
        assert_eq!(pass(&pool).await.switched, Some(slot));
        others.push(enqueue(&pool, NewJob::new("t", json!({ "slot": slot })).queue("send")).await.id);
    }
    assert_eq!(partition_of(&pool, running).await, "jobs_ring_0");

    make_due(&pool).await;
    let p = pass(&pool).await;
    assert_eq!(p.evacuated, Some((0, 4)), "the oldest slot's four live jobs moved: {p:?}");
    assert_eq!(p.switched, Some(0), "and the slot made current: {p:?}");
    assert_eq!(sizes(&pool).await[0], (0, 0));
    for id in [running, parked, paused, later] {
        assert_eq!(partition_of(&pool, id).await, "jobs_long", "{id}");
    }

    // The holder of the running job never noticed: its lease holds, and it completes it.
    queue::heartbeat(&pool, held.lease(), LEASE).await.unwrap();
    queue::ensure_held(&pool, held.lease()).await.unwrap();
    queue::complete(&pool, held.lease()).await.unwrap();
    // A human retries the parked one; the send queue resumes; the later one comes due.
    queue::retry_now(&pool, parked).await.unwrap();
    sqlx::query("DELETE FROM queue_pauses WHERE queue = 'send'").execute(&pool).await.unwrap();
    sqlx::query("UPDATE jobs SET run_at = now() WHERE id = $1").bind(later).execute(&pool).await.unwrap();
    assert_eq!(drain(&pool).await, 6);

    let jobs: Vec<(JobId, JobState, i32, String)> =
        sqlx::query_as("SELECT id, state, attempt, tableoid::regclass::text FROM jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(jobs.len(), 7, "no job lost, none duplicated: {jobs:?}");
    for (id, state, attempt, part) in jobs {
        assert_eq!((state, part.as_str()), (JobState::Completed, "jobs_done"), "{id}");
        // The parked one ran twice, by a human's decision; every other once.
        assert_eq!(attempt, if id == parked { 2 } else { 1 }, "{id}");
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_completion_that_waited_for_its_slot_to_be_emptied_finds_its_job_moved_and_finishes_it_once(pool: PgPool) {
    // Two held jobs of slot 0, the one completed alone (by the statement naming its slot's
    // partition), the other with a claim.
    for n in 0..3 {
        enqueue(&pool, NewJob::new("t", json!({ "n": n }))).await;
    }
    let held = claim(&pool, 2).await;
    assert_eq!(held.len(), 2);
    make_due(&pool).await;
    assert_eq!(pass(&pool).await.switched, Some(1));

    // The ring empties slot 0, its running jobs included, and keeps its lock until it commits.
    let mut mover = pool.begin().await.unwrap();
    let (slot, truncated, moved): (i16, bool, i64) =
        sqlx::query_as("SELECT * FROM airlock_job_ring_recycle(1000, 0::smallint)")
            .fetch_one(&mut *mover)
            .await
            .unwrap();
    assert_eq!((slot, truncated, moved), (0, true, 3));

    // Meanwhile the holders complete: both statements wait for the slot's lock.
    let complete = tokio::spawn({
        let (pool, lease) = (pool.clone(), held[0].lease());
        async move { queue::complete(&pool, lease).await }
    });
    let complete_and_claim = tokio::spawn({
        let (pool, lease) = (pool.clone(), held[1].lease());
        async move {
            let claim = queue::Claim {
                owner: "w",
                filter: &ClaimFilter::default(),
                limit: 1,
                lease: LEASE,
                paused: &[],
                from: None,
                ring: &queue::RING_SLOTS,
            };
            queue::complete_and_claim(&pool, &claim, &[lease]).await
        }
    });
    airlock_tests::harness::wait_for("both completions waiting for the slot", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            (waiting == 2).then_some(())
        }
    })
    .await;
    mover.commit().await.unwrap();

    complete.await.unwrap().unwrap();
    let queue::Claimed { jobs: claimed, done, .. } = complete_and_claim.await.unwrap().unwrap();
    assert_eq!(done, vec![held[1].lease()], "the lease completed where its job went");
    assert_eq!(claimed.len(), 1, "and the claim took the job left");
    assert_eq!(partition_of(&pool, claimed[0].id).await, "jobs_long");
    queue::complete(&pool, claimed[0].lease()).await.unwrap();

    let jobs: Vec<(JobState, i32, String)> =
        sqlx::query_as("SELECT state, attempt, tableoid::regclass::text FROM jobs").fetch_all(&pool).await.unwrap();
    assert_eq!(jobs.len(), 3, "no job lost, none duplicated: {jobs:?}");
    assert!(jobs.iter().all(|j| *j == (JobState::Completed, 1, "jobs_done".to_string())), "{jobs:?}");
    // A lease completed once is lost to a second completion, wherever the hint points.
    assert!(matches!(queue::complete(&pool, held[0].lease()).await, Err(QueueError::LeaseLost { .. })));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_truncation_waits_no_longer_than_its_timeout_and_never_takes_a_live_job(pool: PgPool) {
    enqueue(&pool, NewJob::new("t", json!({}))).await;
    assert_eq!(drain(&pool).await, 1);
    make_due(&pool).await;
    // A transaction reading the slot holds it: the truncation gives up after its timeout.
    let mut reader = pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM jobs_ring_0").execute(&mut *reader).await.unwrap();
    let started = std::time::Instant::now();
    let p = pass(&pool).await;
    assert_eq!((p.switched, p.busy), (Some(1), Some(0)), "switched, and slot 0 left busy: {p:?}");
    assert!(p.truncated.is_empty(), "{p:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "waited {:?}", started.elapsed());
    reader.commit().await.unwrap();

    // A job that lands in the slot just left (its statement read the ring before the switch).
    let late: JobId = sqlx::query_scalar(
        "INSERT INTO jobs (id, kind, queue, slot) VALUES (gen_random_uuid(), 't', 'default', 0) RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let p = pass(&pool).await;
    assert!(!p.truncated.contains(&0), "a slot holding a live job is kept: {p:?}");
    assert_eq!(partition_of(&pool, late).await, "jobs_ring_0");
    assert_eq!(drain(&pool).await, 1, "the late job is claimed like any other");
    assert_eq!(pass(&pool).await.truncated, vec![0], "then its slot goes");
    let state: JobState =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(late).fetch_one(&pool).await.unwrap();
    assert_eq!(state, JobState::Completed);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_analyzed_slot_is_left_behind_at_the_next_pass(pool: PgPool) {
    // Someone analyzes the whole database while the queue is idle: every slot gets statistics
    // of an empty table, which would keep plans that read a slot whole once it fills.
    sqlx::query("ANALYZE").execute(&pool).await.unwrap();
    let analyzed = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM airlock_job_ring() g JOIN pg_class c ON c.oid = g.leaf WHERE c.reltuples >= 0",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(analyzed(pool.clone()).await, 4);
    // Not due by time (the slot became current just now): due all the same.
    let p = pass(&pool).await;
    assert!(p.switched.is_some(), "{p:?}");
    // Every slot but the new current one was truncated, which drops the statistics; the new
    // current one was fit only once truncated too.
    assert_eq!(analyzed(pool.clone()).await, 0, "{p:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_unique_key_is_held_by_one_live_job_across_the_slots(pool: PgPool) {
    let first = enqueue(&pool, NewJob::new("t", json!({})).unique_key("k")).await;
    assert!(first.inserted);
    make_due(&pool).await;
    assert_eq!(pass(&pool).await.switched, Some(1));
    // The key's job lies in slot 0; new jobs go to slot 1.
    let again = enqueue(&pool, NewJob::new("t", json!({})).unique_key("k")).await;
    assert_eq!(again, queue::Enqueued { id: first.id, inserted: false });

    // Two transactions enqueueing one key at once, across a switch: the second waits for the
    // first, then sees its job.
    let mut a = pool.begin().await.unwrap();
    let in_a = queue::enqueue(&mut a, &NewJob::new("t", json!({})).unique_key("k2")).await.unwrap();
    assert!(in_a.inserted);
    make_due(&pool).await;
    assert_eq!(pass(&pool).await.switched, Some(2));
    let pool_b = pool.clone();
    let b = tokio::spawn(async move {
        let mut tx = pool_b.begin().await.unwrap();
        let e = queue::enqueue(&mut tx, &NewJob::new("t", json!({})).unique_key("k2")).await.unwrap();
        tx.commit().await.unwrap();
        e
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b.is_finished(), "the second waits for the first's key");
    a.commit().await.unwrap();
    assert_eq!(b.await.unwrap(), queue::Enqueued { id: in_a.id, inserted: false });

    // A batch naming a key twice inserts it once.
    let mut tx = pool.begin().await.unwrap();
    let batch = queue::enqueue_many(
        &mut tx,
        &[NewJob::new("t", json!({})).unique_key("k3"), NewJob::new("t", json!({})).unique_key("k3")],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(batch[0].inserted && !batch[1].inserted && batch[0].id == batch[1].id, "{batch:?}");

    // A failed job comes back only while no live job holds its key.
    let failed = claim(&pool, 10).await.into_iter().find(|j| j.id == first.id).unwrap();
    queue::fail(&pool, failed.lease(), "broken", true, None).await.unwrap();
    let live = enqueue(&pool, NewJob::new("t", json!({})).unique_key("k")).await;
    assert!(live.inserted, "the key is free once its job failed");
    assert!(matches!(queue::retry_now(&pool, first.id).await, Err(QueueError::InvalidTransition { .. })));
    let k_live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs_live WHERE unique_key = 'k'").fetch_one(&pool).await.unwrap();
    assert_eq!(k_live, 1);
    // Once that one is done, the failed one may be retried.
    let j = claim(&pool, 10).await.into_iter().find(|j| j.id == live.id).unwrap();
    queue::complete(&pool, j.lease()).await.unwrap();
    queue::retry_now(&pool, first.id).await.unwrap();
    assert_eq!(partition_of(&pool, first.id).await, format!("jobs_ring_{}", current(&pool).await));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn jobs_running_while_the_ring_turns_and_moves_them_each_finish_once(pool: PgPool) {
    airlock_tests::harness::init_logs();
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("t", |ctx| async move {
        let ms = ctx.job.payload["ms"].as_u64().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(airlock_worker::Outcome::Completed)
    });
    let settings = airlock_worker::WorkerSettings {
        concurrency: 8,
        claim_batch: 8,
        complete_batch: 50,
        lease: Duration::from_secs(3),
        heartbeat_interval: Duration::from_millis(500),
        // Its own turns of the ring leave this test's turns to the test.
        ring: RingSettings { slot_seconds: 3600, ..RingSettings::default() },
        ..crate::jobs::settings("w-ring", Duration::from_millis(50))
    };
    let worker = airlock_worker::Worker::new(pool.clone(), registry, settings);
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));

    // The ring turns every 100 ms, and every slot left behind is emptied at once, its running
    // jobs included, whatever their holders are doing.
    let turning = CancellationToken::new();
    // Jobs moved out of a slot left behind: nobody's (waiting), and held (running).
    let (moved, moved_running) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let turner = tokio::spawn({
        let (pool, turning, moved, moved_running) =
            (pool.clone(), turning.clone(), moved.clone(), moved_running.clone());
        async move {
            let s = RingSettings { slot_seconds: 1, lock_timeout: Duration::from_millis(50), move_batch: 20 };
            while !turning.is_cancelled() {
                current_for(&pool, 10).await;
                run_once(&pool, &s, &turning).await.unwrap();
                let cur = current(&pool).await;
                for slot in (0..4).filter(|s| *s != cur) {
                    moved.fetch_add(ring::evacuate(&pool, slot, 20).await.unwrap(), Ordering::Relaxed);
                    if let Some(Recycled { moved: m, .. }) =
                        ring::recycle(&pool, s.lock_timeout, Some(slot)).await.unwrap()
                    {
                        moved_running.fetch_add(m as u64, Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });

    // 2,000 jobs of 0-60 ms, and a few of 1.5 s that run through many turns.
    let mut rng = airlock_tests::harness::Rng(7);
    for batch in 0..40 {
        let jobs: Vec<NewJob> = (0..50)
            .map(|i| {
                let ms = if i == 0 && batch % 10 == 0 { 1500 } else { rng.range(0, 60) };
                NewJob::new("t", json!({ "ms": ms, "n": batch * 50 + i }))
            })
            .collect();
        let mut tx = pool.begin().await.unwrap();
        queue::enqueue_many(&mut tx, &jobs).await.unwrap();
        tx.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    airlock_tests::harness::wait_for("every job done", Duration::from_secs(120), || {
        let pool = pool.clone();
        async move {
            let left: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs_live").fetch_one(&pool).await.unwrap();
            (left == 0).then_some(())
        }
    })
    .await;
    turning.cancel();
    turner.await.unwrap();
    stop.cancel();
    running.await.unwrap().unwrap();

    let (total, once, distinct): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND attempt = 1),
                count(DISTINCT payload->>'n') FROM jobs",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((total, once, distinct), (2000, 2000, 2000), "every job completed, each exactly once");
    assert_eq!(airlock_worker::WorkerStats::get(&stats.lease_lost), 0, "no holder lost its lease to a move");
    let (moved, moved_running) = (moved.load(Ordering::Relaxed), moved_running.load(Ordering::Relaxed));
    eprintln!("moved out of slots left behind: {moved} waiting, {moved_running} running");
    assert!(moved_running > 0, "jobs were moved while their holders ran them");
}

#[sqlx::test(migrations = false)]
async fn an_installation_upgraded_to_the_ring_keeps_every_job_where_it_belongs(pool: PgPool) {
    // The schema as it was before the ring, with jobs in every state.
    for m in airlock_core::db::MIGRATOR.iter().filter(|m| m.version < 28) {
        sqlx::raw_sql(m.sql.clone()).execute(&pool).await.unwrap_or_else(|e| panic!("{}: {e}", m.description));
    }
    sqlx::raw_sql(
        "INSERT INTO jobs (id, kind, queue, state, attempt, unique_key, lease_owner, lease_expires_at, finished_at, effect_started_at)
         SELECT gen_random_uuid(), 't', 'default', s::job_state, 1, 'key-' || s || '-' || g,
                CASE WHEN s = 'running' THEN 'w-old' END, CASE WHEN s = 'running' THEN now() + interval '1 minute' END,
                CASE WHEN s IN ('completed', 'failed', 'cancelled') THEN now() END,
                CASE WHEN s = 'parked' THEN now() END
         FROM unnest(ARRAY['available', 'running', 'completed', 'failed', 'parked', 'cancelled']) s, generate_series(1, 50) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let before: Vec<(JobId, JobState, Option<String>)> =
        sqlx::query_as("SELECT id, state, unique_key FROM jobs ORDER BY id").fetch_all(&pool).await.unwrap();

    // The ring, and every migration after it.
    for m in airlock_core::db::MIGRATOR.iter().filter(|m| m.version >= 28) {
        sqlx::raw_sql(m.sql.clone()).execute(&pool).await.unwrap_or_else(|e| panic!("{}: {e}", m.description));
    }

    let after: Vec<(JobId, JobState, Option<String>, String)> =
        sqlx::query_as("SELECT id, state, unique_key, tableoid::regclass::text FROM jobs ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(after.len(), before.len(), "no job lost, none duplicated");
    for ((id, state, key), (id2, state2, key2, part)) in before.iter().zip(&after) {
        assert_eq!((id, state, key), (id2, state2, key2));
        let live = matches!(state, JobState::Available | JobState::Running | JobState::Parked);
        assert_eq!(part, if live { "jobs_ring_0" } else { "jobs_done" }, "{id} {state:?}");
    }
    // The queue works on them: the live keys still hold, the finished ones are free again,
    // the available jobs are claimed and the running one's holder completes it.
    let live_key = enqueue(&pool, NewJob::new("t", json!({})).unique_key("key-parked-7")).await;
    assert!(!live_key.inserted);
    assert!(enqueue(&pool, NewJob::new("t", json!({})).unique_key("key-completed-7")).await.inserted);
    assert_eq!(claim(&pool, 100).await.len(), 51);
    let running: (JobId, i32) = sqlx::query_as("SELECT id, attempt FROM jobs WHERE lease_owner = 'w-old' LIMIT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    let held: queue::Lease = sqlx::query_as::<_, queue::Job>("SELECT * FROM jobs WHERE id = $1")
        .bind(running.0)
        .fetch_one(&pool)
        .await
        .unwrap()
        .lease();
    queue::complete(&pool, held).await.unwrap();
    assert_eq!(partition_of(&pool, running.0).await, "jobs_done");
}

/// A job written straight into `jobs` (an operator's repair, a restore), as the columns
/// name it; `slot` -1 puts a live one in `jobs_long`, otherwise it goes to the current slot.
struct Written {
    state: &'static str,
    kind: &'static str,
    queue: String,
    attempt: i32,
    max_attempts: i32,
    leased: bool,
    effect_started: bool,
    finished: bool,
    slot: Option<i16>,
}

impl Written {
    fn live(state: &'static str) -> Self {
        Written {
            state,
            kind: "t",
            queue: "default".into(),
            attempt: 1,
            max_attempts: 5,
            leased: state == "running",
            effect_started: false,
            finished: false,
            slot: None,
        }
    }

    fn done(state: &'static str) -> Self {
        Written { leased: false, finished: true, ..Written::live(state) }
    }

    /// The constraint the write broke, or `None` when it was taken.
    async fn write(&self, pool: &PgPool) -> Option<String> {
        let r = sqlx::query(
            "INSERT INTO jobs (id, kind, queue, state, attempt, max_attempts, lease_owner, lease_expires_at,
                               effect_started_at, finished_at, slot)
             VALUES ($1, $2, $3, $4::job_state, $5, $6, CASE WHEN $7 THEN 'w' END,
                     CASE WHEN $7 THEN now() + interval '1 minute' END, CASE WHEN $8 THEN now() END,
                     CASE WHEN $9 THEN now() END, coalesce($10, airlock_job_slot()))",
        )
        .bind(JobId::new())
        .bind(self.kind)
        .bind(&self.queue)
        .bind(self.state)
        .bind(self.attempt)
        .bind(self.max_attempts)
        .bind(self.leased)
        .bind(self.effect_started)
        .bind(self.finished)
        .bind(self.slot)
        .execute(pool)
        .await;
        match r {
            Ok(_) => None,
            Err(sqlx::Error::Database(e)) => {
                assert_eq!(e.code().as_deref(), Some("23514"), "{e}");
                Some(e.constraint().unwrap_or_default().to_string())
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_partition_refuses_a_job_that_breaks_the_rules_of_its_state(pool: PgPool) {
    let long = |w: Written| Written { slot: Some(-1), ..w };
    let cases: Vec<(&str, Written, Option<&str>)> = vec![
        ("an available job", Written::live("available"), None),
        ("a running job with its lease", Written::live("running"), None),
        ("a parked job whose effect started", Written { effect_started: true, ..Written::live("parked") }, None),
        ("a running job in jobs_long", long(Written::live("running")), None),
        ("a completed job", Written::done("completed"), None),
        ("a failed job at its last attempt", Written { attempt: 5, ..Written::done("failed") }, None),
        (
            "a running job without a lease",
            Written { leased: false, ..Written::live("running") },
            Some("jobs_running_has_lease"),
        ),
        (
            "an available job with a lease",
            Written { leased: true, ..Written::live("available") },
            Some("jobs_running_has_lease"),
        ),
        (
            "a parked job with a lease in jobs_long",
            long(Written { leased: true, ..Written::live("parked") }),
            Some("jobs_running_has_lease"),
        ),
        (
            "an available job whose effect started",
            Written { effect_started: true, ..Written::live("available") },
            Some("jobs_effect_only_when_held"),
        ),
        (
            "a live job with a finish time",
            Written { finished: true, ..Written::live("available") },
            Some("jobs_live_unfinished"),
        ),
        ("a live job past its attempts", Written { attempt: 6, ..Written::live("running") }, Some("jobs_attempts")),
        ("a job of no kind", Written { kind: "", ..Written::live("available") }, Some("jobs_kind_check")),
        (
            "a job of an overlong queue",
            Written { queue: "q".repeat(101), ..Written::live("available") },
            Some("jobs_queue_check"),
        ),
        (
            "a completed job without a finish time",
            Written { finished: false, ..Written::done("completed") },
            Some("jobs_done_finished_at"),
        ),
        (
            "a completed job still leased",
            Written { leased: true, ..Written::done("completed") },
            Some("jobs_running_has_lease"),
        ),
        (
            "a failed job whose effect started",
            Written { effect_started: true, ..Written::done("failed") },
            Some("jobs_effect_only_when_held"),
        ),
        (
            "a cancelled job past its attempts",
            Written { attempt: 6, ..Written::done("cancelled") },
            Some("jobs_attempts"),
        ),
        ("a finished job of no kind", Written { kind: "", ..Written::done("completed") }, Some("jobs_kind_check")),
        (
            "a finished job of no queue",
            Written { queue: String::new(), ..Written::done("completed") },
            Some("jobs_queue_check"),
        ),
    ];
    let mut taken = 0;
    for (what, w, broken) in &cases {
        assert_eq!(w.write(&pool).await.as_deref(), *broken, "{what}");
        taken += usize::from(broken.is_none());
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(count, taken as i64, "only the jobs that keep the rules were written");
    let long: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs_long").fetch_one(&pool).await.unwrap();
    assert_eq!(long, 1, "the slot -1 job lies in jobs_long");
}

/// A worker's claim reads the slots its last claim found holding rows. One made current
/// since holds jobs the claim cannot see, however urgent: the claim says so, and the next
/// claim, told of it, takes them; a claim told every slot holding rows passes none over.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_claim_that_passed_over_a_slot_holding_jobs_says_so(pool: PgPool) {
    let known = [current(&pool).await];
    let first = enqueue(&pool, NewJob::new("test.ping", json!({}))).await.id;
    // An empty slot made current, and a more urgent job enqueued into it.
    let next = (known[0] + 1) % 4;
    sqlx::query("UPDATE job_ring SET current = $1, since = now()").bind(next).execute(&pool).await.unwrap();
    let urgent = enqueue(&pool, NewJob::new("test.ping", json!({})).priority(0)).await.id;
    assert_eq!(partition_of(&pool, urgent).await, format!("jobs_ring_{next}"));

    let filter = ClaimFilter::default();
    let claim =
        queue::Claim { owner: "w", filter: &filter, limit: 10, lease: LEASE, paused: &[], from: None, ring: &known };
    let claimed = queue::complete_and_claim(&pool, &claim, &[]).await.unwrap();
    assert_eq!(claimed.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![first], "the slot it was told of");
    assert_eq!(claimed.ring, vec![known[0], next], "the slots holding rows now");
    assert!(claimed.passed_over, "a slot holding rows was not read");

    let told = queue::Claim { ring: &claimed.ring, ..claim };
    let again = queue::complete_and_claim(&pool, &told, &[]).await.unwrap();
    assert_eq!(again.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![urgent], "the job passed over, once");
    assert!(!again.passed_over);
    let none = queue::complete_and_claim(&pool, &told, &[]).await.unwrap();
    assert!(none.jobs.is_empty() && !none.passed_over, "short, and nothing passed over: nothing left");

    // Told of no slot at all (every slot empty when it last looked), it reads `jobs_long`.
    let empty = queue::Claim { ring: &[], ..claim };
    let leases = [claimed.jobs[0].lease(), again.jobs[0].lease()];
    assert_eq!(queue::complete_many(&pool, &leases).await.unwrap().len(), 2);
    let later = enqueue(&pool, NewJob::new("test.ping", json!({}))).await.id;
    let blind = queue::complete_and_claim(&pool, &empty, &[]).await.unwrap();
    assert!(blind.jobs.is_empty() && blind.passed_over, "{blind:?}");
    let seen = queue::complete_and_claim(&pool, &queue::Claim { ring: &blind.ring, ..claim }, &[]).await.unwrap();
    assert_eq!(seen.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![later]);
    let twice: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE attempt > 1").fetch_one(&pool).await.unwrap();
    assert_eq!(twice, 0, "no job claimed twice");
}
