//! What an operator (or a job's owner) does to jobs nobody holds, and what they read:
//! cancel, retry now, settle a parked job, one job, lists and counts.

use airlock_core::ids::JobId;
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

use crate::job::{Job, JobState, QueueError, truncate_error};

/// Cancels a job that is not running (an operator or owner action). A running job is
/// refused: its holder finishes or its lease expires first.
pub async fn cancel(db: impl PgExecutor<'_>, id: JobId, reason: &str) -> Result<(), QueueError> {
    let r = sqlx::query(
        r#"UPDATE jobs SET state = 'cancelled', finished_at = now(), last_error = $2, effect_started_at = NULL
           WHERE id = $1 AND state IN ('available', 'parked')"#,
    )
    .bind(id)
    .bind(truncate_error(reason))
    .execute(db)
    .await?;
    if r.rows_affected() == 0 {
        return Err(QueueError::InvalidTransition { id, from: "running or finished", action: "cancel" });
    }
    Ok(())
}

/// Makes a parked or failed job available again now, with one more attempt allowed (an
/// explicit human decision).
pub async fn retry_now(db: impl PgExecutor<'_>, id: JobId) -> Result<(), QueueError> {
    let r = sqlx::query(
        r#"UPDATE jobs SET state = 'available', run_at = now(), finished_at = NULL, effect_started_at = NULL,
               max_attempts = greatest(max_attempts, attempt + 1)
           WHERE id = $1 AND state IN ('parked', 'failed')"#,
    )
    .bind(id)
    .execute(db)
    .await?;
    if r.rows_affected() == 0 {
        return Err(QueueError::InvalidTransition { id, from: "not parked or failed", action: "retry" });
    }
    Ok(())
}

/// The live job (`available`, `running` or `parked`) holding `unique_key`, with its state.
pub async fn find_live(db: impl PgExecutor<'_>, unique_key: &str) -> Result<Option<(JobId, JobState)>, QueueError> {
    Ok(sqlx::query_as(
        "SELECT id, state FROM jobs WHERE unique_key = $1 AND state IN ('available', 'running', 'parked') LIMIT 1",
    )
    .bind(unique_key)
    .fetch_optional(db)
    .await?)
}

/// Ends a parked job by a human's decision: `completed` (it was done after all) or
/// `cancelled`. A job that is no longer parked is left as it is.
pub async fn settle_parked(db: impl PgExecutor<'_>, id: JobId, to: JobState, note: &str) -> Result<(), QueueError> {
    if !matches!(to, JobState::Completed | JobState::Cancelled) {
        return Err(QueueError::InvalidTransition { id, from: "parked", action: "settle" });
    }
    sqlx::query(
        r#"UPDATE jobs SET state = $2, finished_at = now(), effect_started_at = NULL, last_error = $3
           WHERE id = $1 AND state = 'parked'"#,
    )
    .bind(id)
    .bind(to)
    .bind(truncate_error(&format!("settled by a human: {note}")))
    .execute(db)
    .await?;
    Ok(())
}

/// Reads one job.
pub async fn get(db: impl PgExecutor<'_>, id: JobId) -> Result<Job, QueueError> {
    sqlx::query_as("SELECT * FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(QueueError::NotFound(id))
}

/// Job counts by kind and state.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct StateCount {
    pub kind: String,
    pub state: JobState,
    pub count: i64,
}

pub async fn count_by_kind_state(db: impl PgExecutor<'_>) -> Result<Vec<StateCount>, QueueError> {
    Ok(sqlx::query_as("SELECT kind, state, count(*) AS count FROM jobs GROUP BY kind, state ORDER BY kind, state")
        .fetch_all(db)
        .await?)
}

/// Job counts by queue and state, of the jobs not yet finished (`available`, `running`,
/// `parked`): a queue's depth.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct QueueCount {
    pub queue: String,
    pub state: JobState,
    pub count: i64,
}

pub async fn count_by_queue_state(db: impl PgExecutor<'_>) -> Result<Vec<QueueCount>, QueueError> {
    Ok(sqlx::query_as(
        r#"SELECT queue, state, count(*) AS count FROM jobs
           WHERE state IN ('available', 'running', 'parked')
           GROUP BY queue, state ORDER BY queue, state"#,
    )
    .fetch_all(db)
    .await?)
}

/// Samples the queue-depth gauge (jobs by kind and state) for `/metrics`.
pub async fn sample_depth(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    let depth: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT kind, state::text, count(*) FROM jobs GROUP BY kind, state").fetch_all(db).await?;
    for (kind, state, n) in depth {
        metrics::gauge!(airlock_core::metrics::QUEUE_DEPTH, "kind" => kind, "state" => state).set(n as f64);
    }
    Ok(())
}

/// Lists jobs newest first, optionally by state and kind, after a cursor id.
pub async fn list(
    db: impl PgExecutor<'_>,
    state: Option<JobState>,
    kind: Option<&str>,
    before: Option<JobId>,
    limit: i64,
) -> Result<Vec<Job>, QueueError> {
    Ok(sqlx::query_as(
        r#"SELECT * FROM jobs
           WHERE ($1::job_state IS NULL OR state = $1) AND ($2::text IS NULL OR kind = $2)
             AND ($3::uuid IS NULL OR id < $3)
           ORDER BY id DESC LIMIT $4"#,
    )
    .bind(state)
    .bind(kind)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await?)
}
