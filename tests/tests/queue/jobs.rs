//! The job queue against a real Postgres, a fresh database per test.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use airlock_core::ids::JobId;
use airlock_queue::{self as queue, ClaimFilter, EffectClass, FailOutcome, JobState, NewJob, QueueError};
use airlock_tests::harness;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(30);

/// A claim of up to `limit` jobs for `w`, starting at `from` (`None`: the front), reading
/// every slot of the ring.
fn claim_from(filter: &ClaimFilter, limit: i64, from: Option<queue::ClaimFrom>) -> queue::Claim<'_> {
    queue::Claim { owner: "w", filter, limit, lease: LEASE, paused: &[], from, ring: &queue::RING_SLOTS }
}

async fn enqueue(pool: &PgPool, job: NewJob) -> queue::Enqueued {
    let mut tx = pool.begin().await.unwrap();
    let e = queue::enqueue(&mut tx, &job).await.unwrap();
    tx.commit().await.unwrap();
    e
}

async fn claim_one(pool: &PgPool, owner: &str) -> Option<queue::Job> {
    queue::claim_batch(pool, owner, &ClaimFilter::default(), 1, LEASE).await.unwrap().pop()
}

async fn expire_lease(pool: &PgPool, id: JobId) {
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

async fn rescue(pool: &PgPool) -> Vec<queue::Rescued> {
    let mut tx = pool.begin().await.unwrap();
    let r = queue::rescue_expired(&mut tx, 100).await.unwrap();
    tx.commit().await.unwrap();
    r
}

async fn make_due(pool: &PgPool, id: JobId) {
    sqlx::query("UPDATE jobs SET run_at = now() WHERE id = $1").bind(id).execute(pool).await.unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn eight_claimers_complete_ten_thousand_jobs_exactly_once(pool: PgPool) {
    let total = 10_000usize;
    for chunk in 0..10 {
        let jobs: Vec<NewJob> =
            (0..total / 10).map(|i| NewJob::new("test.noop", json!({"n": chunk * 1000 + i}))).collect();
        let mut tx = pool.begin().await.unwrap();
        let out = queue::enqueue_many(&mut tx, &jobs).await.unwrap();
        assert!(out.iter().all(|e| e.inserted));
        tx.commit().await.unwrap();
    }

    let mut handles = Vec::new();
    for w in 0..8 {
        let pool = pool.clone();
        handles.push(tokio::spawn(async move {
            let owner = format!("claimer-{w}");
            let mut done = Vec::new();
            loop {
                let jobs = queue::claim_batch(&pool, &owner, &ClaimFilter::default(), 16, LEASE).await.unwrap();
                if jobs.is_empty() {
                    return done;
                }
                for job in jobs {
                    assert_eq!(job.attempt, 1, "a job was claimed twice");
                    queue::complete(&pool, job.lease()).await.unwrap();
                    done.push(job.id);
                }
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut count = 0;
    for h in handles {
        for id in h.await.unwrap() {
            count += 1;
            assert!(seen.insert(id), "job {id} completed by two claimers");
        }
    }
    assert_eq!(count, total);
    let (completed, other): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'completed' AND attempt = 1), count(*) FILTER (WHERE state <> 'completed') FROM jobs",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(completed as usize, total);
    assert_eq!(other, 0, "jobs left behind");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_holder_whose_lease_was_taken_over_cannot_write(pool: PgPool) {
    let e = enqueue(&pool, NewJob::new("test.noop", json!({}))).await;
    let first = claim_one(&pool, "worker-a").await.unwrap();
    assert_eq!(first.attempt, 1);

    expire_lease(&pool, e.id).await;
    let rescued = rescue(&pool).await;
    assert_eq!(rescued.len(), 1);
    make_due(&pool, e.id).await;
    let second = claim_one(&pool, "worker-b").await.unwrap();
    assert_eq!(second.id, e.id);
    assert_eq!(second.attempt, 2);

    let stale = first.lease();
    let lost = |r: Result<(), QueueError>| matches!(r, Err(QueueError::LeaseLost { .. }));
    assert!(lost(queue::complete(&pool, stale).await), "stale complete refused");
    assert!(lost(queue::heartbeat(&pool, stale, LEASE).await), "stale heartbeat refused");
    assert!(lost(queue::mark_effect_started(&pool, stale).await), "stale effect refused");
    assert!(lost(queue::snooze(&pool, stale, LEASE).await), "stale snooze refused");
    assert!(lost(queue::park(&pool, stale, "x").await), "stale park refused");
    assert!(matches!(queue::fail(&pool, stale, "boom", false, None).await, Err(QueueError::LeaseLost { .. })));
    assert!(queue::heartbeat_many(&pool, &[stale], LEASE).await.unwrap().is_empty());

    // The new holder's result stands.
    queue::complete(&pool, second.lease()).await.unwrap();
    let job = queue::get(&pool, e.id).await.unwrap();
    assert_eq!(job.state, JobState::Completed);
    assert_eq!(job.attempt, 2);
    assert!(lost(queue::complete(&pool, second.lease()).await), "completing twice is refused");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_expired_lease_cannot_start_an_effect(pool: PgPool) {
    let e = enqueue(&pool, NewJob::new("test.send", json!({})).effect_class(EffectClass::NonRepeatable)).await;
    let job = claim_one(&pool, "paused-worker").await.unwrap();
    expire_lease(&pool, e.id).await;
    // Not yet rescued, but the lease is over: no effect may start under it.
    assert!(matches!(queue::mark_effect_started(&pool, job.lease()).await, Err(QueueError::LeaseLost { .. })));
    let rescued = rescue(&pool).await;
    assert_eq!(rescued[0].outcome, queue::RescueOutcome::Retried, "no effect started: safe to retry");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn rescuer_follows_the_effect_class(pool: PgPool) {
    let pure = enqueue(&pool, NewJob::new("t", json!({})).effect_class(EffectClass::Pure)).await.id;
    let idem = enqueue(&pool, NewJob::new("t", json!({})).effect_class(EffectClass::Idempotent)).await.id;
    let nonrep = enqueue(&pool, NewJob::new("t", json!({})).effect_class(EffectClass::NonRepeatable)).await.id;
    let nonrep_unstarted =
        enqueue(&pool, NewJob::new("t", json!({})).effect_class(EffectClass::NonRepeatable)).await.id;
    let exhausted = enqueue(&pool, NewJob::new("t", json!({})).max_attempts(1)).await.id;

    let claimed = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 5);
    for j in &claimed {
        if j.id == idem || j.id == nonrep {
            queue::mark_effect_started(&pool, j.lease()).await.unwrap();
        }
    }
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second'").execute(&pool).await.unwrap();
    let rescued = rescue(&pool).await;
    assert_eq!(queue::RescueCounts::of(&rescued), queue::RescueCounts { retried: 3, failed: 1, parked: 1 });

    let state = |id| {
        let pool = pool.clone();
        async move { queue::get(&pool, id).await.unwrap() }
    };
    assert_eq!(state(pure).await.state, JobState::Available);
    assert_eq!(state(idem).await.state, JobState::Available, "idempotent effects are retried with their key");
    assert!(state(idem).await.effect_started_at.is_none());
    let parked = state(nonrep).await;
    assert_eq!(parked.state, JobState::Parked, "a started non-repeatable effect waits for a human");
    assert!(parked.effect_started_at.is_some());
    assert!(parked.finished_at.is_none());
    assert_eq!(state(nonrep_unstarted).await.state, JobState::Available);
    assert_eq!(state(exhausted).await.state, JobState::Failed);
    let started: Vec<bool> =
        rescued.iter().filter(|r| r.job.id == nonrep || r.job.id == idem).map(|r| r.effect_started).collect();
    assert_eq!(started, vec![true, true]);

    // A second pass finds nothing: rescue is not repeated.
    assert!(rescue(&pool).await.is_empty());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn backoff_grows_and_stops_at_max_attempts(pool: PgPool) {
    let id = enqueue(&pool, NewJob::new("t", json!({})).max_attempts(4)).await.id;
    let mut delays = Vec::new();
    for attempt in 1..=4 {
        let job = claim_one(&pool, "w").await.unwrap();
        assert_eq!(job.attempt, attempt);
        let outcome = queue::fail(&pool, job.lease(), "transient", false, None).await.unwrap();
        if attempt < 4 {
            assert_eq!(outcome, FailOutcome::Retry);
            let secs: f64 =
                sqlx::query_scalar("SELECT extract(epoch FROM run_at - now())::float8 FROM jobs WHERE id = $1")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            delays.push(secs);
            assert!(claim_one(&pool, "w").await.is_none(), "not claimable before its backoff");
            make_due(&pool, id).await;
        } else {
            assert_eq!(outcome, FailOutcome::Failed);
        }
    }
    // 1 s, 2 s, 4 s, each ±20%.
    for (i, d) in delays.iter().enumerate() {
        let base = 2f64.powi(i as i32);
        assert!(*d > base * 0.75 && *d < base * 1.25, "delay {i} was {d}, expected about {base}");
    }
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.state, JobState::Failed);
    assert!(job.finished_at.is_some());
    assert_eq!(job.last_error.as_deref(), Some("transient"));
    assert!(claim_one(&pool, "w").await.is_none());

    let cap: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM airlock_backoff(40))::float8").fetch_one(&pool).await.unwrap();
    assert!(cap <= 3600.0 * 1.2 + 1.0, "backoff is capped, got {cap}");

    // A permanent failure does not retry; an explicit delay overrides the backoff.
    let p = enqueue(&pool, NewJob::new("t", json!({}))).await.id;
    let job = claim_one(&pool, "w").await.unwrap();
    assert_eq!(queue::fail(&pool, job.lease(), "bad input", true, None).await.unwrap(), FailOutcome::Failed);
    assert_eq!(queue::get(&pool, p).await.unwrap().state, JobState::Failed);
    let d = enqueue(&pool, NewJob::new("t", json!({}))).await.id;
    let job = claim_one(&pool, "w").await.unwrap();
    queue::fail(&pool, job.lease(), "busy", false, Some(Duration::from_secs(600))).await.unwrap();
    let secs: f64 = sqlx::query_scalar("SELECT extract(epoch FROM run_at - now())::float8 FROM jobs WHERE id = $1")
        .bind(d)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!((590.0..=600.0).contains(&secs), "{secs}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn unique_keys_deduplicate_live_jobs(pool: PgPool) {
    let a = enqueue(&pool, NewJob::new("t", json!({"v": 1})).unique_key("k1")).await;
    let b = enqueue(&pool, NewJob::new("t", json!({"v": 2})).unique_key("k1")).await;
    assert!(a.inserted);
    assert!(!b.inserted);
    assert_eq!(a.id, b.id);

    // Within one batch too.
    let mut tx = pool.begin().await.unwrap();
    let out = queue::enqueue_many(
        &mut tx,
        &[
            NewJob::new("t", json!({})).unique_key("k2"),
            NewJob::new("t", json!({})).unique_key("k2"),
            NewJob::new("t", json!({})).unique_key("k1"),
            NewJob::new("t", json!({})),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(out[0].inserted && !out[1].inserted && !out[2].inserted && out[3].inserted);
    assert_eq!(out[0].id, out[1].id);
    assert_eq!(out[2].id, a.id);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(n, 3);

    // Once the job is finished, the key is free again.
    let claimed = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    for j in claimed {
        queue::complete(&pool, j.lease()).await.unwrap();
    }
    let c = enqueue(&pool, NewJob::new("t", json!({})).unique_key("k1")).await;
    assert!(c.inserted);
    assert_ne!(c.id, a.id);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn scheduling_and_priorities_order_claims(pool: PgPool) {
    let later =
        enqueue(&pool, NewJob::new("t", json!({})).run_at(chrono::Utc::now() + chrono::Duration::hours(1))).await.id;
    let p5 = enqueue(&pool, NewJob::new("t", json!({})).priority(5)).await.id;
    let p1 = enqueue(&pool, NewJob::new("t", json!({})).priority(1)).await.id;
    let p3a = enqueue(&pool, NewJob::new("t", json!({})).priority(3)).await.id;
    let p3b = enqueue(&pool, NewJob::new("t", json!({})).priority(3)).await.id;

    let mut order = Vec::new();
    while let Some(j) = claim_one(&pool, "w").await {
        order.push(j.id);
    }
    assert_eq!(order, vec![p1, p3a, p3b, p5], "priority first, then age; the future job waits");
    assert_eq!(queue::get(&pool, later).await.unwrap().state, JobState::Available);
    make_due(&pool, later).await;
    assert_eq!(claim_one(&pool, "w").await.unwrap().id, later);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn named_queues_and_pauses(pool: PgPool) {
    let send = enqueue(&pool, NewJob::new("t", json!({})).queue("send")).await.id;
    let other = enqueue(&pool, NewJob::new("t", json!({})).queue("other")).await.id;
    let only_send = ClaimFilter { queues: Some(vec!["send".into()]) };

    // A queue name that would break a naively quoted statement.
    let odd_name = "it's \\ odd";
    let odd = enqueue(&pool, NewJob::new("t", json!({})).queue(odd_name)).await.id;
    queue::pause_queue(&pool, odd_name, "odd").await.unwrap();

    queue::pause_queue(&pool, "send", "switch off").await.unwrap();
    assert!(queue::claim_batch(&pool, "w", &only_send, 10, LEASE).await.unwrap().is_empty());
    let all = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    assert_eq!(all.iter().map(|j| j.id).collect::<Vec<_>>(), vec![other], "a paused queue is skipped");

    queue::resume_queue(&pool, odd_name).await.unwrap();
    let got = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![odd]);

    queue::resume_queue(&pool, "send").await.unwrap();
    let got = queue::claim_batch(&pool, "w", &only_send, 10, LEASE).await.unwrap();
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), vec![send]);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn snooze_release_and_cancel(pool: PgPool) {
    let id = enqueue(&pool, NewJob::new("t", json!({})).max_attempts(2)).await.id;
    let j = claim_one(&pool, "w").await.unwrap();
    queue::snooze(&pool, j.lease(), Duration::from_secs(3600)).await.unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.state, job.attempt, job.max_attempts), (JobState::Available, 1, 3), "snooze spends no attempt");
    assert!(claim_one(&pool, "w").await.is_none());

    make_due(&pool, id).await;
    let j = claim_one(&pool, "w").await.unwrap();
    assert_eq!(j.attempt, 2, "the epoch only grows");
    assert!(matches!(queue::cancel(&pool, id, "no").await, Err(QueueError::InvalidTransition { .. })));
    queue::release(&pool, j.lease()).await.unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!((job.state, job.max_attempts), (JobState::Available, 4));

    // Release is refused once the effect may have started.
    let j = claim_one(&pool, "w").await.unwrap();
    queue::mark_effect_started(&pool, j.lease()).await.unwrap();
    assert!(matches!(queue::release(&pool, j.lease()).await, Err(QueueError::LeaseLost { .. })));
    queue::fail(&pool, j.lease(), "x", false, None).await.unwrap();

    queue::cancel(&pool, id, "operator said so").await.unwrap();
    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.state, JobState::Cancelled);
    assert!(job.finished_at.is_some());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn retention_prunes_old_finished_jobs_in_batches(pool: PgPool) {
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(enqueue(&pool, NewJob::new("t", json!({}))).await.id);
    }
    let claimed = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 4, LEASE).await.unwrap();
    queue::complete(&pool, claimed[0].lease()).await.unwrap();
    queue::complete(&pool, claimed[1].lease()).await.unwrap();
    queue::complete(&pool, claimed[2].lease()).await.unwrap();
    queue::fail(&pool, claimed[3].lease(), "x", true, None).await.unwrap();
    // Two completed and the failed one are old; one completed is recent; one is available.
    sqlx::query("UPDATE jobs SET finished_at = now() - interval '2 days' WHERE id = ANY($1)")
        .bind(vec![claimed[0].id, claimed[1].id, claimed[3].id])
        .execute(&pool)
        .await
        .unwrap();

    let day = Duration::from_secs(86_400);
    assert_eq!(queue::prune_finished(&pool, day, 1).await.unwrap(), 1);
    assert_eq!(queue::prune_finished(&pool, day, 1).await.unwrap(), 1);
    assert_eq!(queue::prune_finished(&pool, day, 1).await.unwrap(), 0);
    let left: Vec<(JobId, JobState)> =
        sqlx::query_as("SELECT id, state FROM jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    assert_eq!(left.len(), 3);
    assert!(left.iter().any(|(id, s)| *id == claimed[2].id && *s == JobState::Completed), "recent kept");
    assert!(left.iter().any(|(id, s)| *id == claimed[3].id && *s == JobState::Failed), "failed kept");
    assert!(left.iter().any(|(_, s)| *s == JobState::Available), "live kept");
}

/// Enqueues `n` available jobs in one statement and takes the statistics a queue has: those
/// of the partitions that keep them (the long-lived live jobs, empty, and the finished ones);
/// the ring's slots never have any (see `migrations/0028_job_ring.sql`).
async fn analyzed_backlog(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO jobs (id, kind, queue, payload) SELECT gen_random_uuid(), 't', 'default', '{}' \
         FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE jobs_long, jobs_done").execute(pool).await.unwrap();
}

/// What every plan over `jobs` of the queue's hot paths must be: the finished jobs are not
/// read at all, no slot of the ring is read whole, and `jobs_long` only while it is empty
/// (its statistics, taken when empty, make a scan of it the cheapest, and it is: nothing).
async fn assert_live_partitions_through_indexes(pool: &PgPool, case: &str, plan: &str) {
    assert!(!plan.contains("jobs_done"), "{case}: the finished jobs are never read: {plan}");
    assert!(!plan.contains("Seq Scan on jobs_ring"), "{case}: no slot of the ring read whole: {plan}");
    if plan.contains("Seq Scan on jobs_long") {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs_long").fetch_one(pool).await.unwrap();
        assert_eq!(n, 0, "{case}: jobs_long is read whole only while empty: {plan}");
    }
}

async fn prepare_function(conn: &mut sqlx::PgConnection, name: &str) -> Vec<String> {
    let prepared = airlock_bench::plans::prepare_function(conn, name).await.unwrap();
    assert!(!prepared.is_empty(), "{name} runs no statement");
    prepared
}

async fn unprepare(conn: &mut sqlx::PgConnection, statements: &[String]) {
    airlock_bench::plans::unprepare(conn, statements).await.unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_claim_walks_the_partial_index_even_behind_a_backlog(pool: PgPool) {
    // A backlog of 50k jobs and the send queue paused (as it is by default): a plan that
    // sorts the backlog would cost tens of milliseconds per claim.
    analyzed_backlog(&pool, 50_000).await;
    let paused: Vec<String> =
        sqlx::query_scalar("SELECT coalesce(array_agg(queue), '{}') FROM queue_pauses").fetch_one(&pool).await.unwrap();
    assert_eq!(paused, vec!["send".to_string()]);
    // The claim is kept prepared by the worker: its plan must be right both custom (for its
    // actual values) and generic (the one a worker keeps), under the settings of the
    // worker's connections, whatever queues are paused, from the front of the claim order
    // or from a worker's cursor, with completions or without.
    let mut conn = pool.acquire().await.unwrap();
    airlock_core::db::set_queue_plans(&mut conn).await.unwrap();
    let held = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 1, LEASE).await.unwrap();
    let completing = [held[0].lease()];
    let in_slot = format!(", '{}', {}", held[0].id, held[0].attempt);
    let statements = [
        ("claim", queue::CLAIM_SQL, ""),
        ("complete and claim", queue::COMPLETE_AND_CLAIM_SQL, ", '{}', '{}', true"),
        (
            "complete in the slot and claim",
            queue::slotted::complete_and_claim_sql(&completing, true).unwrap(),
            &in_slot,
        ),
    ];
    let pauses = ["'{}'", "'{send}'", r#"'{send,"it''s \\ odd"}'"#];
    let froms = ["NULL, NULL, NULL", "100, now() - interval '1 hour', gen_random_uuid()"];
    for (what, sql, completions) in statements {
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE claim AS {sql}"))).execute(&mut *conn).await.unwrap();
        for (paused, from, queues) in
            pauses.iter().flat_map(|p| froms.iter().flat_map(move |f| ["NULL", "'{default}'"].map(move |q| (p, f, q))))
        {
            // The ring's slots that hold rows: the backlog's.
            let args = format!("'w', {queues}, {paused}, 10, 30, {from}, '{{0}}'{completions}");
            for (mode, plan) in harness::plans(&mut conn, "claim", &args).await {
                let case = format!("{what}: paused {paused}, from {from}, queues {queues}, {mode}");
                // The backlog's slot is walked in claim order, from where the claim starts,
                // merged with `jobs_long`'s claim index.
                assert!(plan.contains("Index Scan using jobs_ring_0_claim_idx"), "{case}: {plan}");
                assert!(plan.contains("Index Scan using jobs_long_claim_idx"), "{case}: {plan}");
                assert!(plan.contains("Merge Append"), "{case}: {plan}");
                // The slots not named are passed over when the plan starts.
                assert!(!plan.contains("jobs_ring_1_claim_idx"), "{case}: a slot not named is not read: {plan}");
                assert!(!plan.contains("jobs_ring_1_pkey"), "{case}: a slot not named is not read: {plan}");
                if from.starts_with("100") {
                    assert!(plan.contains("ROW(priority, run_at, id) >="), "{case}: the bound starts the scan: {plan}");
                }
                // Each job locked is updated through the primary key.
                assert!(plan.contains("Index Scan using jobs_ring_0_pkey"), "{case}: {plan}");
                assert!(!plan.contains("Sort  ("), "{case}: no sort of the backlog: {plan}");
                assert!(!plan.contains("Hash Join") && !plan.contains("Merge Join"), "{case}: {plan}");
                assert!(!plan.contains("Seq Scan on jobs"), "{case}: no partition read whole: {plan}");
                let finished =
                    plan.lines().filter(|l| l.contains("jobs_done")).all(|l| l.contains("Insert on jobs_done"));
                assert!(finished, "{case}: the finished jobs are written, never read: {plan}");
            }
        }
        sqlx::query("DEALLOCATE claim").execute(&mut *conn).await.unwrap();
    }
    sqlx::query("RESET ALL").execute(&mut *conn).await.unwrap();
    drop(conn);
    let claimed = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 10);
    assert!(claimed.iter().all(|j| j.priority > held[0].priority || j.run_at >= held[0].run_at));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn writes_fenced_on_a_lease_find_their_rows_through_the_primary_key(pool: PgPool) {
    // The worst time to plan: the slots nearly empty, as just after one was truncated. Reading
    // a slot whole then looks cheaper than looking jobs up, and a plan kept while the slot
    // fills would read it whole at every use.
    analyzed_backlog(&pool, 10).await;
    let held = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    assert_eq!(held.len(), 10);
    let ids = format!("'{{{}}}'", held.iter().map(|j| j.id.to_string()).collect::<Vec<_>>().join(","));
    let attempts = format!("'{{{}}}'", held.iter().map(|j| j.attempt.to_string()).collect::<Vec<_>>().join(","));
    let mut conn = pool.acquire().await.unwrap();

    // The writes over held jobs (heartbeats, effect marks, completions: the queue's and the
    // other crates' pieces alike) run in the schema's functions; each of their statements,
    // planned with the function's settings, reaches each job through its primary key.
    let functions = [
        ("airlock_jobs_heartbeat", format!("{ids}, {attempts}, 30")),
        ("airlock_jobs_mark_effect_started", format!("{ids}, {attempts}")),
        ("airlock_jobs_complete", format!("{ids}, {attempts}, true")),
    ];
    for (name, args) in functions {
        let statements = prepare_function(&mut conn, name).await;
        for statement in &statements {
            for (mode, plan) in harness::plans(&mut conn, statement, &args).await {
                let case = format!("{statement}, {mode}");
                // The held jobs lie in the ring's first slot.
                assert!(plan.contains("Index Scan using jobs_ring_0_pkey"), "{case}: {plan}");
                assert!(!plan.contains("_lease_idx"), "{case}: no read of a lease index: {plan}");
                assert!(
                    !plan.contains("Hash Join") && !plan.contains("Merge Join"),
                    "{case}: no join of whole slots: {plan}"
                );
                assert!(!plan.contains("Seq Scan on jobs"), "{case}: no partition read whole: {plan}");
                let finished =
                    plan.lines().filter(|l| l.contains("jobs_done")).all(|l| l.contains("Insert on jobs_done"));
                assert!(finished, "{case}: the finished jobs are written, never read: {plan}");
            }
        }
        unprepare(&mut conn, &statements).await;
    }

    // The statements that reach one held job by its id, planned as any process plans them.
    let one = format!("'{}', {}", held[0].id, held[0].attempt);
    let mut qb = queue::piece::Builder::new("SELECT ");
    queue::piece::push_is_held(&mut qb, held[0].lease());
    let is_held = qb.into_string().replace("$1", "$1::uuid").replace("$2", "$2::int");
    for (name, sql) in [("ensure_held", queue::ENSURE_HELD_SQL), ("piece::push_is_held", is_held.as_str())] {
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE fenced AS {sql}"))).execute(&mut *conn).await.unwrap();
        for (mode, plan) in harness::plans(&mut conn, "fenced", &one).await {
            assert!(plan.contains("Index Scan using jobs_ring_0_pkey"), "{name}, {mode}: {plan}");
            assert_live_partitions_through_indexes(&pool, &format!("{name}, {mode}"), &plan).await;
        }
        sqlx::query("DEALLOCATE fenced").execute(&mut *conn).await.unwrap();
    }
    // A completion of one held job names its slot's partition, and reaches every other
    // partition only when the job is not there any more (through `airlock_jobs_complete`,
    // whose plans are above).
    // Planned as the worker's connections plan them.
    airlock_core::db::set_queue_plans(&mut conn).await.unwrap();
    let lease = [held[0].lease()];
    let claim_args = "'w', NULL, '{}', 10, 30, NULL, NULL, NULL, '{0}'";
    for keep in [true, false] {
        let complete = queue::slotted::complete_sql(&lease, keep).unwrap();
        let complete_and_claim = queue::slotted::complete_and_claim_sql(&lease, keep).unwrap();
        for (name, sql, args) in [
            ("complete", complete, one.clone()),
            ("complete_and_claim", complete_and_claim, format!("{claim_args}, {one}")),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE slotted AS {sql}"))).execute(&mut *conn).await.unwrap();
            for (mode, plan) in harness::plans(&mut conn, "slotted", &args).await {
                let case = format!("slotted {name}, keep {keep}, {mode}");
                assert!(plan.contains("Delete on jobs_ring_0"), "{case}: {plan}");
                let deletes = plan.lines().filter(|l| l.contains("Delete on")).collect::<Vec<_>>();
                assert!(
                    deletes.iter().all(|l| l.contains("Delete on jobs_ring_0")),
                    "{case}: the held job's partition alone: {plan}"
                );
                assert!(plan.contains("Index Scan using jobs_ring_0_pkey"), "{case}: {plan}");
                assert!(plan.contains("One-Time Filter"), "{case}: the fallback runs only when needed: {plan}");
                assert!(!plan.contains("Seq Scan"), "{case}: {plan}");
                if name == "complete" {
                    assert!(!plan.contains("jobs_live"), "{case}: the held job's partition alone: {plan}");
                    assert!(!plan.contains("jobs_ring_1"), "{case}: no other partition: {plan}");
                }
            }
            sqlx::query("DEALLOCATE slotted").execute(&mut *conn).await.unwrap();
        }
    }
    drop(conn);
    // The rescuer still finds expired leases.
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE lease_owner IS NOT NULL")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let rescued = queue::rescue_expired(&mut tx, 100).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rescued.len(), 10);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn statements_over_many_held_jobs_never_deadlock_each_other(pool: PgPool) {
    for _ in 0..200 {
        enqueue(&pool, NewJob::new("t", json!({}))).await;
    }
    let held: Vec<queue::Lease> = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 200, LEASE)
        .await
        .unwrap()
        .iter()
        .map(|j| j.lease())
        .collect();
    assert_eq!(held.len(), 200);
    let reversed: Vec<queue::Lease> = held.iter().rev().copied().collect();
    // Callers pass their leases in any order (a heartbeat walks a map, completions come as
    // jobs finish): two statements locking the same rows in opposite orders would deadlock.
    let beat = |leases: Vec<queue::Lease>| {
        let pool = pool.clone();
        tokio::spawn(async move {
            for _ in 0..100 {
                let kept = queue::heartbeat_many(&pool, &leases, LEASE).await.expect("no deadlock");
                assert_eq!(kept.len(), leases.len());
            }
        })
    };
    let (a, b) = (beat(held.clone()), beat(reversed.clone()));
    a.await.unwrap();
    b.await.unwrap();
    // A completion racing a heartbeat: the heartbeat extends all or none, never fails.
    let p = pool.clone();
    let done = tokio::spawn(async move { queue::complete_many(&p, &reversed).await });
    let kept = queue::heartbeat_many(&pool, &held, LEASE).await.expect("no deadlock");
    assert_eq!(done.await.unwrap().expect("no deadlock").len(), 200);
    assert!(kept.is_empty() || kept.len() == 200, "{} extended", kept.len());
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state <> 'completed'").fetch_one(&pool).await.unwrap();
    assert_eq!(left, 0);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn completions_that_delete_leave_no_row_and_a_lost_lease_deletes_nothing(pool: PgPool) {
    queue::set_delete_completed(true);
    let key = "once";
    enqueue(&pool, NewJob::new("t", json!({})).unique_key(key)).await;
    for _ in 0..9 {
        enqueue(&pool, NewJob::new("t", json!({}))).await;
    }
    let gone = |pool: PgPool, leases: Vec<queue::Lease>| async move {
        let ids: Vec<JobId> = leases.iter().map(|l| l.id()).collect();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE id = ANY ($1)")
            .bind(&ids)
            .fetch_one(&pool)
            .await
            .unwrap();
        n == 0
    };
    let held: Vec<queue::Lease> = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10, LEASE)
        .await
        .unwrap()
        .iter()
        .map(|j| j.lease())
        .collect();
    assert_eq!(held.len(), 10);
    // One by one, and many in one statement.
    queue::complete(&pool, held[0]).await.unwrap();
    assert!(gone(pool.clone(), held[..1].to_vec()).await);
    assert_eq!(queue::complete_many(&pool, &held[1..3]).await.unwrap().len(), 2);
    assert!(gone(pool.clone(), held[1..3].to_vec()).await);
    // Riding on a claim, for one job and for several.
    let filter = ClaimFilter::default();
    let claim = claim_from(&filter, 0, None);
    let done = queue::complete_and_claim(&pool, &claim, &held[3..4]).await.unwrap().done;
    assert_eq!(done, held[3..4].to_vec());
    let done = queue::complete_and_claim(&pool, &claim, &held[4..6]).await.unwrap().done;
    assert_eq!(done.len(), 2);
    assert!(gone(pool.clone(), held[3..6].to_vec()).await);
    // Another crate's statement, through the piece, for one job and for several.
    for leases in [&held[6..7], &held[7..9]] {
        let mut qb = queue::piece::Builder::new("WITH ");
        queue::piece::complete(&mut qb, "p", leases);
        qb.push(" SELECT count(*) FROM p");
        let n: i64 = qb.build_query_scalar().fetch_one(&pool).await.unwrap();
        assert_eq!(n, leases.len() as i64);
        assert!(gone(pool.clone(), leases.to_vec()).await);
    }
    // The unique key of a job completed is free again.
    assert!(enqueue(&pool, NewJob::new("t", json!({})).unique_key(key)).await.inserted);

    // A lease taken over deletes nothing, by any form: the new holder's job stays.
    let last = held[9];
    expire_lease(&pool, last.id()).await;
    assert_eq!(rescue(&pool).await.len(), 1);
    make_due(&pool, last.id()).await;
    let again = queue::claim_batch(&pool, "w2", &ClaimFilter::default(), 10, LEASE).await.unwrap();
    let taken = again.iter().find(|j| j.id == last.id()).expect("claimed again").lease();
    assert!(matches!(queue::complete(&pool, last).await, Err(QueueError::LeaseLost { .. })));
    assert!(queue::complete_many(&pool, &[last]).await.unwrap().is_empty());
    let done = queue::complete_and_claim(&pool, &claim, &[last]).await.unwrap().done;
    assert!(done.is_empty());
    let state: JobState =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(last.id()).fetch_one(&pool).await.unwrap();
    assert_eq!(state, JobState::Running, "the new holder's job is untouched");
    // A failure is kept: only a completion deletes.
    assert_eq!(queue::fail(&pool, taken, "boom", true, None).await.unwrap(), FailOutcome::Failed);
    let state: JobState =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(last.id()).fetch_one(&pool).await.unwrap();
    assert_eq!(state, JobState::Failed);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_job_an_aborted_transaction_touched_is_left_by_bounded_claims_and_taken_by_an_unbounded_one(pool: PgPool) {
    let touched = enqueue(&pool, NewJob::new("t", json!({}))).await.id;
    let other = enqueue(&pool, NewJob::new("t", json!({}))).await.id;
    // A claim that locked the job and rolled back (a statement that failed after its
    // lock, a connection that dropped) leaves its transaction id on the job's version.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM jobs WHERE id = $1 FOR UPDATE").bind(touched).execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    let xmax: String =
        sqlx::query_scalar("SELECT xmax::text FROM jobs WHERE id = $1").bind(touched).fetch_one(&pool).await.unwrap();
    assert_ne!(xmax, "0", "the aborted lock is on the version");

    let filter = ClaimFilter::default();
    let from = queue::ClaimFrom {
        priority: 100,
        run_at: chrono::Utc::now() - chrono::TimeDelta::minutes(10),
        id: airlock_core::ids::JobId(uuid::Uuid::nil()),
    };
    let bounded = claim_from(&filter, 10, Some(from));
    let jobs = queue::complete_and_claim(&pool, &bounded, &[]).await.unwrap().jobs;
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![other], "a bounded claim passes over it");
    let jobs = queue::complete_and_claim(&pool, &bounded, &[]).await.unwrap().jobs;
    assert!(jobs.is_empty(), "and keeps passing over it");
    let unbounded = queue::Claim { from: None, ..bounded };
    let jobs = queue::complete_and_claim(&pool, &unbounded, &[]).await.unwrap().jobs;
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![touched], "an unbounded claim takes it");
}

/// Buffers the scan of the claim index touches in one claim of up to 10 jobs, from the
/// front of the index or from `from`, every slot of the ring taken as holding work; the
/// claim is rolled back.
async fn claim_buffers(pool: &PgPool, from: Option<queue::ClaimFrom>) -> i64 {
    let mut tx = pool.begin().await.unwrap();
    airlock_core::db::set_queue_plans(&mut tx).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE claim AS {}", queue::CLAIM_SQL))).execute(&mut *tx).await.unwrap();
    let from = match from {
        Some(f) => format!("{}, '{}', '{}'", f.priority, f.run_at.to_rfc3339(), f.id),
        None => "NULL, NULL, NULL".to_string(),
    };
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim('w', NULL, '{{}}', 10, 30, {from}, '{{0,1,2,3}}')"
    );
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&mut *tx).await.unwrap();
    // A prepared statement outlives the rollback, and the pool may hand this connection
    // to the next call.
    sqlx::query("DEALLOCATE claim").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    /// The blocks read by the scans of every live partition's claim index under `node`.
    fn scans(node: &serde_json::Value) -> Option<i64> {
        let own = node["Index Name"]
            .as_str()
            .filter(|i| i.ends_with("_claim_idx"))
            .map(|_| node["Shared Hit Blocks"].as_i64().unwrap() + node["Shared Read Blocks"].as_i64().unwrap());
        let below = node["Plans"].as_array().into_iter().flatten().filter_map(scans).reduce(|a, b| a + b);
        match (own, below) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        }
    }
    scans(&plan[0]["Plan"]).expect("the claim scans the claim indexes")
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_pinned_horizon_does_not_make_claims_walk_every_job_claimed_since(pool: PgPool) {
    // A transaction with an xid: no version of a row changed after it began can be vacuumed
    // (or skipped by an index scan) until it ends.
    let mut pin = pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()").execute(&mut *pin).await.unwrap();
    // 20,000 jobs enqueued an hour ago, all claimed and completed since: their old
    // versions stay at the front of the claim index.
    sqlx::query(
        "INSERT INTO jobs (id, kind, queue, payload, run_at) SELECT gen_random_uuid(), 't', 'default', '{}', \
         now() - interval '1 hour' + i * interval '1 millisecond' FROM generate_series(1, 20000) i",
    )
    .execute(&pool)
    .await
    .unwrap();
    let old = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 20_000, LEASE).await.unwrap();
    assert_eq!(old.len(), 20_000);
    let leases: Vec<queue::Lease> = old.iter().map(|j| j.lease()).collect();
    assert_eq!(queue::complete_many(&pool, &leases).await.unwrap().len(), 20_000);
    for _ in 0..10 {
        enqueue(&pool, NewJob::new("t", json!({}))).await;
    }

    let from = queue::ClaimFrom {
        priority: 100,
        run_at: chrono::Utc::now() - chrono::TimeDelta::minutes(10),
        id: airlock_core::ids::JobId(uuid::Uuid::nil()),
    };
    let (front, bounded) = (claim_buffers(&pool, None).await, claim_buffers(&pool, Some(from)).await);
    eprintln!("buffers per claim: from the front {front}, bounded {bounded}");
    assert!(bounded * 10 < front, "a bounded claim skips the dead entries: {bounded} vs {front} buffers");

    // A worker notices its slow claims and bounds them, and still finds a job that sorts
    // before its cursor (a more urgent one, due an hour ago).
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("t", |_ctx| async move { Ok(airlock_worker::Outcome::Completed) });
    let worker =
        airlock_worker::Worker::new(pool.clone(), registry, settings("cursor-test", Duration::from_millis(50)));
    let stats: Stats = worker.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    let left = |pool: PgPool| async move {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state <> 'completed'").fetch_one(&pool).await.unwrap();
        (n == 0).then_some(())
    };
    airlock_tests::harness::wait_for("the first jobs done", Duration::from_secs(30), || left(pool.clone())).await;
    for _ in 0..30 {
        for _ in 0..4 {
            enqueue(&pool, NewJob::new("t", json!({}))).await;
        }
        airlock_tests::harness::wait_for("a round done", Duration::from_secs(30), || left(pool.clone())).await;
    }
    let bounded = airlock_worker::WorkerStats::get(&stats.bounded_claims);
    eprintln!("bounded claims: {bounded} of {}", airlock_worker::WorkerStats::get(&stats.claimed));
    assert!(bounded > 0, "claims started from the cursor");
    let urgent = enqueue(
        &pool,
        NewJob::new("t", json!({})).priority(0).run_at(chrono::Utc::now() - chrono::TimeDelta::hours(2)),
    )
    .await;
    airlock_tests::harness::wait_for("the urgent job done", Duration::from_secs(30), || left(pool.clone())).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    pin.rollback().await.unwrap();

    let (total, completed, attempts): (i64, i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE state = 'completed'), sum(attempt) FROM jobs")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((total, completed), (20_000 + 10 + 120 + 1, total), "every job completed");
    assert_eq!(attempts, total, "each exactly once");
    let state: JobState =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(urgent.id).fetch_one(&pool).await.unwrap();
    assert_eq!(state, JobState::Completed);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_bounded_claim_starts_at_the_last_job_claimed_not_before_a_backlog_enqueued_at_once(pool: PgPool) {
    // 20,000 jobs enqueued in one statement a minute ago: one `run_at` for all of them.
    sqlx::query(
        "INSERT INTO jobs (id, kind, queue, payload, run_at) SELECT gen_random_uuid(), 't', 'default', '{}', \
         now() - interval '1 minute' FROM generate_series(1, 20000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let first = queue::claim_batch(&pool, "w", &ClaimFilter::default(), 10_000, LEASE).await.unwrap();
    assert_eq!(first.len(), 10_000);
    let leases: Vec<queue::Lease> = first.iter().map(|j| j.lease()).collect();
    assert_eq!(queue::complete_many(&pool, &leases).await.unwrap().len(), 10_000);
    let last = first.last().unwrap();
    let at_last = queue::ClaimFrom::at(last);

    // From the last job's whole key the claim steps over none of the 10,000 entries the
    // claimed jobs left in the slot's index; from a second before its `run_at` it steps over
    // all of them.
    let second_before = queue::ClaimFrom {
        run_at: last.run_at - chrono::TimeDelta::seconds(1),
        id: JobId(uuid::Uuid::nil()),
        ..at_last
    };
    let (exact, before) = (claim_buffers(&pool, Some(at_last)).await, claim_buffers(&pool, Some(second_before)).await);
    eprintln!("buffers per claim: from the last job {exact}, from a second before it {before}");
    assert!(exact * 10 < before, "the claimed entries are not walked: {exact} vs {before} buffers");

    // And it takes the jobs after it in claim order, but for the 20 the measured (rolled
    // back) claims locked, which bounded claims pass over and an unbounded one takes:
    // nothing skipped, nothing twice.
    let filter = ClaimFilter::default();
    let bounded = claim_from(&filter, 10_000, Some(at_last));
    let rest = queue::complete_and_claim(&pool, &bounded, &[]).await.unwrap().jobs;
    assert_eq!(rest.len(), 10_000 - 20, "every job after the last one claimed but the ones passed over");
    let key = |j: &queue::Job| (j.priority, j.run_at, j.id.0);
    assert!(rest.iter().all(|j| key(j) > key(last)), "all after the cursor");
    let passed = queue::complete_and_claim(&pool, &queue::Claim { from: None, ..bounded }, &[]).await.unwrap().jobs;
    assert_eq!(passed.len(), 20);
    let ids: HashSet<JobId> = first.iter().chain(&rest).chain(&passed).map(|j| j.id).collect();
    assert_eq!(ids.len(), 20_000, "no job claimed twice");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_bounded_claim_takes_a_job_committed_behind_its_cursor_within_the_last_second(pool: PgPool) {
    // The cursor stands at a job that sorts last of everything enqueued now; a job whose
    // transaction began half a second ago commits behind it, and one scheduled a minute ago
    // (as a released or long-running enqueue's) lies well behind.
    let now = chrono::Utc::now();
    let recent = enqueue(&pool, NewJob::new("t", json!({})).run_at(now - chrono::TimeDelta::milliseconds(500))).await;
    let older = enqueue(&pool, NewJob::new("t", json!({})).run_at(now - chrono::TimeDelta::minutes(1))).await;
    let from = queue::ClaimFrom { priority: 100, run_at: now, id: JobId(uuid::Uuid::max()) };
    let filter = ClaimFilter::default();
    let bounded = claim_from(&filter, 10, Some(from));
    let jobs = queue::complete_and_claim(&pool, &bounded, &[]).await.unwrap().jobs;
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![recent.id], "the second behind is searched");
    let jobs = queue::complete_and_claim(&pool, &queue::Claim { from: None, ..bounded }, &[]).await.unwrap().jobs;
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![older.id], "the rest is the unbounded claim's");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn check_constraints_hold_the_invariants(pool: PgPool) {
    let id = enqueue(&pool, NewJob::new("t", json!({}))).await.id;
    for bad in [
        "UPDATE jobs SET state = 'running' WHERE id = $1",
        "UPDATE jobs SET state = 'completed' WHERE id = $1",
        "UPDATE jobs SET finished_at = now() WHERE id = $1",
        "UPDATE jobs SET effect_started_at = now() WHERE id = $1",
        "UPDATE jobs SET attempt = max_attempts + 1 WHERE id = $1",
    ] {
        let r = sqlx::query(bad).bind(id).execute(&pool).await;
        assert!(r.is_err(), "accepted: {bad}");
    }
}

/// Keeps a shared handle to the counters of a worker run in-process.
type Stats = Arc<airlock_worker::WorkerStats>;

/// Waits until the worker's LISTEN connection is up.
async fn wait_listening(stats: &Stats) {
    harness::wait_for("the worker to LISTEN", Duration::from_secs(30), || {
        let stats = stats.clone();
        async move { stats.listening.load(std::sync::atomic::Ordering::SeqCst).then_some(()) }
    })
    .await;
}

pub(crate) fn settings(id: &str, poll: Duration) -> airlock_worker::WorkerSettings {
    airlock_worker::WorkerSettings {
        id: id.into(),
        concurrency: 4,
        claim_batch: 4,
        complete_batch: 1,
        lease: Duration::from_secs(30),
        queues: None,
        poll_interval: poll,
        shutdown_grace: Duration::from_secs(5),
        rescue_interval: Duration::from_secs(3600),
        heartbeat_interval: Duration::from_secs(5),
        retention: None,
        delete_completed: false,
        retention_interval: Duration::from_secs(3600),
        retention_batch: 100,
        first_analyze: None,
        first_analyze_interval: Duration::from_secs(3600),
        log: Default::default(),
        ring: Default::default(),
        check_after_idle: Duration::from_secs(1),
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_idle_worker_is_woken_by_notify_not_by_polling(pool: PgPool) {
    airlock_tests::harness::init_logs();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::time::Instant>();
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("test.ping", move |_ctx| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(std::time::Instant::now());
            Ok(airlock_worker::Outcome::Completed)
        }
    });
    // The poll interval is an hour: only a notification can wake this worker in time.
    let worker =
        airlock_worker::Worker::new(pool.clone(), registry, settings("notify-test", Duration::from_secs(3600)));
    let stats: Stats = worker.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));

    wait_listening(&stats).await;
    // Let the wake-up that follows LISTEN be consumed, so the next claim is ours.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = airlock_worker::WorkerStats::get(&stats.claims_after_notify);

    let enqueued_at = std::time::Instant::now();
    enqueue(&pool, NewJob::new("test.ping", json!({}))).await;
    let started_at = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.expect("job started").unwrap();
    eprintln!("enqueue-to-start: {:?}", started_at - enqueued_at);

    assert_eq!(airlock_worker::WorkerStats::get(&stats.claims_after_notify), before + 1, "claimed after a NOTIFY");
    assert_eq!(airlock_worker::WorkerStats::get(&stats.claims_after_poll), 0, "no claim came from polling");
    assert!(airlock_worker::WorkerStats::get(&stats.notify_wakeups) >= 1);
    stop.cancel();
    run.await.unwrap().unwrap();
}

/// An idle worker polls one poll interval after it went idle, however often its running
/// jobs finish meanwhile: a job that becomes due without a NOTIFY (here: enqueued to run
/// later) starts while the running jobs are still finishing, not after all of them.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn jobs_finishing_do_not_put_an_idle_workers_poll_off(pool: PgPool) {
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("test.sleep", |ctx| async move {
        let ms = ctx.job.payload["ms"].as_u64().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(airlock_worker::Outcome::Completed)
    });
    registry.register_fn("test.ping", |_ctx| async move { Ok(airlock_worker::Outcome::Completed) });
    // Seven sleepers end one every 150 ms, for a second; the poll comes every 400 ms.
    let sleepers: Vec<NewJob> = (1..=7).map(|i| NewJob::new("test.sleep", json!({"ms": 150 * i}))).collect();
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue_many(&mut tx, &sleepers).await.unwrap();
    tx.commit().await.unwrap();
    let mut s = settings("poller", Duration::from_millis(400));
    s.concurrency = 8;
    s.claim_batch = 8;
    let worker = airlock_worker::Worker::new(pool.clone(), registry, s);
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    airlock_tests::harness::wait_for("the sleepers to run", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&pool).await.unwrap();
            (n == 7).then_some(())
        }
    })
    .await;
    // Due in 200 ms: its NOTIFY comes now, when nothing is due yet; only a poll finds it.
    let later = enqueue(
        &pool,
        NewJob::new("test.ping", json!({})).run_at(chrono::Utc::now() + chrono::TimeDelta::milliseconds(200)),
    )
    .await
    .id;
    let started = airlock_tests::harness::wait_for("the later job to run", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move { queue::get(&pool, later).await.unwrap().attempted_at }
    })
    .await;
    let last_sleeper_done: chrono::DateTime<chrono::Utc> = airlock_tests::harness::wait_for("the sleepers to end", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar("SELECT max(finished_at) FROM jobs WHERE kind = 'test.sleep' HAVING count(*) FILTER (WHERE state <> 'completed') = 0")
                .fetch_optional(&pool)
                .await
                .unwrap()
                .flatten()
        }
    })
    .await;
    assert!(
        started < last_sleeper_done,
        "the later job waited for every running job to finish ({started} vs {last_sleeper_done})"
    );
    stop.cancel();
    run.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_quiet_enqueue_is_announced_by_the_waker_after_its_commit(pool: PgPool) {
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(queue::NOTIFY_CHANNEL).await.unwrap();
    let notify = |payload: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(queue::NOTIFY_CHANNEL)
                .bind(payload)
                .execute(&pool)
                .await
                .unwrap()
        }
    };

    // The quiet enqueue's commit sends nothing: notifications arrive in commit order, and
    // the first one is the marker sent after it.
    let mut tx = pool.begin().await.unwrap();
    let job = NewJob::new("test.ping", json!({})).queue("a");
    queue::enqueue_many_quiet(&mut tx, &[job]).await.unwrap();
    tx.commit().await.unwrap();
    notify("marker-1").await;
    let mut next = async || {
        let n = tokio::time::timeout(Duration::from_secs(30), listener.recv()).await.expect("a notification");
        n.unwrap().payload().to_string()
    };
    assert_eq!(next().await, "marker-1");

    // A burst of pokes for two queues: each queue is announced, the burst in one or two
    // rounds of the waker, not once per poke.
    let waker = queue::Waker::new(pool.clone());
    for _ in 0..100 {
        waker.wake("a");
        waker.wake("b");
    }
    let mut seen = Vec::new();
    while !(seen.contains(&"a".to_string()) && seen.contains(&"b".to_string())) {
        seen.push(next().await);
    }
    notify("marker-2").await;
    loop {
        let payload = next().await;
        if payload == "marker-2" {
            break;
        }
        seen.push(payload);
    }
    assert!(seen.iter().all(|p| p == "a" || p == "b"), "{seen:?}");
    assert!(seen.len() <= 4, "200 pokes coalesced into at most two rounds: {seen:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn graceful_stop_in_process_finishes_in_flight_work(pool: PgPool) {
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("test.slow", |_ctx| async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(airlock_worker::Outcome::Completed)
    });
    for _ in 0..4 {
        enqueue(&pool, NewJob::new("test.slow", json!({}))).await;
    }
    let worker = airlock_worker::Worker::new(pool.clone(), registry, settings("drain-test", Duration::from_millis(50)));
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    airlock_tests::harness::wait_for("4 running jobs", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&pool).await.unwrap();
            (n == 4).then_some(())
        }
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let states: Vec<JobState> = sqlx::query_scalar("SELECT state FROM jobs").fetch_all(&pool).await.unwrap();
    assert_eq!(states, vec![JobState::Completed; 4]);
    let stopped: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT stopped_at FROM workers WHERE id = 'drain-test'").fetch_one(&pool).await.unwrap();
    assert!(stopped.is_some());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_worker_that_does_not_prefetch_leaves_what_it_cannot_run_to_others(pool: PgPool) {
    // Two jobs that run until told to stop; each reports the worker that started it.
    let (started, mut starts) = tokio::sync::mpsc::unbounded_channel::<String>();
    let release = CancellationToken::new();
    let registry = || {
        let (started, release) = (started.clone(), release.clone());
        let mut r = airlock_worker::Registry::new();
        r.register_fn("test.hold", move |ctx: airlock_worker::JobContext| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                let owner: String = sqlx::query_scalar("SELECT lease_owner FROM jobs WHERE id = $1")
                    .bind(ctx.job.id)
                    .fetch_one(&ctx.pool)
                    .await
                    .map_err(|e| airlock_worker::HandlerError::retry(e.to_string()))?;
                let _ = started.send(owner);
                release.cancelled().await;
                Ok(airlock_worker::Outcome::Completed)
            }
        });
        r
    };
    for _ in 0..2 {
        enqueue(&pool, NewJob::new("test.hold", json!({}))).await;
    }
    // One slot each, claims of one (claim_batch = concurrency: no prefetching).
    let one_slot = |id: &str| airlock_worker::WorkerSettings {
        concurrency: 1,
        claim_batch: 1,
        ..settings(id, Duration::from_millis(50))
    };
    let stop = CancellationToken::new();
    let first =
        tokio::spawn(airlock_worker::Worker::new(pool.clone(), registry(), one_slot("first")).run(stop.clone()));
    let wait = Duration::from_secs(30);
    assert_eq!(tokio::time::timeout(wait, starts.recv()).await.expect("a job starts").unwrap(), "first");
    // The first worker's slot is taken: the other job must still be free for the second.
    let second =
        tokio::spawn(airlock_worker::Worker::new(pool.clone(), registry(), one_slot("second")).run(stop.clone()));
    let other = tokio::time::timeout(wait, starts.recv()).await.expect("the other job starts on the second worker");
    assert_eq!(other.unwrap(), "second");
    release.cancel();
    stop.cancel();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    let states: Vec<JobState> = sqlx::query_scalar("SELECT state FROM jobs").fetch_all(&pool).await.unwrap();
    assert_eq!(states, vec![JobState::Completed; 2]);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn batched_claims_and_completions_finish_every_job_once(pool: PgPool) {
    finish_2000_jobs(pool, 64, 32, false).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn per_job_claims_carrying_completions_finish_every_job_once(pool: PgPool) {
    // One claim per free slot: each finished job's completion rides on its slot's next claim.
    finish_2000_jobs(pool, 1, 1, false).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn completions_that_delete_their_rows_finish_every_job_once(pool: PgPool) {
    // Per job (the completion rides on the next claim) and batched: nothing is left behind.
    finish_2000_jobs(pool.clone(), 1, 1, true).await;
    finish_2000_jobs(pool, 64, 32, true).await;
}

/// Runs 2,000 no-op jobs through one worker claiming `claim_batch` and completing
/// `complete_batch` at a time (`deleting`: with `delete_completed`, so that a completion
/// deletes its row): each runs once, and each completion is counted once.
async fn finish_2000_jobs(pool: PgPool, claim_batch: usize, complete_batch: usize, deleting: bool) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = airlock_worker::Registry::new();
    let record = seen.clone();
    registry.register_fn("test.noop", move |ctx| {
        let record = record.clone();
        async move {
            record.lock().unwrap().push(ctx.job.id);
            Ok(airlock_worker::Outcome::Completed)
        }
    });
    let jobs: Vec<NewJob> = (0..2000).map(|i| NewJob::new("test.noop", json!({"i": i}))).collect();
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue_many(&mut tx, &jobs).await.unwrap();
    tx.commit().await.unwrap();

    let mut s = settings("batch-test", Duration::from_millis(50));
    s.claim_batch = claim_batch;
    s.complete_batch = complete_batch;
    s.delete_completed = deleting;
    let worker = airlock_worker::Worker::new(pool.clone(), registry, s);
    let stats: Stats = worker.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    // Kept, every job ends `completed`; deleted, none is left (a failed one would stay).
    let done = if deleting {
        "SELECT 2000 - count(*) FROM jobs"
    } else {
        "SELECT count(*) FROM jobs WHERE state = 'completed'"
    };
    airlock_tests::harness::wait_for("2000 completed jobs", Duration::from_secs(120), || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar(done).fetch_one(&pool).await.unwrap();
            (n == 2000).then_some(())
        }
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let seen: Vec<JobId> = seen.lock().unwrap().clone();
    let distinct: HashSet<JobId> = seen.iter().copied().collect();
    assert_eq!(seen.len(), 2000, "each job ran once");
    assert_eq!(distinct.len(), 2000);
    let attempts: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE attempt <> 1").fetch_one(&pool).await.unwrap();
    assert_eq!(attempts, 0);
    assert_eq!(airlock_worker::WorkerStats::get(&stats.completed), 2000, "every completion counted once");
    assert_eq!(airlock_worker::WorkerStats::get(&stats.lease_lost), 0);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn shutdown_releases_claimed_but_unstarted_jobs(pool: PgPool) {
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("test.slow", |_ctx| async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(airlock_worker::Outcome::Completed)
    });
    for _ in 0..5 {
        enqueue(&pool, NewJob::new("test.slow", json!({}))).await;
    }
    let mut s = settings("prefetch-test", Duration::from_millis(50));
    s.concurrency = 1;
    s.claim_batch = 10;
    let worker = airlock_worker::Worker::new(pool.clone(), registry, s);
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    // One claim takes all five: one runs, four wait in the worker's buffer, all leased.
    airlock_tests::harness::wait_for("5 claimed jobs", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&pool).await.unwrap();
            (n == 5).then_some(())
        }
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let states: Vec<(JobState, i32, i32)> =
        sqlx::query_as("SELECT state, attempt, max_attempts FROM jobs ORDER BY state").fetch_all(&pool).await.unwrap();
    let completed = states.iter().filter(|(s, _, _)| *s == JobState::Completed).count();
    let released: Vec<_> = states.iter().filter(|(s, _, _)| *s == JobState::Available).collect();
    assert!(completed >= 1, "the started job finished: {states:?}");
    assert_eq!(completed + released.len(), 5, "nothing left running: {states:?}");
    assert!(
        released.iter().all(|(_, attempt, max)| *attempt == 1 && *max == 11),
        "released without spending an attempt"
    );
}

/// A worker's claims keep their connections between statements; one kept long enough to
/// have idled `check_after_idle` is checked before use, so a connection Postgres closed
/// meanwhile (a restart, an administrator, an idle timeout) is replaced, and no claim
/// fails for it.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_claim_connection_closed_while_kept_is_replaced_before_a_claim_fails_on_it(pool: PgPool) {
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("test.ping", |_ctx| async move { Ok(airlock_worker::Outcome::Completed) });
    // One claim per slot (the completions ride on them), and no polling: only a NOTIFY
    // makes this worker claim, so its kept connections idle between the two batches.
    let mut s = settings("kept", Duration::from_secs(3600));
    s.claim_batch = 1;
    let worker = airlock_worker::Worker::new(pool.clone(), registry, s);
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    wait_listening(&stats).await;
    let completed = |n: i64| {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move {
                let done: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'completed'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                (done == n).then_some(())
            }
        }
    };
    let batch = |n: usize| (0..n).map(|_| NewJob::new("test.ping", json!({}))).collect::<Vec<_>>();
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue_many(&mut tx, &batch(20)).await.unwrap();
    tx.commit().await.unwrap();
    harness::wait_for("the first batch", Duration::from_secs(30), completed(20)).await;

    // Every connection that last ran a claim is closed by the server while it is kept.
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%claimed AS (UPDATE jobs_live j%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(closed >= 1, "the claims' connections were found");
    // Longer than `check_after_idle` (1 s in these settings): the kept connections are checked.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue_many(&mut tx, &batch(20)).await.unwrap();
    tx.commit().await.unwrap();
    harness::wait_for("the second batch", Duration::from_secs(30), completed(40)).await;

    assert_eq!(airlock_worker::WorkerStats::get(&stats.failed_claims), 0, "no claim failed on a closed connection");
    let twice: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE attempt <> 1").fetch_one(&pool).await.unwrap();
    assert_eq!(twice, 0, "every job ran once");
    stop.cancel();
    run.await.unwrap().unwrap();
}
