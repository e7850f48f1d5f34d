//! What an operator (or a job's owner) does to jobs nobody holds, and what they read:
//! cancel, retry now, settle a parked job, one job, lists and counts.

use airlock_core::ids::JobId;
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

use crate::job::{Job, JobState, QueueError, truncate_error};

/// Cancels a job that is not running (an operator or owner action). A running job is
/// refused: its holder finishes or its lease expires first.
pub async fn cancel(db: impl PgExecutor<'_>, id: JobId, reason: &str) -> Result<(), QueueError> {
    let r = sqlx::query(concat!(
        "WITH gone AS (DELETE FROM jobs WHERE id = $1 AND state IN ('available', 'parked') RETURNING *) ",
        "INSERT INTO jobs_done (",
        job_columns!(),
        ") SELECT ",
        finished_row!("'cancelled'", "$2"),
        " FROM gone"
    ))
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
/// explicit human decision). A failed job comes back only while no live job holds its unique
/// key (it would be a second one).
pub async fn retry_now(db: impl PgExecutor<'_>, id: JobId) -> Result<(), QueueError> {
    let (found, revived): (bool, bool) = sqlx::query_as(RETRY_NOW_SQL).bind(id).fetch_one(db).await?;
    match (found, revived) {
        (_, true) => Ok(()),
        (false, false) => Err(QueueError::InvalidTransition { id, from: "not parked or failed", action: "retry" }),
        (true, false) => {
            Err(QueueError::InvalidTransition { id, from: "failed, its key held by a live job", action: "retry" })
        }
    }
}

/// [`retry_now`] of job `$1`: a parked one where it is, a failed one moved back from the
/// finished jobs into the ring (if its key is free). Returns whether the job was found
/// parked or failed, and whether it is available now.
const RETRY_NOW_SQL: &str = concat!(
    "WITH target AS (SELECT id, state, unique_key FROM jobs WHERE id = $1 AND state IN ('parked', 'failed') FOR UPDATE), ",
    "parked AS (UPDATE jobs j SET state = 'available', run_at = now(), effect_started_at = NULL, ",
    "max_attempts = greatest(j.max_attempts, j.attempt + 1) ",
    "FROM target t WHERE j.id = t.id AND t.state = 'parked' AND j.state = 'parked' RETURNING j.id), ",
    "gone AS (DELETE FROM jobs j USING target t WHERE j.id = t.id AND t.state = 'failed' AND j.state = 'failed' ",
    "AND (t.unique_key IS NULL OR airlock_job_key_free(t.unique_key)) RETURNING j.*), ",
    "revived AS (INSERT INTO jobs_live (",
    job_columns!(),
    ") SELECT id, kind, queue, payload, 'available', priority, now(), attempt, greatest(max_attempts, attempt + 1), ",
    "effect_class, NULL, NULL, NULL, heartbeat_at, attempted_at, last_error, unique_key, created_at, NULL, ",
    "(SELECT current FROM job_ring) FROM gone RETURNING id) ",
    "SELECT EXISTS (SELECT 1 FROM target), EXISTS (SELECT 1 FROM parked UNION ALL SELECT 1 FROM revived)"
);

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
    sqlx::query(concat!(
        "WITH gone AS (DELETE FROM jobs WHERE id = $1 AND state = 'parked' RETURNING *) ",
        "INSERT INTO jobs_done (",
        job_columns!(),
        ") SELECT ",
        finished_row!("$2", "$3"),
        " FROM gone"
    ))
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
