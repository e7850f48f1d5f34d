//! Claims: one statement that takes available jobs with `FOR UPDATE SKIP LOCKED`, bumps
//! each one's attempt (the lease epoch) and, when a worker has finished jobs, completes them
//! in the same round trip.

use std::time::Duration;

use airlock_core::ids::JobId;
use chrono::{DateTime, Utc};
use sqlx::{FromRow, Row};

use crate::job::{Job, QueueError};
use crate::lease::{Lease, keeps_completed};
use crate::pauses::paused_queues;

/// Which queues a claim may take from.
#[derive(Debug, Clone, Default)]
pub struct ClaimFilter {
    /// `None`: every queue.
    pub queues: Option<Vec<String>>,
}

/// The claim statement (see `airlock_jobs_claim`): `$1` owner, `$2` queues (NULL: every
/// queue), `$3` the queues paused, `$4` limit, `$5` lease seconds, and for a bounded claim
/// `$6`–`$8`, where it starts (see [`ClaimFrom`]; NULL: from the front).
///
/// Its plan walks the partial index `jobs_claim_idx` of each live partition in claim order
/// (merged) and stops after `$4` rows, whatever the backlog, and updates the jobs it locked
/// by one primary-key lookup each; the finished jobs are never read (a test checks the
/// function's plans, custom and generic). The function's settings leave the planner only the
/// indexes: the ring's slots have no statistics and are truncated in turn, and a plan made
/// while they were nearly empty, kept while one fills, would sort its backlog or join it
/// whole at every claim; and the queues paused, a parameter, would otherwise have a generic
/// plan expect no row to pass and sort the whole backlog.
pub const CLAIM_SQL: &str = "SELECT * FROM airlock_jobs_claim($1, $2, $3, $4, $5, $6, $7, $8)";

/// Where a bounded claim starts in claim order: at the job `(priority, run_at, id)` (the
/// last one its worker claimed), or at `run_at` a second ago if that sorts earlier; the
/// claim skips every job that sorts before.
///
/// A claim walks `jobs_claim_idx` from its front. The versions of jobs claimed stay in that
/// index until the ring truncates their slot (or, in `jobs_long`, until no snapshot can see
/// them and vacuum has passed), and every claim from the front steps over all the jobs
/// claimed from the slot so far before it reaches a live one: a slot's whole backlog by
/// the time it is drained, or everything claimed since a long transaction pinned the
/// horizon. A worker that notices its claims slowing down starts them at the last job it
/// claimed instead (see the worker's claim cursor), and still runs an unbounded claim
/// regularly for what sorts earlier. The second before now is for jobs enqueued by a
/// transaction that began before the last job's and committed after it (a job's `run_at`
/// is its transaction's start): any transaction that lasts no longer commits its jobs
/// where a bounded claim still finds them (`0032_claim_from_the_last_job`).
///
/// A bounded claim also passes over every version that a transaction has updated or
/// locked since it was written (`xmax` set). Under load, most entries a claim meets at the
/// front of the index are jobs that other claims took after this statement's snapshot
/// was taken: their version still reads `available`, and `FOR UPDATE` would follow it to
/// the job's newest, `running` version and lock that before finding it no longer
/// available, holding the lock until its own commit, so the job's holder, completing it,
/// waits for a stranger's commit. A version whose updater or locker aborted keeps its
/// `xmax` too and would never be taken by a bounded claim: the unbounded one, which never
/// looks at `xmax`, takes it.
///
/// Ordered as claims take jobs (the fields in that order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimFrom {
    pub priority: i16,
    pub run_at: DateTime<Utc>,
    pub id: JobId,
}

impl ClaimFrom {
    /// Where `job` stands in claim order.
    pub fn at(job: &Job) -> Self {
        Self { priority: job.priority, run_at: job.run_at, id: job.id }
    }
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
pub async fn complete_and_claim<'e>(
    db: impl sqlx::PgExecutor<'e>,
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
    // A claim from named queues has left the paused ones out already.
    let paused: &[String] = if queues.is_none() { claim.paused } else { &[] };
    let keep = keeps_completed();
    // One job completing in a partition it is known to lie in: the statement names it.
    let slotted = crate::slotted::complete_and_claim_sql(completing, keep);
    let sql = match slotted {
        Some(sql) => sql,
        None if completing.is_empty() => CLAIM_SQL,
        None => COMPLETE_AND_CLAIM_SQL,
    };
    let mut q = sqlx::query(sql)
        .bind(claim.owner)
        .bind(queues)
        .bind(paused)
        .bind(limit)
        .bind(claim.lease.as_secs_f64())
        .bind(claim.from.map(|f| f.priority))
        .bind(claim.from.map(|f| f.run_at))
        .bind(claim.from.map(|f| f.id));
    if slotted.is_some() {
        q = q.bind(completing[0].id).bind(completing[0].attempt);
    } else if !completing.is_empty() {
        q = q
            .bind(completing.iter().map(|l| l.id).collect::<Vec<_>>())
            .bind(completing.iter().map(|l| l.attempt).collect::<Vec<_>>())
            .bind(keep);
    }
    let rows = q.fetch_all(db).await?;
    let mut done = Vec::new();
    if let Some(row) = rows.first().filter(|_| !completing.is_empty()) {
        let ids: Option<Vec<JobId>> = row.try_get("done_ids")?;
        let attempts: Option<Vec<i32>> = row.try_get("done_attempts")?;
        done = ids
            .unwrap_or_default()
            .into_iter()
            .zip(attempts.unwrap_or_default())
            .map(|(id, attempt)| Lease::new(id, attempt))
            .collect();
    }
    let mut jobs = Vec::with_capacity(rows.len());
    for row in &rows {
        // With completions, a row whose job columns are NULL says that nothing was claimed.
        if row.try_get::<Option<JobId>, _>("id")?.is_some() {
            jobs.push(Job::from_row(row)?);
        }
    }
    jobs.sort_by_key(|j| (j.priority, j.run_at, j.id));
    Ok((jobs, done))
}

/// The end of a statement completing and claiming, after its `done` (the `id` and `attempt`
/// of each job completed): the claim of `$1`–`$8`, and one row per job claimed (at least
/// one) with the completed ids and attempts.
macro_rules! claim_after_done {
    () => {
        "claimed AS (SELECT * FROM airlock_jobs_claim($1, $2, $3, $4, $5, $6, $7, $8)) \
         SELECT d.done_ids, d.done_attempts, c.* \
         FROM (SELECT array_agg(id) AS done_ids, array_agg(attempt) AS done_attempts FROM done) d \
         LEFT JOIN claimed c ON true"
    };
}
pub(crate) use claim_after_done;

/// The statement of [`complete_and_claim`]: the claim statement's parameters, then the
/// ids and attempts of the jobs to complete and whether their rows are kept (see
/// `airlock_jobs_complete`). It returns one row per job claimed (at least one row: the job's
/// columns are NULL when none was) with the completed ids and attempts.
pub const COMPLETE_AND_CLAIM_SQL: &str =
    concat!("WITH done AS (SELECT id, attempt FROM airlock_jobs_complete($9, $10, $11)), ", claim_after_done!());

/// The queues a claim from named queues may take from, paused ones left out; `None`:
/// every queue.
fn unpaused<'a>(filter: &'a ClaimFilter, paused: &[String]) -> Option<Vec<&'a str>> {
    filter.queues.as_ref().map(|qs| qs.iter().map(String::as_str).filter(|q| !paused.iter().any(|p| p == q)).collect())
}
