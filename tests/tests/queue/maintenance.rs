//! The worker's maintenance passes, one `run_once` at a time against a fresh database: the
//! lease heartbeat, the rescuer, retention and the first statistics.

use std::sync::Arc;
use std::time::Duration;

use airlock_core::ids::JobId;
use airlock_queue::{self as queue, ClaimFilter, JobState, NewJob};
use airlock_worker::WorkerStats;
use airlock_worker::runtime::{Heartbeat, HeartbeatCounts, InFlight, retention, statistics};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(30);
const WORKER: &str = "w-maintenance";

async fn enqueue(pool: &PgPool, n: usize) {
    let jobs: Vec<NewJob> = (0..n).map(|i| NewJob::new("t", json!({ "i": i }))).collect();
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue_many(&mut tx, &jobs).await.unwrap();
    tx.commit().await.unwrap();
}

async fn claim(pool: &PgPool, owner: &str, n: i64) -> Vec<queue::Job> {
    queue::claim_batch(pool, owner, &ClaimFilter::default(), n, LEASE).await.unwrap()
}

async fn expire_leases(pool: &PgPool) {
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE state = 'running'")
        .execute(pool)
        .await
        .unwrap();
}

/// Takes job `id` from its holder as a stall would: its lease runs out, the rescuer gives
/// it back, and another worker claims it (at the next attempt).
async fn take_over(pool: &PgPool, id: JobId) {
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(queue::rescue_expired(&mut tx, 100).await.unwrap().len(), 1);
    tx.commit().await.unwrap();
    sqlx::query("UPDATE jobs SET run_at = now() WHERE id = $1").bind(id).execute(pool).await.unwrap();
    let taken = claim(pool, "w-other", 1).await;
    assert_eq!(taken.iter().map(|j| (j.id, j.attempt)).collect::<Vec<_>>(), vec![(id, 2)]);
}

/// A heartbeat over `in_flight`, for a registered worker.
async fn heartbeat(pool: &PgPool, in_flight: &InFlight) -> (Heartbeat, Arc<WorkerStats>) {
    queue::fleet::register(pool, WORKER, "host", None, 4).await.unwrap();
    let stats = Arc::new(WorkerStats::default());
    (Heartbeat::new(pool.clone(), WORKER.into(), LEASE, in_flight.clone(), stats.clone()), stats)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_heartbeat_extends_every_held_lease_and_refreshes_the_worker_row(pool: PgPool) {
    enqueue(&pool, 2).await;
    let jobs = claim(&pool, WORKER, 2).await;
    let in_flight = InFlight::default();
    for j in &jobs {
        in_flight.hold(j.lease());
    }
    let (mut hb, stats) = heartbeat(&pool, &in_flight).await;
    sqlx::query("UPDATE jobs SET lease_expires_at = now() + interval '1 second'").execute(&pool).await.unwrap();

    let counts = hb.run_once().await.unwrap();
    assert_eq!(counts, HeartbeatCounts { extended: 2, missed: 0, lost: 0 });
    let short: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE lease_expires_at < now() + interval '20 seconds'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(short, 0, "both leases extended by the lease length");
    let held: i32 =
        sqlx::query_scalar("SELECT in_flight FROM workers WHERE id = $1").bind(WORKER).fetch_one(&pool).await.unwrap();
    assert_eq!(held, 2);
    assert_eq!(WorkerStats::get(&stats.lease_lost), 0);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_lease_missed_once_is_given_a_pass_and_missed_twice_cancels_its_job(pool: PgPool) {
    enqueue(&pool, 2).await;
    let jobs = claim(&pool, WORKER, 2).await;
    let in_flight = InFlight::default();
    let tokens: Vec<CancellationToken> = jobs.iter().map(|j| in_flight.hold(j.lease())).collect();
    let (mut hb, stats) = heartbeat(&pool, &in_flight).await;
    take_over(&pool, jobs[0].id).await;

    // First miss: the job may just have ended in its own transaction; nothing is cancelled.
    assert_eq!(hb.run_once().await.unwrap(), HeartbeatCounts { extended: 1, missed: 1, lost: 0 });
    assert!(!tokens[0].is_cancelled(), "one miss does not cancel");
    assert_eq!(WorkerStats::get(&stats.lease_lost), 0);

    // Second miss, the job still in flight: the lease is lost.
    assert_eq!(hb.run_once().await.unwrap(), HeartbeatCounts { extended: 1, missed: 0, lost: 1 });
    assert!(tokens[0].is_cancelled(), "the job whose lease was taken is cancelled");
    assert!(!tokens[1].is_cancelled(), "the job still held runs on");
    assert_eq!(WorkerStats::get(&stats.lease_lost), 1);

    // The other holder's lease was never touched.
    let owner: String = sqlx::query_scalar("SELECT lease_owner FROM jobs WHERE id = $1")
        .bind(jobs[0].id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(owner, "w-other");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_job_that_ends_between_two_misses_is_not_cancelled(pool: PgPool) {
    enqueue(&pool, 1).await;
    let job = claim(&pool, WORKER, 1).await.pop().unwrap();
    let in_flight = InFlight::default();
    let token = in_flight.hold(job.lease());
    let (mut hb, stats) = heartbeat(&pool, &in_flight).await;

    // The handler finishes its job in its own transaction; the heartbeat runs before the
    // worker lets go of it.
    queue::complete(&pool, job.lease()).await.unwrap();
    assert_eq!(hb.run_once().await.unwrap(), HeartbeatCounts { extended: 0, missed: 1, lost: 0 });
    in_flight.remove(job.id);
    assert_eq!(hb.run_once().await.unwrap(), HeartbeatCounts::default());
    assert!(!token.is_cancelled());
    assert_eq!(WorkerStats::get(&stats.lease_lost), 0);
    let state: JobState =
        sqlx::query_scalar("SELECT state FROM jobs WHERE id = $1").bind(job.id).fetch_one(&pool).await.unwrap();
    assert_eq!(state, JobState::Completed);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_rescuer_repeats_while_full_batches_come_back(pool: PgPool) {
    enqueue(&pool, 5).await;
    assert_eq!(claim(&pool, "w-crashed", 5).await.len(), 5);
    expire_leases(&pool).await;

    let registry = airlock_worker::Registry::new();
    let counts = airlock_worker::runtime::rescue_once(&pool, &registry, 2).await.unwrap();
    assert_eq!((counts.retried, counts.failed, counts.parked), (5, 0, 0), "batches of 2, 2 and 1 in one pass");
    let available: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'available'").fetch_one(&pool).await.unwrap();
    assert_eq!(available, 5);
    let again = airlock_worker::runtime::rescue_once(&pool, &registry, 2).await.unwrap();
    assert_eq!((again.retried, again.failed, again.parked), (0, 0, 0), "nothing left to rescue");
}

/// 250 completed jobs and one cancelled job that finished two hours ago, 10 completed just
/// now, and one failed two hours ago.
async fn finished_jobs(pool: &PgPool) {
    enqueue(pool, 251).await;
    let old = claim(pool, WORKER, 251).await;
    let leases: Vec<queue::Lease> = old.iter().skip(1).map(|j| j.lease()).collect();
    assert_eq!(queue::complete_many(pool, &leases).await.unwrap().len(), 250);
    queue::release(pool, old[0].lease()).await.unwrap();
    queue::cancel(pool, old[0].id, "not wanted").await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    queue::enqueue(&mut tx, &NewJob::new("t", json!({})).max_attempts(1)).await.unwrap();
    tx.commit().await.unwrap();
    let failing = claim(pool, WORKER, 1).await.pop().unwrap();
    assert_eq!(queue::fail(pool, failing.lease(), "boom", true, None).await.unwrap(), queue::FailOutcome::Failed);
    sqlx::query("UPDATE jobs SET finished_at = now() - interval '2 hours' WHERE finished_at IS NOT NULL")
        .execute(pool)
        .await
        .unwrap();

    enqueue(pool, 10).await;
    let recent: Vec<queue::Lease> = claim(pool, WORKER, 10).await.iter().map(|j| j.lease()).collect();
    assert_eq!(queue::complete_many(pool, &recent).await.unwrap().len(), 10);
}

async fn count(pool: &PgPool) -> Vec<(JobState, i64)> {
    sqlx::query_as("SELECT state, count(*) FROM jobs GROUP BY state ORDER BY state").fetch_all(pool).await.unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn retention_deletes_old_finished_jobs_in_batches(pool: PgPool) {
    finished_jobs(&pool).await;
    let stats = WorkerStats::default();
    let hour = Duration::from_secs(3600);
    let never = CancellationToken::new();

    let pruned = retention::run_once(&pool, hour, 100, &stats, &never).await.unwrap();
    assert_eq!(pruned, retention::Pruned { deleted: 251, batches: 3 }, "100, 100, then 51");
    assert_eq!(WorkerStats::get(&stats.pruned), 251);
    assert_eq!(
        count(&pool).await,
        vec![(JobState::Completed, 10), (JobState::Failed, 1)],
        "recent jobs and failed ones stay"
    );
    let again = retention::run_once(&pool, hour, 100, &stats, &never).await.unwrap();
    assert_eq!(again, retention::Pruned { deleted: 0, batches: 1 });
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_retention_pass_stops_between_batches_once_its_worker_stops(pool: PgPool) {
    finished_jobs(&pool).await;
    let stats = WorkerStats::default();
    let stopped = CancellationToken::new();
    stopped.cancel();

    let pruned = retention::run_once(&pool, Duration::from_secs(3600), 100, &stats, &stopped).await.unwrap();
    assert_eq!(pruned, retention::Pruned { deleted: 100, batches: 1 }, "the batch under way finishes; no other starts");
    assert_eq!(WorkerStats::get(&stats.pruned), 100);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_lost_lease_is_counted_once_however_long_its_job_waits_for_a_slot(pool: PgPool) {
    enqueue(&pool, 1).await;
    let job = claim(&pool, WORKER, 1).await.pop().unwrap();
    let in_flight = InFlight::default();
    // Held but waiting in the buffer: nothing lets go of it until a slot frees up.
    let token = in_flight.hold(job.lease());
    let (mut hb, stats) = heartbeat(&pool, &in_flight).await;
    take_over(&pool, job.id).await;

    assert_eq!(hb.run_once().await.unwrap().missed, 1);
    assert_eq!(hb.run_once().await.unwrap().lost, 1);
    assert!(token.is_cancelled());
    for _ in 0..4 {
        assert_eq!(hb.run_once().await.unwrap(), HeartbeatCounts { extended: 0, missed: 0, lost: 0 });
    }
    assert_eq!(WorkerStats::get(&stats.lease_lost), 1, "one lost lease, counted once");
}

/// Enqueues `n` jobs on one connection and has it publish its table counters at once
/// (they otherwise reach the statistics a second or more later).
async fn enqueue_counted(pool: &PgPool, n: usize) {
    let jobs: Vec<NewJob> = (0..n).map(|i| NewJob::new("t", json!({ "i": i }))).collect();
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    queue::enqueue_many(&mut tx, &jobs).await.unwrap();
    tx.commit().await.unwrap();
    // Forces the flush that follows this statement; the next one sees it done.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
}

/// A table's statistics: (analyzed at all, rows the planner believes it has).
async fn statistics_of(pool: &PgPool, table: &str) -> (bool, f32) {
    sqlx::query_as(
        r#"SELECT s.last_analyze IS NOT NULL OR s.last_autoanalyze IS NOT NULL, c.reltuples
           FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.relid = $1::regclass"#,
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Writes `n` finished jobs on one connection and has it publish its table counters at once.
async fn finished_counted(pool: &PgPool, n: i64) {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(
        "INSERT INTO jobs (id, kind, queue, state, attempt, finished_at) \
         SELECT gen_random_uuid(), 't', 'default', 'completed', 1, now() FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_table_never_analyzed_is_analyzed_once_it_holds_work_and_then_left_to_autovacuum(pool: PgPool) {
    let stats = WorkerStats::default();
    assert_eq!(statistics_of(&pool, "jobs_done").await, (false, -1.0), "a new database's tables have no statistics");

    // Below the threshold: nothing is analyzed.
    finished_counted(&pool, 600).await;
    let analyzed = statistics::run_once(&pool, 1000, &stats).await.unwrap();
    assert!(!analyzed.contains(&"jobs_done".to_string()), "{analyzed:?}");
    assert!(!statistics_of(&pool, "jobs_done").await.0);

    // At it: analyzed, and the planner knows the rows.
    finished_counted(&pool, 400).await;
    let analyzed = statistics::run_once(&pool, 1000, &stats).await.unwrap();
    assert!(analyzed.contains(&"jobs_done".to_string()), "{analyzed:?}");
    assert_eq!(statistics_of(&pool, "jobs_done").await, (true, 1000.0));
    assert_eq!(WorkerStats::get(&stats.analyzed), analyzed.len() as u64);

    // Never again, however much is written after: autovacuum keeps the statistics from here.
    finished_counted(&pool, 3000).await;
    let again = statistics::run_once(&pool, 1000, &stats).await.unwrap();
    assert!(!again.contains(&"jobs_done".to_string()), "{again:?}");
    assert_eq!(statistics_of(&pool, "jobs_done").await, (true, 1000.0));

    // The ring's slots never: they are kept without statistics, whatever they hold (and
    // neither are the partitioned tables, whose ANALYZE would reach the slots).
    enqueue_counted(&pool, 3000).await;
    let analyzed = statistics::run_once(&pool, 1000, &stats).await.unwrap();
    assert!(analyzed.iter().all(|t| !t.starts_with("jobs_ring") && t != "jobs" && t != "jobs_live"), "{analyzed:?}");
    assert_eq!(statistics_of(&pool, "jobs_ring_0").await, (false, -1.0));

    // Every table it analyzed is one that had no statistics: none is analyzed twice.
    let analyzed_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables WHERE schemaname = current_schema() AND analyze_count > 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(analyzed_twice, 0);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_worker_analyzes_the_finished_jobs_while_it_drains_its_queue(pool: PgPool) {
    airlock_tests::harness::init_logs();
    let mut registry = airlock_worker::Registry::new();
    registry.register_fn("t", |_ctx| async { Ok(airlock_worker::Outcome::Completed) });
    let settings = airlock_worker::WorkerSettings {
        first_analyze: Some(200),
        first_analyze_interval: Duration::from_millis(100),
        ..crate::jobs::settings("w-stats", Duration::from_millis(50))
    };
    let worker = airlock_worker::Worker::new(pool.clone(), registry, settings);
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    enqueue_counted(&pool, 500).await;
    // The worker's tick finds the finished jobs' table filling and analyzes it (the wait is
    // bounded; the check is what it found).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !statistics_of(&pool, "jobs_done").await.0 {
        assert!(tokio::time::Instant::now() < deadline, "the worker never analyzed jobs_done");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    running.await.unwrap().unwrap();
    assert!(WorkerStats::get(&stats.analyzed) >= 1);
    let manual: Option<i64> =
        sqlx::query_scalar("SELECT autoanalyze_count FROM pg_stat_user_tables WHERE relid = 'jobs_done'::regclass")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(manual, Some(0), "the worker analyzed it, not autovacuum");
    assert!(!statistics_of(&pool, "jobs_ring_0").await.0, "the ring's slot it drained was left without statistics");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_worker_can_tell_when_autovacuum_leaves_the_long_lived_jobs_unvacuumed(pool: PgPool) {
    // What the server says, whatever this machine's configuration is.
    let server_off: bool = sqlx::query_scalar(
        "SELECT NOT current_setting('autovacuum')::bool OR NOT current_setting('track_counts')::bool",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let off = |pool: PgPool| async move { airlock_core::db::autovacuum_off(&pool, "jobs_long").await.unwrap() };
    assert_eq!(off(pool.clone()).await, server_off, "as the server runs it");

    // Turned off for the table alone: off, whatever the server runs.
    sqlx::query("ALTER TABLE jobs_long SET (autovacuum_enabled = false)").execute(&pool).await.unwrap();
    assert!(off(pool.clone()).await, "autovacuum_enabled = false on jobs_long");
    sqlx::query("ALTER TABLE jobs_long SET (autovacuum_enabled = true)").execute(&pool).await.unwrap();
    assert_eq!(off(pool.clone()).await, server_off, "back on for the table");
    // However the value is spelled.
    sqlx::query("ALTER TABLE jobs_long SET (autovacuum_enabled = off)").execute(&pool).await.unwrap();
    assert!(off(pool.clone()).await, "autovacuum_enabled = off on jobs_long");
    sqlx::query("ALTER TABLE jobs_long SET (autovacuum_enabled = 1)").execute(&pool).await.unwrap();
    assert_eq!(off(pool.clone()).await, server_off, "autovacuum_enabled = 1 on jobs_long");
    sqlx::query("ALTER TABLE jobs_long RESET (autovacuum_enabled)").execute(&pool).await.unwrap();
    assert_eq!(off(pool.clone()).await, server_off);

    // A table that does not exist is judged by the server's setting alone, not an error.
    assert_eq!(airlock_core::db::autovacuum_off(&pool, "no_such_table").await.unwrap(), server_off);
}
