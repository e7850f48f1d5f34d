//! airlock-queue: the Postgres job queue, and the only code that writes `jobs`.
//!
//! [`fleet`] is the `workers` table: the processes that hold leases.
//!
//! Invariants:
//! - A claim is one statement (`FOR UPDATE SKIP LOCKED`) that moves rows to `running` and
//!   bumps `attempt`, the lease epoch. No two holders ever share an epoch.
//! - Every later write of a holder names `(id, attempt)` and `state = 'running'`; when it
//!   matches no row the lease was lost and the caller gets [`QueueError::LeaseLost`],
//!   never a silent overwrite.
//! - Lease arithmetic uses the database clock.
//! - Enqueue runs in the caller's transaction, so a job commits with the row it serves,
//!   and sends one NOTIFY per statement (a wake-up hint; polling is the fallback), or
//!   none, leaving the wake-up to a [`Waker`] the caller pokes after its commit.
//! - The rescuer returns expired `pure`/`idempotent` jobs to `available` (with backoff) or
//!   `failed`; a `non_repeatable` job whose effect may have started goes to `parked`.

use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

pub mod fleet;

use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::sync::lock;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, PgExecutor, PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

/// The channel workers LISTEN on; the payload is the queue name.
pub const NOTIFY_CHANNEL: &str = "airlock_jobs";
/// Payload prefix of the notification sent when a queue is paused or resumed (the rest is
/// the queue's name): workers that keep the paused queues between claims re-read them.
pub const PAUSE_NOTIFY_PREFIX: &str = "paused:";
/// How long a worker may claim with the paused queues it read last.
pub const PAUSES_MAX_AGE: Duration = Duration::from_secs(1);

/// Default queue for jobs that do not name one.
pub const DEFAULT_QUEUE: &str = "default";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "job_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Available,
    Running,
    Completed,
    Failed,
    Parked,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Available,
        JobState::Running,
        JobState::Completed,
        JobState::Failed,
        JobState::Parked,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Available => "available",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Parked => "parked",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// What repeating a job's effect would do to the outside world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "effect_class", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum EffectClass {
    /// No external effect: safe to run again.
    Pure,
    /// Safe to repeat with the same idempotency key.
    Idempotent,
    /// Never repeated without a human.
    NonRepeatable,
}

/// A job row.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Job {
    pub id: Uuid,
    pub kind: String,
    pub queue: String,
    pub payload: serde_json::Value,
    pub state: JobState,
    pub priority: i16,
    pub run_at: DateTime<Utc>,
    pub attempt: i32,
    pub max_attempts: i32,
    pub effect_class: EffectClass,
    pub effect_started_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub attempted_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub unique_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl Job {
    /// The fencing handle for this claim.
    pub fn lease(&self) -> Lease {
        Lease { id: self.id, attempt: self.attempt }
    }
}

/// The proof of holding a claimed job: its id and the epoch of the claim. Every write a
/// holder makes goes through one of these, fenced on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    pub id: Uuid,
    pub attempt: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The job is no longer held under this epoch: another holder took it over, or it
    /// was rescued, cancelled or finished. The caller must abandon it without effects.
    #[error("lease lost on job {id} at attempt {attempt}")]
    LeaseLost { id: Uuid, attempt: i32 },
    #[error("job {0} not found")]
    NotFound(Uuid),
    #[error("job {id} cannot go from {from} by {action}")]
    InvalidTransition { id: Uuid, from: &'static str, action: &'static str },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for QueueError {
    fn kind(&self) -> ErrorKind {
        match self {
            QueueError::LeaseLost { .. } | QueueError::InvalidTransition { .. } => ErrorKind::InvalidTransition,
            QueueError::NotFound(_) => ErrorKind::NotFound,
            QueueError::Db(_) => ErrorKind::Internal,
        }
    }
}

impl QueueError {
    pub fn lost(lease: Lease) -> Self {
        QueueError::LeaseLost { id: lease.id, attempt: lease.attempt }
    }
}

/// A job to enqueue.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub kind: String,
    pub queue: String,
    pub payload: serde_json::Value,
    pub priority: i16,
    pub run_at: Option<DateTime<Utc>>,
    pub max_attempts: i32,
    pub effect_class: EffectClass,
    pub unique_key: Option<String>,
}

impl NewJob {
    pub fn new(kind: impl Into<String>, payload: serde_json::Value) -> Self {
        Self {
            kind: kind.into(),
            queue: DEFAULT_QUEUE.into(),
            payload,
            priority: 100,
            run_at: None,
            max_attempts: 10,
            effect_class: EffectClass::Pure,
            unique_key: None,
        }
    }
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }
    pub fn effect_class(mut self, class: EffectClass) -> Self {
        self.effect_class = class;
        self
    }
    pub fn unique_key(mut self, key: impl Into<String>) -> Self {
        self.unique_key = Some(key.into());
        self
    }
}

/// The result of enqueueing one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    pub id: Uuid,
    /// False when a live job with the same unique key already existed; `id` is that job.
    pub inserted: bool,
}

/// Enqueues one job in the caller's transaction. With a `unique_key` that a live job
/// already holds, nothing is inserted and the existing job is returned.
#[tracing::instrument(skip_all, fields(job.kind = %job.kind))]
pub async fn enqueue(tx: &mut Transaction<'_, Postgres>, job: &NewJob) -> Result<Enqueued, QueueError> {
    let mut out = enqueue_many(tx, std::slice::from_ref(job)).await?;
    Ok(out.remove(0))
}

/// Enqueues many jobs with one statement (the INSERT and one NOTIFY per queue), in the
/// caller's transaction. Results are in input order.
#[tracing::instrument(skip_all, fields(jobs = jobs.len()))]
pub async fn enqueue_many(tx: &mut Transaction<'_, Postgres>, jobs: &[NewJob]) -> Result<Vec<Enqueued>, QueueError> {
    insert_jobs(tx, jobs, true).await
}

/// [`enqueue_many`] without its NOTIFY: once the transaction has committed, the caller
/// hands the jobs' queues to a [`Waker`], which wakes idle workers for many such
/// transactions at once. For the hot paths, where a NOTIFY in every transaction would
/// serialise their commits (see [`Waker`]).
#[tracing::instrument(skip_all, fields(jobs = jobs.len()))]
pub async fn enqueue_many_quiet(
    tx: &mut Transaction<'_, Postgres>,
    jobs: &[NewJob],
) -> Result<Vec<Enqueued>, QueueError> {
    insert_jobs(tx, jobs, false).await
}

async fn insert_jobs(
    tx: &mut Transaction<'_, Postgres>,
    jobs: &[NewJob],
    notify: bool,
) -> Result<Vec<Enqueued>, QueueError> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = jobs.iter().map(|_| Uuid::now_v7()).collect();
    let kinds: Vec<&str> = jobs.iter().map(|j| j.kind.as_str()).collect();
    let queues: Vec<&str> = jobs.iter().map(|j| j.queue.as_str()).collect();
    let payloads: Vec<serde_json::Value> = jobs.iter().map(|j| j.payload.clone()).collect();
    let priorities: Vec<i16> = jobs.iter().map(|j| j.priority).collect();
    let run_ats: Vec<Option<DateTime<Utc>>> = jobs.iter().map(|j| j.run_at).collect();
    let max_attempts: Vec<i32> = jobs.iter().map(|j| j.max_attempts).collect();
    let classes: Vec<EffectClass> = jobs.iter().map(|j| j.effect_class).collect();
    let keys: Vec<Option<&str>> = jobs.iter().map(|j| j.unique_key.as_deref()).collect();

    // Rows whose unique key is live already are skipped by ON CONFLICT; the existing job
    // is looked up afterwards in the same transaction. The same statement sends one NOTIFY
    // per queue that got a row, unless told not to (`woke` is one row, so joining it keeps
    // every inserted id).
    let inserted: Vec<Uuid> = sqlx::query_scalar(
        r#"
        WITH inserted AS (
            INSERT INTO jobs (id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key)
            SELECT id, kind, queue, payload, priority, coalesce(run_at, now()), max_attempts, effect_class, unique_key
            FROM unnest($1::uuid[], $2::text[], $3::text[], $4::jsonb[], $5::smallint[],
                        $6::timestamptz[], $7::int[], $8::effect_class[], $9::text[])
                 AS t(id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key)
            ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('available', 'running', 'parked')
            DO NOTHING
            RETURNING id, queue),
        woke AS (SELECT count(pg_notify($10, queue)) FROM (SELECT DISTINCT queue FROM inserted) q WHERE $11)
        SELECT inserted.id FROM inserted CROSS JOIN woke
        "#,
    )
    .bind(&ids)
    .bind(&kinds)
    .bind(&queues)
    .bind(&payloads)
    .bind(&priorities)
    .bind(&run_ats)
    .bind(&max_attempts)
    .bind(&classes)
    .bind(&keys)
    .bind(NOTIFY_CHANNEL)
    .bind(notify)
    .fetch_all(&mut **tx)
    .await?;

    let mut out = Vec::with_capacity(jobs.len());
    let inserted: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
    for (id, job) in ids.iter().zip(jobs) {
        if inserted.contains(id) {
            out.push(Enqueued { id: *id, inserted: true });
        } else {
            let key = job.unique_key.as_deref().unwrap_or_default();
            let existing: Uuid = sqlx::query_scalar(
                r#"SELECT id FROM jobs WHERE unique_key = $1 AND state IN ('available', 'running', 'parked')"#,
            )
            .bind(key)
            .fetch_one(&mut **tx)
            .await?;
            out.push(Enqueued { id: existing, inserted: false });
        }
    }
    Ok(out)
}

/// The least time between two NOTIFYs of one [`Waker`].
pub const WAKE_SPACING: Duration = Duration::from_millis(2);

/// Wakes idle workers for jobs enqueued without a NOTIFY of their own
/// ([`enqueue_many_quiet`]), after the enqueuing transactions have committed.
///
/// A transaction that sends a NOTIFY holds one lock, shared by the whole database, from
/// just before its commit until the commit has reached disk, so such commits cannot share
/// a disk flush: under load, a fifth of the pipeline's busy connections were waiting for
/// it at COMMIT. A waker sends one NOTIFY per queue poked since its last one, at most one
/// every [`WAKE_SPACING`], in a transaction of its own that writes nothing else, whose
/// commit Postgres therefore does not flush to disk: it holds that lock only for a moment.
/// An idle worker then claims up to [`WAKE_SPACING`] later than it would have, and a busy
/// fleet is not woken once per enqueue. A process that dies between a commit and its
/// wake-up leaves the job to the workers' poll (`worker.poll_interval_ms`).
#[derive(Clone)]
pub struct Waker {
    pending: Arc<Mutex<BTreeSet<String>>>,
    poke: tokio::sync::mpsc::Sender<()>,
}

impl Waker {
    /// A waker sending on `pool`; its task ends with the last clone. Needs a Tokio runtime.
    pub fn new(pool: PgPool) -> Self {
        let pending: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        // One slot: a poke while one is waiting already is the same wake-up.
        let (poke, mut pokes) = tokio::sync::mpsc::channel::<()>(1);
        let queues = Arc::clone(&pending);
        tokio::spawn(async move {
            while pokes.recv().await.is_some() {
                let started = tokio::time::Instant::now();
                let batch: Vec<String> = std::mem::take(&mut *lock(&queues)).into_iter().collect();
                if batch.is_empty() {
                    continue;
                }
                if let Err(e) = notify_queues(&pool, &batch).await {
                    tracing::warn!(error = %e, queues = ?batch, "wake-up not sent; idle workers find the jobs at their next poll");
                }
                tokio::time::sleep_until(started + WAKE_SPACING).await;
            }
        });
        Self { pending, poke }
    }

    /// Wakes idle workers for `queue` soon; call it after the commit that made its jobs.
    pub fn wake(&self, queue: &str) {
        {
            let mut pending = lock(&self.pending);
            if !pending.contains(queue) {
                pending.insert(queue.to_string());
            }
        }
        let _ = self.poke.try_send(());
    }
}

/// One NOTIFY per queue, in a transaction of their own.
async fn notify_queues(pool: &PgPool, queues: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")
        .bind(NOTIFY_CHANNEL)
        .bind(queues)
        .execute(pool)
        .await?;
    Ok(())
}

/// Which queues a claim may take from.
#[derive(Debug, Clone, Default)]
pub struct ClaimFilter {
    /// `None`: every queue.
    pub queues: Option<Vec<String>>,
}

/// The claim statement: `$1` owner, `$2` queues (NULL: every queue), `$3` limit, `$4`
/// lease seconds; `{paused}` is empty or a filter that skips the paused queues; `{from}`
/// is empty or, for a bounded claim, `(priority, run_at) >= ($5, $6)`, where the index
/// scan starts (see [`ClaimFrom`]).
///
/// Its plan walks the partial index `jobs_claim_idx` in claim order and stops after `$3`
/// rows, whatever the backlog (a test checks it with `EXPLAIN`, custom and generic):
/// - the statement is kept prepared, and its generic plan (which cannot see `$3`) still
///   updates the picked rows through the primary key, from the array of their ids,
///   instead of joining the whole table;
/// - the paused queues are written into the statement as constants (they change rarely,
///   so a connection keeps one statement per set it has seen): as a parameter, a generic
///   plan cannot estimate `queue <> ALL ($5)`, and with one busy queue it expects no row to
///   pass and sorts the whole backlog.
const CLAIM_SQL: &str = r#"
    UPDATE jobs j
    SET state = 'running', attempt = j.attempt + 1, lease_owner = $1,
        lease_expires_at = now() + make_interval(secs => $4), heartbeat_at = now(),
        attempted_at = now(), effect_started_at = NULL
    WHERE j.id = ANY (ARRAY(
        SELECT id FROM jobs
        WHERE state = 'available' AND run_at <= now()
          AND ($2::text[] IS NULL OR queue = ANY ($2)) {paused} {from}
        ORDER BY priority, run_at, id
        LIMIT $3
        FOR UPDATE SKIP LOCKED))
    RETURNING j.*
"#;

/// Where a bounded claim starts in claim order: the claim skips every job that sorts
/// before `(priority, run_at)`.
///
/// A claim walks `jobs_claim_idx` from its front. The versions of jobs claimed lately stay
/// in that index until no snapshot can see them; while a long transaction pins the xmin
/// horizon, none can be removed, and every claim steps over all the jobs claimed since
/// the pin began (tens of thousands after a few minutes) before it reaches a live one.
/// A worker that notices its claims slowing down starts them a little behind the last
/// job it claimed instead (see the worker's claim cursor), and still runs an unbounded
/// claim regularly for what sorts earlier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimFrom {
    pub priority: i16,
    pub run_at: DateTime<Utc>,
}

/// The claim statement skipping `paused`, bounded (`$5`, `$6`, see [`ClaimFrom`]) or not.
pub fn claim_sql(paused: &[String], bounded: bool) -> String {
    let from = if bounded { "AND (priority, run_at) >= ($5, $6)" } else { "" };
    let sql = CLAIM_SQL.replace("{from}", from);
    if paused.is_empty() {
        return sql.replace("{paused}", "");
    }
    let list: Vec<String> = paused.iter().map(|q| sql_literal(q)).collect();
    sql.replace("{paused}", &format!("AND queue <> ALL (ARRAY[{}]::text[])", list.join(", ")))
}

/// A string constant that means `s` whatever `standard_conforming_strings` says.
fn sql_literal(s: &str) -> String {
    format!("E'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

/// The queues paused now.
pub async fn paused_queues(db: impl PgExecutor<'_>) -> Result<Vec<String>, QueueError> {
    Ok(sqlx::query_scalar("SELECT coalesce(array_agg(queue ORDER BY queue), '{}') FROM queue_pauses")
        .fetch_one(db)
        .await?)
}

/// Claims up to `limit` available jobs for `owner`, bumping each one's attempt, in one
/// statement; paused queues are skipped. Jobs come back in claim order.
pub async fn claim_batch(
    db: &sqlx::PgPool,
    owner: &str,
    filter: &ClaimFilter,
    limit: i64,
    lease: Duration,
) -> Result<Vec<Job>, QueueError> {
    let paused = paused_queues(db).await?;
    let claim = Claim { owner, filter, limit, lease, paused: &paused, from: None };
    Ok(complete_and_claim(db, &claim, &[]).await?.0)
}

/// One claim, as a worker makes it.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub owner: &'a str,
    pub filter: &'a ClaimFilter,
    /// The most jobs to claim.
    pub limit: i64,
    pub lease: Duration,
    /// The queues paused now (a worker keeps them between claims, see
    /// [`PAUSE_NOTIFY_PREFIX`]).
    pub paused: &'a [String],
    /// Where the claim starts; `None`: from the front.
    pub from: Option<ClaimFrom>,
}

/// Completes the held jobs `completing` and makes `claim`, in one statement (one commit
/// for both, as a worker does when a finished job frees the slot it claims for). Returns
/// the jobs claimed, in claim order, and the leases completed (the others were lost and
/// are left untouched).
#[tracing::instrument(skip_all, fields(worker.id = claim.owner, limit = claim.limit, completing = completing.len()))]
pub async fn complete_and_claim(
    db: &sqlx::PgPool,
    claim: &Claim<'_>,
    completing: &[Lease],
) -> Result<(Vec<Job>, Vec<Lease>), QueueError> {
    // A claim from named queues leaves the paused ones out of its list.
    let queues = unpaused(claim.filter, claim.paused);
    let nothing_to_claim = queues.as_ref().is_some_and(Vec::is_empty);
    if nothing_to_claim && completing.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let limit = if nothing_to_claim { 0 } else { claim.limit };
    let paused = if queues.is_none() { claim.paused } else { &[] };
    let bounded = claim.from.is_some();
    let sql = if completing.is_empty() {
        claim_sql(paused, bounded)
    } else {
        complete_and_claim_sql(paused, bounded, completing.len() == 1)
    };
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(claim.owner)
        .bind(queues)
        .bind(limit)
        .bind(claim.lease.as_secs_f64());
    if let Some(from) = claim.from {
        q = q.bind(from.priority).bind(from.run_at);
    }
    if !completing.is_empty() {
        q = q
            .bind(completing.iter().map(|l| l.id).collect::<Vec<_>>())
            .bind(completing.iter().map(|l| l.attempt).collect::<Vec<_>>());
    }
    let rows = q.fetch_all(db).await?;
    let mut done = Vec::new();
    if let Some(row) = rows.first().filter(|_| !completing.is_empty()) {
        let ids: Option<Vec<Uuid>> = row.try_get("done_ids")?;
        let attempts: Option<Vec<i32>> = row.try_get("done_attempts")?;
        done = ids
            .unwrap_or_default()
            .into_iter()
            .zip(attempts.unwrap_or_default())
            .map(|(id, attempt)| Lease { id, attempt })
            .collect();
    }
    let mut jobs = Vec::with_capacity(rows.len());
    for row in &rows {
        // With completions, a row whose job columns are NULL says that nothing was claimed.
        if row.try_get::<Option<Uuid>, _>("id")?.is_some() {
            jobs.push(Job::from_row(row)?);
        }
    }
    jobs.sort_by_key(|j| (j.priority, j.run_at, j.id));
    Ok((jobs, done))
}

/// The statement of [`complete_and_claim`]: the claim statement's parameters, then the
/// ids and attempts of the jobs to complete (`one`: a single job, which needs no lock
/// order). It returns one row per job claimed (at least one row: the job's columns are
/// NULL when none was) with the completed ids and attempts.
pub fn complete_and_claim_sql(paused: &[String], bounded: bool, one: bool) -> String {
    let (ids, attempts) = if bounded { ("$7", "$8") } else { ("$5", "$6") };
    format!(
        "WITH done AS ({}), claimed AS ({}) \
         SELECT d.done_ids, d.done_attempts, c.* \
         FROM (SELECT array_agg(id) AS done_ids, array_agg(attempt) AS done_attempts FROM done) d \
         LEFT JOIN claimed c ON true",
        if one { COMPLETE_ONE_SQL } else { COMPLETE_SQL }.replace("{ids}", ids).replace("{attempts}", attempts),
        claim_sql(paused, bounded)
    )
}

/// The queues a claim from named queues may take from, paused ones left out; `None`:
/// every queue.
fn unpaused<'a>(filter: &'a ClaimFilter, paused: &[String]) -> Option<Vec<&'a str>> {
    filter.queues.as_ref().map(|qs| qs.iter().map(String::as_str).filter(|q| !paused.iter().any(|p| p == q)).collect())
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

/// The held jobs among the arrays of ids `$ids` and attempts `$attempts`, locked in id
/// order, as `held(id)`: what a statement over many held jobs joins, so that two of them
/// on overlapping jobs (a worker's heartbeat and its completions) take their locks in the
/// same order and never deadlock. An update alone locks rows in whatever order its plan
/// meets them: the arrays' order, or the table's on a small table.
macro_rules! held_in_id_order {
    ($ids:literal, $attempts:literal) => {
        concat!(
            "(SELECT h.id FROM jobs h JOIN unnest(",
            $ids,
            "::uuid[], ",
            $attempts,
            "::int[]) AS t(id, attempt) ON h.id = t.id AND h.attempt = t.attempt ",
            "WHERE h.state = 'running' ORDER BY h.id FOR UPDATE OF h) AS held"
        )
    };
}

/// What completing a held job sets.
macro_rules! completed {
    () => {
        "state = 'completed', finished_at = now(), lease_owner = NULL, lease_expires_at = NULL, effect_started_at = NULL"
    };
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
    let ids: Vec<Uuid> = leases.iter().map(|l| l.id).collect();
    let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
    let held: Vec<(Uuid, i32)> =
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
/// lease has not run out; a statement of its own or the first part of a larger one (add
/// `RETURNING id` to tell whether it held).
pub const MARK_EFFECT_STARTED_SQL: &str = r#"UPDATE jobs SET effect_started_at = now()
    WHERE id = $1 AND attempt = $2 AND state = 'running' AND lease_expires_at > now()"#;

/// Completes the job held under lease (`$1` id, `$2` attempt); like
/// [`MARK_EFFECT_STARTED_SQL`], a statement of its own or part of a larger one.
pub const COMPLETE_HELD_SQL: &str =
    concat!("UPDATE jobs SET ", completed!(), " WHERE id = $1 AND attempt = $2 AND state = 'running'");

/// [`MARK_EFFECT_STARTED_SQL`] for the held jobs whose ids and attempts are the arrays `$1`
/// and `$2`, locking them in id order first; the first part of a larger statement (add
/// `RETURNING j.id` to tell which held).
pub const MARK_MANY_EFFECT_STARTED_SQL: &str = concat!(
    "UPDATE jobs j SET effect_started_at = now() FROM ",
    held_in_id_order!("$1", "$2"),
    " WHERE j.id = held.id AND j.state = 'running' AND j.lease_expires_at > now()"
);

/// Completes a held job.
pub async fn complete(db: impl PgExecutor<'_>, lease: Lease) -> Result<(), QueueError> {
    let r = sqlx::query(COMPLETE_HELD_SQL).bind(lease.id).bind(lease.attempt).execute(db).await?;
    fenced(r, lease)
}

/// Completes the held jobs whose ids and attempts are the arrays `{ids}` and `{attempts}`,
/// fenced on their leases, locking them in id order first; returns the ones completed.
const COMPLETE_SQL: &str = concat!(
    "UPDATE jobs d SET ",
    completed!(),
    " FROM ",
    held_in_id_order!("{ids}", "{attempts}"),
    " WHERE d.id = held.id AND d.state = 'running' RETURNING d.id, d.attempt"
);

/// [`COMPLETE_SQL`] for one job: a statement that waits for one row lock and holds no other
/// lock of a held job cannot deadlock, and does without the sort and second lookup.
const COMPLETE_ONE_SQL: &str = concat!(
    "UPDATE jobs d SET ",
    completed!(),
    " FROM unnest({ids}::uuid[], {attempts}::int[]) AS t(id, attempt)",
    " WHERE d.id = t.id AND d.attempt = t.attempt AND d.state = 'running' RETURNING d.id, d.attempt"
);

/// The statement of [`complete_many`]: completes the held jobs whose ids and attempts are
/// the arrays `$1` and `$2`.
pub fn complete_many_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| COMPLETE_SQL.replace("{ids}", "$1").replace("{attempts}", "$2"));
    SQL.as_str()
}

/// Completes many held jobs in one statement; returns the leases that were still held
/// (the others were lost and are left untouched).
pub async fn complete_many(db: impl PgExecutor<'_>, leases: &[Lease]) -> Result<Vec<Lease>, QueueError> {
    if leases.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = leases.iter().map(|l| l.id).collect();
    let attempts: Vec<i32> = leases.iter().map(|l| l.attempt).collect();
    let done: Vec<(Uuid, i32)> =
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
    let state: Option<JobState> = sqlx::query_scalar(
        r#"UPDATE jobs SET
               state = CASE WHEN $4 OR attempt >= max_attempts THEN 'failed'::job_state ELSE 'available'::job_state END,
               finished_at = CASE WHEN $4 OR attempt >= max_attempts THEN now() END,
               run_at = CASE WHEN $4 OR attempt >= max_attempts THEN run_at
                             ELSE now() + coalesce(make_interval(secs => $5), airlock_backoff(attempt)) END,
               last_error = $3, lease_owner = NULL, lease_expires_at = NULL, effect_started_at = NULL
           WHERE id = $1 AND attempt = $2 AND state = 'running'
           RETURNING state"#,
    )
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

/// Cancels a job that is not running (an operator or owner action). A running job is
/// refused: its holder finishes or its lease expires first.
pub async fn cancel(db: impl PgExecutor<'_>, id: Uuid, reason: &str) -> Result<(), QueueError> {
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
pub async fn retry_now(db: impl PgExecutor<'_>, id: Uuid) -> Result<(), QueueError> {
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

/// Reads one job.
pub async fn get(db: impl PgExecutor<'_>, id: Uuid) -> Result<Job, QueueError> {
    sqlx::query_as("SELECT * FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(QueueError::NotFound(id))
}

/// What the rescuer did with one expired job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RescueOutcome {
    Retried,
    Failed,
    Parked,
}

/// A job the rescuer moved, with its state before the move, so that the owner of the
/// job's kind can update its own rows in the same transaction.
#[derive(Debug, Clone)]
pub struct Rescued {
    pub job: Job,
    pub outcome: RescueOutcome,
    /// Whether the effect may have started under the expired lease.
    pub effect_started: bool,
}

/// Counts from one pass of the rescuer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RescueCounts {
    pub retried: usize,
    pub failed: usize,
    pub parked: usize,
}

/// One pass of the rescuer over at most `limit` jobs whose lease expired, in the caller's
/// transaction (so the caller can update the rows the jobs serve before it commits).
/// Several workers may run it at once: SKIP LOCKED gives each its own rows.
#[tracing::instrument(skip_all)]
pub async fn rescue_expired(tx: &mut Transaction<'_, Postgres>, limit: i64) -> Result<Vec<Rescued>, QueueError> {
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(
        r#"
        WITH expired AS (
            SELECT id, effect_started_at IS NOT NULL AS effect_started FROM jobs
            WHERE lease_owner IS NOT NULL AND state = 'running' AND lease_expires_at < now()
            ORDER BY lease_expires_at
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs j SET
            state = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN 'parked'::job_state
                WHEN j.attempt >= j.max_attempts THEN 'failed'::job_state
                ELSE 'available'::job_state END,
            finished_at = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN NULL
                WHEN j.attempt >= j.max_attempts THEN now() END,
            run_at = CASE
                WHEN j.effect_class <> 'non_repeatable' OR NOT e.effect_started THEN now() + airlock_backoff(j.attempt)
                ELSE j.run_at END,
            effect_started_at = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN j.effect_started_at END,
            last_error = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started
                    THEN 'lease expired after the effect may have started: parked for a human'
                ELSE 'lease expired' END,
            lease_owner = NULL, lease_expires_at = NULL
        FROM expired e WHERE j.id = e.id
        RETURNING j.id, e.effect_started
        "#,
    )
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for (id, effect_started) in rows {
        let job: Job = sqlx::query_as("SELECT * FROM jobs WHERE id = $1").bind(id).fetch_one(&mut **tx).await?;
        let outcome = match job.state {
            JobState::Parked => RescueOutcome::Parked,
            JobState::Failed => RescueOutcome::Failed,
            _ => RescueOutcome::Retried,
        };
        out.push(Rescued { job, outcome, effect_started });
    }
    Ok(out)
}

impl RescueCounts {
    pub fn of(rescued: &[Rescued]) -> Self {
        let mut c = RescueCounts::default();
        for r in rescued {
            match r.outcome {
                RescueOutcome::Retried => c.retried += 1,
                RescueOutcome::Failed => c.failed += 1,
                RescueOutcome::Parked => c.parked += 1,
            }
        }
        c
    }
}

/// Deletes at most `batch` completed or cancelled jobs that finished more than `age` ago.
/// Returns how many were deleted; call again while it returns `batch`.
pub async fn prune_finished(db: impl PgExecutor<'_>, age: Duration, batch: i64) -> Result<u64, QueueError> {
    let r = sqlx::query(
        r#"DELETE FROM jobs WHERE id IN (
               SELECT id FROM jobs
               WHERE state IN ('completed', 'cancelled') AND finished_at < now() - make_interval(secs => $1)
               ORDER BY finished_at
               LIMIT $2
               FOR UPDATE SKIP LOCKED)"#,
    )
    .bind(age.as_secs_f64())
    .bind(batch)
    .execute(db)
    .await?;
    Ok(r.rows_affected())
}

/// Pauses a queue: workers stop claiming from it (running jobs go on) as soon as they hear
/// the notification, and within [`PAUSES_MAX_AGE`] if they miss it.
pub async fn pause_queue(db: impl PgExecutor<'_>, queue: &str, reason: &str) -> Result<(), QueueError> {
    sqlx::query(
        "WITH p AS (INSERT INTO queue_pauses (queue, reason) VALUES ($1, $2) ON CONFLICT (queue) DO NOTHING) \
         SELECT pg_notify($3, $4)",
    )
    .bind(queue)
    .bind(reason)
    .bind(NOTIFY_CHANNEL)
    .bind(format!("{PAUSE_NOTIFY_PREFIX}{queue}"))
    .execute(db)
    .await?;
    Ok(())
}

/// Resumes a paused queue and wakes workers.
pub async fn resume_queue(db: impl PgExecutor<'_>, queue: &str) -> Result<(), QueueError> {
    sqlx::query("WITH d AS (DELETE FROM queue_pauses WHERE queue = $1) SELECT pg_notify($2, $3)")
        .bind(queue)
        .bind(NOTIFY_CHANNEL)
        .bind(format!("{PAUSE_NOTIFY_PREFIX}{queue}"))
        .execute(db)
        .await?;
    Ok(())
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

/// Samples the queue-depth gauge (jobs by kind and state) for `/metrics`.
pub async fn sample_depth(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    let depth: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT kind, state::text, count(*) FROM jobs GROUP BY kind, state").fetch_all(db).await?;
    for (kind, state, n) in depth {
        metrics::gauge!(airlock_core::metrics::QUEUE_DEPTH, "kind" => kind, "state" => state).set(n as f64);
    }
    Ok(())
}

fn truncate_error(e: &str) -> &str {
    match e.char_indices().nth(2000) {
        Some((i, _)) => &e[..i],
        None => e,
    }
}

/// Lists jobs newest first, optionally by state and kind, after a cursor id.
pub async fn list(
    db: impl PgExecutor<'_>,
    state: Option<JobState>,
    kind: Option<&str>,
    before: Option<Uuid>,
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
