//! The lease handle and every write a holder makes: heartbeats, the effect mark, and the
//! ends of a claimed job (complete, fail, snooze, release, park). Each is fenced on
//! `(id, attempt, state = 'running')`; zero rows is [`QueueError::LeaseLost`].

use std::sync::LazyLock;
use std::time::Duration;

use airlock_core::ids::JobId;
use sqlx::PgExecutor;

use crate::job::{JobState, QueueError, truncate_error};

/// The proof of holding a claimed job: its id and the epoch of the claim. Every write a
/// holder makes goes through one of these, fenced on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub(crate) id: JobId,
    pub(crate) attempt: i32,
}

impl Lease {
    /// The job held.
    pub fn id(self) -> JobId {
        self.id
    }

    /// The epoch of the claim (the job's attempt number when it was claimed).
    pub fn attempt(self) -> i32 {
        self.attempt
    }
}

/// Extends the lease `$1` id, `$2` attempt by `$3` seconds.
pub const HEARTBEAT_SQL: &str = r#"UPDATE jobs SET lease_expires_at = now() + make_interval(secs => $3), heartbeat_at = now()
    WHERE id = $1 AND attempt = $2 AND state = 'running'"#;

/// Extends one lease. Fails with `LeaseLost` when the job is no longer held at this epoch.
pub async fn heartbeat(db: impl PgExecutor<'_>, lease: Lease, extend: Duration) -> Result<(), QueueError> {
    let r =
        sqlx::query(HEARTBEAT_SQL).bind(lease.id).bind(lease.attempt).bind(extend.as_secs_f64()).execute(db).await?;
    fenced(r, lease)
}

/// Extends the leases whose ids and attempts are the arrays `$1` and `$2` by `$3` seconds,
/// locking the jobs in id order first.
pub const HEARTBEAT_MANY_SQL: &str = concat!(
    "UPDATE jobs j SET lease_expires_at = now() + make_interval(secs => $3), heartbeat_at = now() FROM ",
    held_in_id_order!("$1", "$2"),
    " WHERE j.id = held.id AND j.state = 'running' RETURNING j.id, j.attempt"
);

/// Extends many leases in one statement; returns the leases that are still held (the
/// others were lost and their holders must stop).
pub async fn heartbeat_many(
    db: impl PgExecutor<'_>,
    leases: &[Lease],
    extend: Duration,
) -> Result<Vec<Lease>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<JobId> = leases.iter().map(|l| l.id).collect();
    let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
    let held: Vec<(JobId, i32)> =
        sqlx::query_as(HEARTBEAT_MANY_SQL).bind(&ids).bind(&attempts).bind(extend.as_secs_f64()).fetch_all(db).await?;
    Ok(held.into_iter().map(|(id, attempt)| Lease { id, attempt }).collect())
}

fn fenced(r: sqlx::postgres::PgQueryResult, lease: Lease) -> Result<(), QueueError> {
    if r.rows_affected() == 0 { Err(QueueError::lost(lease)) } else { Ok(()) }
}

/// Finds the lease `$1` id, `$2` attempt still held and not run out.
pub const ENSURE_HELD_SQL: &str = r#"SELECT 1 FROM jobs
    WHERE id = $1 AND attempt = $2 AND state = 'running' AND lease_expires_at > now()"#;

/// Checks, by the database clock, that the lease is still held and has not run out. A
/// holder calls it right before its external effect: one that stalled after committing
/// its attempt (a paused process, a frozen VM) past its lease finds the job taken over
/// and must not perform the effect the rescuer has already settled.
pub async fn ensure_held(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let held: Option<i32> =
        sqlx::query_scalar(ENSURE_HELD_SQL).bind(lease.id).bind(lease.attempt).fetch_optional(db).await?;
    held.map(|_| ()).ok_or(QueueError::lost(lease))
}

/// Records that the job's external effect may start now. Call it inside the transaction
/// that commits the attempt; it refuses an expired lease, so a holder that was paused past
/// its lease can never start an effect.
pub async fn mark_effect_started(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let r = sqlx::query(MARK_EFFECT_STARTED_SQL).bind(lease.id).bind(lease.attempt).execute(db).await?;
    fenced(r, lease)
}

/// Marks the effect of the job held under lease (`$1` id, `$2` attempt) as started, if the
/// lease has not run out (other crates' statements do it with [`crate::piece`]).
pub const MARK_EFFECT_STARTED_SQL: &str = r#"UPDATE jobs SET effect_started_at = now()
    WHERE id = $1 AND attempt = $2 AND state = 'running' AND lease_expires_at > now()"#;

/// Completes the job held under lease (`$1` id, `$2` attempt): moves it to `jobs_done`.
pub const COMPLETE_HELD_SQL: &str = concat!(
    "WITH gone AS (DELETE FROM jobs WHERE id = $1 AND attempt = $2 AND state = 'running' RETURNING *) ",
    insert_completed!("gone")
);

/// [`COMPLETE_HELD_SQL`] where completions delete the row (see [`crate::set_delete_completed`]).
pub const COMPLETE_HELD_DELETE_SQL: &str = "DELETE FROM jobs WHERE id = $1 AND attempt = $2 AND state = 'running'";

/// Completes a held job.
pub async fn complete(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let sql = if crate::deletes_completed() { COMPLETE_HELD_DELETE_SQL } else { COMPLETE_HELD_SQL };
    let r = sqlx::query(sql).bind(lease.id).bind(lease.attempt).execute(db).await?;
    fenced(r, lease)
}

/// Common table expressions that complete the held jobs whose ids and attempts are the
/// arrays `{ids}` and `{attempts}`, fenced on their leases, locking them in id order first:
/// `done` yields the `(id, attempt)` of each one completed.
const COMPLETE_CTES: &str = concat!(
    "gone AS (DELETE FROM jobs d USING ",
    held_in_id_order!("{ids}", "{attempts}"),
    " WHERE d.id = held.id AND d.state = 'running' RETURNING d.*), done AS (",
    insert_completed!("gone"),
    ")"
);

/// [`COMPLETE_CTES`] for one job: a statement that waits for one row lock and holds no other
/// lock of a held job cannot deadlock, and does without the sort and second lookup.
const COMPLETE_ONE_CTES: &str = concat!(
    "gone AS (DELETE FROM jobs d USING unnest({ids}::uuid[], {attempts}::int[]) AS t(id, attempt)",
    " WHERE d.id = t.id AND d.attempt = t.attempt AND d.state = 'running' RETURNING d.*), done AS (",
    insert_completed!("gone"),
    ")"
);

/// [`COMPLETE_CTES`] where completions delete the row.
const COMPLETE_DELETE_CTES: &str = concat!(
    "done AS (DELETE FROM jobs d USING ",
    held_in_id_order!("{ids}", "{attempts}"),
    " WHERE d.id = held.id AND d.state = 'running' RETURNING d.id, d.attempt)"
);

/// [`COMPLETE_ONE_CTES`] where completions delete the row.
const COMPLETE_ONE_DELETE_CTES: &str = concat!(
    "done AS (DELETE FROM jobs d USING unnest({ids}::uuid[], {attempts}::int[]) AS t(id, attempt)",
    " WHERE d.id = t.id AND d.attempt = t.attempt AND d.state = 'running' RETURNING d.id, d.attempt)"
);

/// The common table expressions that complete the held jobs of the arrays `{ids}` and
/// `{attempts}` (`one`: a single job, which needs no lock order), as this process completes
/// them (see [`crate::set_delete_completed`]); the last, `done`, yields the `(id, attempt)`
/// of each one completed.
pub(crate) fn completion_ctes(one: bool) -> &'static str {
    match (crate::deletes_completed(), one) {
        (false, false) => COMPLETE_CTES,
        (false, true) => COMPLETE_ONE_CTES,
        (true, false) => COMPLETE_DELETE_CTES,
        (true, true) => COMPLETE_ONE_DELETE_CTES,
    }
}

/// The statement of [`complete_many`]: completes the held jobs whose ids and attempts are
/// the arrays `$1` and `$2`.
pub fn complete_many_sql() -> &'static str {
    fn statement(ctes: &str) -> String {
        format!("WITH {} SELECT id, attempt FROM done", ctes.replace("{ids}", "$1").replace("{attempts}", "$2"))
    }
    static KEEP: LazyLock<String> = LazyLock::new(|| statement(COMPLETE_CTES));
    static DELETE: LazyLock<String> = LazyLock::new(|| statement(COMPLETE_DELETE_CTES));
    if crate::deletes_completed() { DELETE.as_str() } else { KEEP.as_str() }
}

/// Completes many held jobs in one statement; returns the leases that were still held
/// (the others were lost and are left untouched).
pub async fn complete_many(db: impl PgExecutor<'_>, leases: &[Lease]) -> Result<Vec<Lease>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<JobId> = leases.iter().map(|l| l.id).collect();
    let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
    let done: Vec<(JobId, i32)> =
        sqlx::query_as(sqlx::AssertSqlSafe(complete_many_sql())).bind(&ids).bind(&attempts).fetch_all(db).await?;
    Ok(done.into_iter().map(|(id, attempt)| Lease { id, attempt }).collect())
}

/// How a failed attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    /// Back to `available`, to run again at the given time.
    Retry,
    /// Attempts exhausted (or the failure was permanent): `failed`.
    Failed,
}

/// Fails the job held under lease (`$1` id, `$2` attempt) with error `$3`: back to
/// `available` after `$5` seconds (NULL: the backoff), or, once its attempts are spent or when
/// `$4` (permanent), moved to `jobs_done` as `failed`. Returns the state it ends in.
const FAIL_SQL: &str = concat!(
    "WITH cur AS (SELECT id, $4 OR attempt >= max_attempts AS last FROM jobs ",
    "WHERE id = $1 AND attempt = $2 AND state = 'running' FOR UPDATE), ",
    "retried AS (UPDATE jobs j SET state = 'available', ",
    "run_at = now() + coalesce(make_interval(secs => $5), airlock_backoff(j.attempt)), last_error = $3, ",
    "lease_owner = NULL, lease_expires_at = NULL, effect_started_at = NULL ",
    "FROM cur WHERE j.id = cur.id AND NOT cur.last AND j.state = 'running' RETURNING j.state), ",
    "gone AS (DELETE FROM jobs j USING cur WHERE j.id = cur.id AND cur.last AND j.state = 'running' RETURNING j.*), ",
    "failed AS (INSERT INTO jobs (",
    job_columns!(),
    ") SELECT ",
    finished_row!("'failed'", "$3"),
    " FROM gone RETURNING state) ",
    "SELECT state FROM retried UNION ALL SELECT state FROM failed"
);

/// Fails a held job. A retryable failure goes back to `available` after the backoff (or
/// `delay`, when the caller knows better, e.g. a server's Retry-After) until
/// `max_attempts` is reached; then, or when `permanent`, the job is `failed`.
pub async fn fail(
    db: impl PgExecutor<'_>,
    lease: Lease,
    error: &str,
    permanent: bool,
    delay: Option<Duration>,
) -> Result<FailOutcome, QueueError> {
    let state: Option<JobState> = sqlx::query_scalar(FAIL_SQL)
        .bind(lease.id)
        .bind(lease.attempt)
        .bind(truncate_error(error))
        .bind(permanent)
        .bind(delay.map(|d| d.as_secs_f64()))
        .fetch_optional(db)
        .await?;
    match state {
        None => Err(QueueError::lost(lease)),
        Some(JobState::Failed) => Ok(FailOutcome::Failed),
        Some(_) => Ok(FailOutcome::Retry),
    }
}

/// Puts a held job back to `available` to run again after `delay`, without spending an
/// attempt (the allowance grows by one, so the epoch still only ever increases).
pub async fn snooze(db: impl PgExecutor<'_>, lease: Lease, delay: Duration) -> Result<(), QueueError> {
    let r = sqlx::query(
        r#"UPDATE jobs SET state = 'available', run_at = now() + make_interval(secs => $3),
               max_attempts = max_attempts + 1, lease_owner = NULL, lease_expires_at = NULL,
               effect_started_at = NULL
           WHERE id = $1 AND attempt = $2 AND state = 'running'"#,
    )
    .bind(lease.id)
    .bind(lease.attempt)
    .bind(delay.as_secs_f64())
    .execute(db)
    .await?;
    fenced(r, lease)
}

/// Gives a held job back untouched because this worker is stopping before (or while)
/// running it. Refused once its effect may have started: then the rescuer decides.
pub async fn release(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let r = sqlx::query(
        r#"UPDATE jobs SET state = 'available', run_at = now(), max_attempts = max_attempts + 1,
               lease_owner = NULL, lease_expires_at = NULL
           WHERE id = $1 AND attempt = $2 AND state = 'running' AND effect_started_at IS NULL"#,
    )
    .bind(lease.id)
    .bind(lease.attempt)
    .execute(db)
    .await?;
    fenced(r, lease)
}

/// Parks a held job for a human.
pub async fn park(db: impl PgExecutor<'_>, lease: Lease, reason: &str) -> Result<(), QueueError> {
    let r = sqlx::query(
        r#"UPDATE jobs SET state = 'parked', last_error = $3, lease_owner = NULL, lease_expires_at = NULL
           WHERE id = $1 AND attempt = $2 AND state = 'running'"#,
    )
    .bind(lease.id)
    .bind(lease.attempt)
    .bind(truncate_error(reason))
    .execute(db)
    .await?;
    fenced(r, lease)
}
