//! Lifecycles written twice on purpose, and held together: every Rust state enum has the
//! labels of its Postgres enum, and the job table's moves ([`airlock_queue::next`]) are the
//! moves the queue's statements make: each action is tried from each state against the real
//! statements, and the state it leaves must be the table's (or unchanged where the table
//! has no move).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_core::ids::JobId;
use airlock_queue::{self as queue, ClaimFilter, JobAction, JobState};
use sqlx::PgPool;

/// The labels of a Postgres enum, in order.
async fn labels(pool: &PgPool, ty: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT enumlabel::text FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid WHERE t.typname = $1 ORDER BY e.enumsortorder")
        .bind(ty)
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_state_enum_mirrors_its_postgres_enum(pool: PgPool) {
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("job_state", JobState::ALL.iter().map(|s| s.as_str()).collect()),
        ("delivery_state", airlock_delivery::state::DeliveryState::ALL.iter().map(|s| s.as_str()).collect()),
        ("run_state", airlock_runs::RunState::ALL.iter().map(|s| s.as_str()).collect()),
        ("sandbox_task_state", airlock_sandbox::state::TaskState::ALL.iter().map(|s| s.as_str()).collect()),
        ("relocation_phase", airlock_capsule::relocation::Phase::ALL.iter().map(|s| s.as_str()).collect()),
        ("agent_state", airlock_capsule::agents::AgentState::ALL.iter().map(|s| s.as_str()).collect()),
        ("turn_state", airlock_agent::TurnState::ALL.iter().map(|s| s.as_str()).collect()),
        ("authorization_state", ["pending", "granted", "denied"].to_vec()),
    ];
    for (ty, rust) in cases {
        let mut pg = labels(&pool, ty).await;
        let mut rust: Vec<String> = rust.into_iter().map(str::to_string).collect();
        assert!(!pg.is_empty(), "{ty} exists");
        pg.sort();
        rust.sort();
        assert_eq!(rust, pg, "{ty}: the Rust enum and the Postgres enum name the same states");
    }
}

/// A job of its own queue in `state`, its columns as the table's checks want them.
async fn job_in(pool: &PgPool, state: JobState) -> JobId {
    let id = JobId::new();
    let (attempt, lease, finished, effect) = match state {
        JobState::Available => (0, false, false, false),
        JobState::Running => (1, true, false, false),
        JobState::Parked => (1, false, false, true),
        JobState::Completed | JobState::Failed | JobState::Cancelled => (1, false, true, false),
    };
    sqlx::query(
        r#"INSERT INTO jobs (id, kind, queue, state, attempt, max_attempts, lease_owner, lease_expires_at, finished_at,
                             effect_started_at, run_at)
           VALUES ($1, 'lifecycle', $2, $3, $4, 5,
                   CASE WHEN $5 THEN 'w' END, CASE WHEN $5 THEN now() + interval '1 hour' END,
                   CASE WHEN $6 THEN now() END, CASE WHEN $7 THEN now() END, now() - interval '1 second')"#,
    )
    .bind(id)
    .bind(format!("q-{id}"))
    .bind(state)
    .bind(attempt)
    .bind(lease)
    .bind(finished)
    .bind(effect)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// Applies `action` to job `id` the way the queue's callers do.
async fn apply(pool: &PgPool, id: JobId, action: JobAction) {
    let job = queue::get(pool, id).await.unwrap();
    let lease = job.lease();
    match action {
        JobAction::Claim => {
            let only = ClaimFilter { queues: Some(vec![job.queue.clone()]) };
            let _ = queue::claim_batch(pool, "w2", &only, 1, Duration::from_secs(60)).await.unwrap();
        }
        JobAction::Complete => {
            let _ = queue::complete(pool, lease).await;
        }
        JobAction::Retry => {
            let _ = queue::fail(pool, lease, "retry", false, None).await;
        }
        JobAction::Fail => {
            let _ = queue::fail(pool, lease, "for good", true, None).await;
        }
        JobAction::Park => {
            let _ = queue::park(pool, lease, "unknown").await;
        }
        JobAction::Cancel => {
            let _ = queue::cancel(pool, id, "cancelled").await;
        }
        JobAction::RetryNow => {
            let _ = queue::retry_now(pool, id).await;
        }
        JobAction::Settle => {
            queue::settle_parked(pool, id, JobState::Completed, "done").await.unwrap();
        }
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_move_of_the_job_table_is_what_the_statements_do(pool: PgPool) {
    for from in JobState::ALL {
        for action in JobAction::ALL {
            let id = job_in(&pool, from).await;
            apply(&pool, id, action).await;
            let now = queue::get(&pool, id).await.unwrap().state;
            let want = queue::next(from, action).unwrap_or(from);
            assert_eq!(now, want, "{from:?} by {action:?}");
        }
    }
    // The other ways a holder retries (a snooze, a release) and the rescuer's moves of an
    // expired lease take the same moves.
    for (what, to) in [("snooze", JobState::Available), ("release", JobState::Available)] {
        let id = job_in(&pool, JobState::Running).await;
        let lease = queue::get(&pool, id).await.unwrap().lease();
        if what == "snooze" {
            queue::snooze(&pool, lease, Duration::from_secs(1)).await.unwrap();
        } else {
            queue::release(&pool, lease).await.unwrap();
        }
        assert_eq!(queue::get(&pool, id).await.unwrap().state, to, "{what}");
        assert_eq!(Some(to), queue::next(JobState::Running, JobAction::Retry));
    }
    for from in JobState::ALL {
        let id = job_in(&pool, from).await;
        sqlx::query(
            "UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1 AND state = 'running'",
        )
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
        let mut tx = pool.begin().await.unwrap();
        let rescued = queue::rescue_expired(&mut tx, 100).await.unwrap();
        tx.commit().await.unwrap();
        let now = queue::get(&pool, id).await.unwrap().state;
        if from == JobState::Running {
            assert_eq!(rescued.len(), 1);
            assert_eq!(Some(now), queue::next(from, JobAction::Retry), "an expired pure job is retried");
        } else {
            assert!(rescued.is_empty(), "{from:?} has no lease to expire");
            assert_eq!(now, from);
        }
    }
}
