//! The lease handle and every write a holder makes: heartbeats, the effect mark, and the
//! ends of a claimed job (complete, fail, snooze, release, park). Each is fenced on
//! `(id, attempt, state = 'running')`; zero rows is [`QueueError::LeaseLost`].

use std::time::Duration;

use airlock_core::ids::JobId;
use sqlx::PgExecutor;

use crate::job::{JobState, QueueError, truncate_error};

/// The proof of holding a claimed job: its id and the epoch of the claim. Every write a
/// holder makes goes through one of these, fenced on both.
///
/// It also remembers the live partition the job was claimed in (its `slot`), so that a
/// completion can name that partition instead of reaching it through all of `jobs_live`
/// (see [`crate::slotted`]). That is a hint, not part of the lease's identity: a held job
/// may have moved to `jobs_long` since, and two leases of the same id and attempt are equal.
#[derive(Debug, Clone, Copy)]
pub struct Lease {
    pub(crate) id: JobId,
    pub(crate) attempt: i32,
    pub(crate) slot: Option<i16>,
}

impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        (self.id, self.attempt) == (other.id, other.attempt)
    }
}

impl Eq for Lease {}

impl std::hash::Hash for Lease {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.id, self.attempt).hash(state);
    }
}

impl Lease {
    /// The lease of a job by its id and attempt alone (its partition unknown).
    pub(crate) fn new(id: JobId, attempt: i32) -> Self {
        Lease { id, attempt, slot: None }
    }

    /// The job held.
    pub fn id(self) -> JobId {
        self.id
    }

    /// The epoch of the claim (the job's attempt number when it was claimed).
    pub fn attempt(self) -> i32 {
        self.attempt
    }
}

/// Extends the leases whose ids and attempts are the arrays `$1` and `$2` by `$3` seconds
/// (see `airlock_jobs_heartbeat`), locking the jobs in id order first; yields the
/// `(id, attempt)` of each lease still held.
pub const HEARTBEAT_SQL: &str = "SELECT id, attempt FROM airlock_jobs_heartbeat($1, $2, $3)";

/// Extends one lease. Fails with `LeaseLost` when the job is no longer held at this epoch.
pub async fn heartbeat(db: impl PgExecutor<'_>, lease: Lease, extend: Duration) -> Result<(), QueueError> {
    let held = heartbeat_many(db, &[lease], extend).await?;
    if held.is_empty() { Err(QueueError::lost(lease)) } else { Ok(()) }
}

/// Extends many leases in one statement; returns the leases that are still held (the
/// others were lost and their holders must stop).
pub async fn heartbeat_many(
    db: impl PgExecutor<'_>,
    leases: &[Lease],
    extend: Duration,
) -> Result<Vec<Lease>, QueueError> {
    held_by(db, HEARTBEAT_SQL, leases, Some(extend.as_secs_f64())).await
}

/// Runs `sql`, a statement over the held jobs of the arrays `$1` (ids) and `$2` (attempts)
/// that yields `(id, attempt)` for each job still held, with `$3` when given; returns those
/// leases.
async fn held_by(
    db: impl PgExecutor<'_>,
    sql: &'static str,
    leases: &[Lease],
    third: Option<f64>,
) -> Result<Vec<Lease>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<JobId> = leases.iter().map(|l| l.id).collect();
    let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
    let mut q = sqlx::query_as(sql).bind(ids).bind(attempts);
    if let Some(x) = third {
        q = q.bind(x);
    }
    let held: Vec<(JobId, i32)> = q.fetch_all(db).await?;
    Ok(held.into_iter().map(|(id, attempt)| Lease::new(id, attempt)).collect())
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
    let held = held_by(db, MARK_EFFECT_STARTED_SQL, &[lease], None).await?;
    if held.is_empty() { Err(QueueError::lost(lease)) } else { Ok(()) }
}

/// Marks the effect of each job held under the leases of the arrays `$1` (ids) and `$2`
/// (attempts) as started, if its lease has not run out (see
/// `airlock_jobs_mark_effect_started`; other crates' statements do it with
/// [`crate::piece`]); yields the `(id, attempt)` of each one marked.
pub const MARK_EFFECT_STARTED_SQL: &str = "SELECT id, attempt FROM airlock_jobs_mark_effect_started($1, $2)";

/// Completes the held jobs of the arrays `$1` (ids) and `$2` (attempts): moves each to the
/// finished jobs, or deletes it when `$3` is false (see `airlock_jobs_complete`); yields the
/// `(id, attempt)` of each one completed.
pub const COMPLETE_SQL: &str = "SELECT id, attempt FROM airlock_jobs_complete($1, $2, $3)";

/// Whether this process's completions keep the finished job (`airlock_jobs_complete`'s
/// `keep`), see [`crate::set_delete_completed`].
pub(crate) fn keeps_completed() -> bool {
    !crate::deletes_completed()
}

/// Completes a held job.
pub async fn complete(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let done = complete_many(db, &[lease]).await?;
    if done.is_empty() { Err(QueueError::lost(lease)) } else { Ok(()) }
}

/// Completes many held jobs in one statement; returns the leases that were still held
/// (the others were lost and are left untouched).
pub async fn complete_many(db: impl PgExecutor<'_>, leases: &[Lease]) -> Result<Vec<Lease>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let keep = keeps_completed();
    let done: Vec<(JobId, i32)> = if let Some(sql) = crate::slotted::complete_sql(leases, keep) {
        sqlx::query_as(sql).bind(leases[0].id).bind(leases[0].attempt).fetch_all(db).await?
    } else {
        let ids: Vec<JobId> = leases.iter().map(|l| l.id).collect();
        let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
        sqlx::query_as(COMPLETE_SQL).bind(&ids).bind(&attempts).bind(keep).fetch_all(db).await?
    };
    Ok(done.into_iter().map(|(id, attempt)| Lease::new(id, attempt)).collect())
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
    "failed AS (INSERT INTO jobs_done (",
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
