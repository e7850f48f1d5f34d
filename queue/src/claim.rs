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

/// The slots of the ring (`0028_job_ring`): a claim told nothing better reads them all.
pub const RING_SLOTS: [i16; 4] = [0, 1, 2, 3];

/// The claim, a data-modifying CTE `claimed` of the statements below: `$1` owner, `$2`
/// queues (NULL: every queue), `$3` the queues paused, `$4` limit, `$5` lease seconds, for
/// a bounded claim `$6`–`$8`, where it starts (see [`ClaimFrom`]; NULL: from the front),
/// and `$9` the slots of the ring it reads besides `jobs_long` (see [`Claim::ring`]).
///
/// Its plan walks the partial index `jobs_claim_idx` of each partition it reads in claim
/// order (merged) and stops after `$4` rows, whatever the backlog, and updates the jobs it
/// locked by one primary-key lookup each; the finished jobs are never read (a test checks
/// its plans, custom and generic). The slots not named in `$9` are pruned when the plan
/// starts: neither their claim indexes are scanned nor their jobs looked up. The planner is
/// left only the indexes by the settings of the connections that run it (see
/// `airlock_core::db::queue_plans`): the ring's slots have no statistics and are truncated
/// in turn, and a plan made while they were nearly empty, kept while one fills, would sort
/// its backlog or join it whole at every claim; and the queues paused, a parameter, would
/// otherwise have a generic plan expect no row to pass and sort the whole backlog.
macro_rules! claimed_cte {
    () => {
        "claimed AS (UPDATE jobs_live j \
         SET state = 'running', attempt = j.attempt + 1, lease_owner = $1::text, \
             lease_expires_at = now() + make_interval(secs => $5::float8), heartbeat_at = now(), \
             attempted_at = now(), effect_started_at = NULL \
         FROM unnest(ARRAY( \
             SELECT l.id FROM jobs_live l \
             WHERE l.state = 'available' AND l.run_at <= now() \
               AND ($2::text[] IS NULL OR l.queue = ANY ($2)) AND l.queue <> ALL ($3::text[]) \
               AND (l.priority, l.run_at, l.id) >= (coalesce($6::smallint, -32768), \
                   least(coalesce($7::timestamptz, '-infinity'), now() - interval '1 second'), \
                   coalesce(CASE WHEN $7 <= now() - interval '1 second' THEN $8::uuid END, \
                            '00000000-0000-0000-0000-000000000000')) \
               AND ($6 IS NULL OR l.xmax = '0') \
               AND l.slot IN (-1, ($9::smallint[])[1], $9[2], $9[3], $9[4]) \
             ORDER BY l.priority, l.run_at, l.id \
             LIMIT $4::bigint \
             FOR UPDATE SKIP LOCKED)) AS picked(id) \
         WHERE j.id = picked.id AND j.slot IN (-1, $9[1], $9[2], $9[3], $9[4]) \
         RETURNING j.*)"
    };
}

/// The claim statement (see [`claimed_cte!`] for its parameters): one row per job claimed,
/// at least one (the job's columns are NULL when none was), each with `ring_slots`, the
/// slots of the ring that hold rows now.
pub const CLAIM_SQL: &str = concat!(
    "WITH ",
    claimed_cte!(),
    " SELECT r.ring_slots, c.* FROM (SELECT airlock_job_ring_used() AS ring_slots) r LEFT JOIN claimed c ON true"
);

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
    let claim = Claim { owner, filter, limit, lease, paused: &paused, from: None, ring: &RING_SLOTS };
    Ok(complete_and_claim(db, &claim, &[]).await?.jobs)
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
    /// The slots of the ring the claim reads besides `jobs_long` ([`RING_SLOTS`]: all of
    /// them). A worker passes those its last claim found holding rows ([`Claimed::ring`]);
    /// the others are empty but for one just made current, which the claim then passes
    /// over and says so ([`Claimed::passed_over`]).
    pub ring: &'a [i16],
}

/// What [`complete_and_claim`] did.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The jobs claimed, in claim order.
    pub jobs: Vec<Job>,
    /// The leases completed (the others were lost and are left untouched).
    pub done: Vec<Lease>,
    /// The slots of the ring that held rows when the claim was made, in slot order.
    pub ring: Vec<i16>,
    /// A slot of `ring` was not read by the claim: jobs there may sort before those it took,
    /// and it may have come back short while jobs were waiting. Claim again with `ring`.
    pub passed_over: bool,
}

/// Completes the held jobs `completing` and makes `claim`, in one statement (one commit
/// for both, as a worker does when a finished job frees the slot it claims for).
#[tracing::instrument(skip_all, fields(worker.id = claim.owner, limit = claim.limit, completing = completing.len()))]
pub async fn complete_and_claim<'e>(
    db: impl sqlx::PgExecutor<'e>,
    claim: &Claim<'_>,
    completing: &[Lease],
) -> Result<Claimed, QueueError> {
    // A claim from named queues leaves the paused ones out of its list.
    let queues = unpaused(claim.filter, claim.paused);
    let nothing_to_claim = queues.as_ref().is_some_and(Vec::is_empty);
    if nothing_to_claim && completing.is_empty() {
        return Ok(Claimed { ring: claim.ring.to_vec(), ..Claimed::default() });
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
        .bind(claim.from.map(|f| f.id))
        .bind(claim.ring);
    if slotted.is_some() {
        q = q.bind(completing[0].id).bind(completing[0].attempt);
    } else if !completing.is_empty() {
        q = q
            .bind(completing.iter().map(|l| l.id).collect::<Vec<_>>())
            .bind(completing.iter().map(|l| l.attempt).collect::<Vec<_>>())
            .bind(keep);
    }
    let rows = q.fetch_all(db).await?;
    let ring: Vec<i16> = match rows.first() {
        Some(row) => row.try_get("ring_slots")?,
        None => claim.ring.to_vec(),
    };
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
        // A row whose job columns are NULL says that nothing was claimed.
        if row.try_get::<Option<JobId>, _>("id")?.is_some() {
            jobs.push(Job::from_row(row)?);
        }
    }
    jobs.sort_by_key(|j| (j.priority, j.run_at, j.id));
    let passed_over = ring.iter().any(|s| !claim.ring.contains(s));
    Ok(Claimed { jobs, done, ring, passed_over })
}

/// The end of a statement completing and claiming, after its `done` (the `id` and `attempt`
/// of each job completed): the claim of `$1`–`$9` ([`claimed_cte!`]), and one row per job
/// claimed (at least one) with the completed ids and attempts and `ring_slots` (see
/// [`CLAIM_SQL`]).
macro_rules! claim_after_done {
    () => {
        concat!(
            $crate::claim::claimed_cte!(),
            " SELECT d.done_ids, d.done_attempts, r.ring_slots, c.* \
             FROM (SELECT array_agg(id) AS done_ids, array_agg(attempt) AS done_attempts FROM done) d, \
                  (SELECT airlock_job_ring_used() AS ring_slots) r \
             LEFT JOIN claimed c ON true"
        )
    };
}
pub(crate) use {claim_after_done, claimed_cte};

/// The statement of [`complete_and_claim`]: the claim statement's parameters, then the
/// ids and attempts of the jobs to complete and whether their rows are kept (see
/// `airlock_jobs_complete`). It returns one row per job claimed (at least one row: the job's
/// columns are NULL when none was) with the completed ids and attempts.
pub const COMPLETE_AND_CLAIM_SQL: &str =
    concat!("WITH done AS (SELECT id, attempt FROM airlock_jobs_complete($10, $11, $12)), ", claim_after_done!());

/// The queues a claim from named queues may take from, paused ones left out; `None`:
/// every queue.
fn unpaused<'a>(filter: &'a ClaimFilter, paused: &[String]) -> Option<Vec<&'a str>> {
    filter.queues.as_ref().map(|qs| qs.iter().map(String::as_str).filter(|q| !paused.iter().any(|p| p == q)).collect())
}
