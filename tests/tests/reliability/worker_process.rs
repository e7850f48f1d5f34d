//! Real `airlock-worker` processes, stopped with SIGTERM and killed with SIGKILL mid-job.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_core::ids::JobId;
use airlock_queue::{self as queue, EffectClass, JobState, NewJob};
use airlock_tests::harness::{self, KillOnDrop};
use nix::sys::signal::Signal;
use serde_json::json;
use sqlx::PgPool;

const WORKER_ENV: &[(&str, &str)] = &[
    ("AIRLOCK__WORKER__DIAGNOSTIC_JOBS", "true"),
    ("AIRLOCK__WORKER__LEASE_SECONDS", "3"),
    ("AIRLOCK__WORKER__POLL_INTERVAL_MS", "100"),
    ("AIRLOCK__WORKER__RESCUE_INTERVAL_SECONDS", "1"),
    ("AIRLOCK__WORKER__SHUTDOWN_GRACE_SECONDS", "30"),
];

async fn enqueue(pool: &PgPool, job: NewJob) -> JobId {
    let mut tx = pool.begin().await.unwrap();
    let e = queue::enqueue(&mut tx, &job).await.unwrap();
    tx.commit().await.unwrap();
    e.id
}

async fn wait_state(pool: &PgPool, id: JobId, state: JobState, timeout: Duration) -> queue::Job {
    harness::wait_for(&format!("job {id} to be {}", state.as_str()), timeout, || {
        let pool = pool.clone();
        async move {
            let j = queue::get(&pool, id).await.unwrap();
            (j.state == state).then_some(j)
        }
    })
    .await
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn sigterm_lets_the_in_flight_job_finish(pool: PgPool) {
    let url = harness::database_url(&pool);
    let id = enqueue(&pool, NewJob::new("diag.sleep", json!({"ms": 1500}))).await;
    let mut worker = KillOnDrop(harness::spawn("airlock-worker", &[], &url, WORKER_ENV));
    wait_state(&pool, id, JobState::Running, Duration::from_secs(60)).await;

    harness::signal(&worker.0, Signal::SIGTERM);
    // A job enqueued after the signal must not be taken by the stopping worker.
    let late = enqueue(&pool, NewJob::new("diag.sleep", json!({"ms": 0}))).await;
    let status = harness::wait_exit(&mut worker.0, Duration::from_secs(60));
    assert!(status.success(), "clean exit, got {status:?}");

    let job = queue::get(&pool, id).await.unwrap();
    assert_eq!(job.state, JobState::Completed, "the in-flight job finished");
    assert_eq!(job.attempt, 1);
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&pool).await.unwrap();
    assert_eq!(running, 0, "nothing left running");
    assert_eq!(queue::get(&pool, late).await.unwrap().state, JobState::Available, "no claim after SIGTERM");
    let stopped: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workers WHERE stopped_at IS NOT NULL").fetch_one(&pool).await.unwrap();
    assert_eq!(stopped, 1);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn sigkill_mid_job_is_finished_by_another_worker_or_parked(pool: PgPool) {
    let url = harness::database_url(&pool);
    let pure = enqueue(&pool, NewJob::new("diag.sleep", json!({"ms": 120_000}))).await;
    let effect =
        enqueue(&pool, NewJob::new("diag.effect", json!({"ms": 120_000})).effect_class(EffectClass::NonRepeatable))
            .await;
    let mut first = KillOnDrop(harness::spawn("airlock-worker", &[], &url, WORKER_ENV));
    let held = wait_state(&pool, pure, JobState::Running, Duration::from_secs(60)).await;
    harness::wait_for("the effect to start", Duration::from_secs(60), || {
        let pool = pool.clone();
        async move { queue::get(&pool, effect).await.unwrap().effect_started_at.map(|_| ()) }
    })
    .await;

    harness::signal(&first.0, Signal::SIGKILL);
    harness::wait_exit(&mut first.0, Duration::from_secs(10));
    // The operator shortens the pure job so the second run ends quickly.
    sqlx::query("UPDATE jobs SET payload = '{\"ms\": 10}' WHERE id = $1").bind(pure).execute(&pool).await.unwrap();
    let _second = KillOnDrop(harness::spawn("airlock-worker", &[], &url, WORKER_ENV));

    let parked = wait_state(&pool, effect, JobState::Parked, Duration::from_secs(60)).await;
    assert!(parked.effect_started_at.is_some(), "parked with its started effect on record");
    assert_eq!(parked.attempt, 1, "never run again");

    // The pure job is back to available with backoff (about 1 s), then finished by the new worker.
    let done = wait_state(&pool, pure, JobState::Completed, Duration::from_secs(60)).await;
    assert_eq!(done.attempt, held.attempt + 1, "finished under a new epoch");
}
