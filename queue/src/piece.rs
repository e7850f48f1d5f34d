//! Typed parts of other crates' statements: where a transition of theirs must fence on, or
//! finish, a held job in the same round trip (one statement, one commit), it includes one
//! of these instead of writing SQL for `jobs`.
//!
//! Each function pushes one common table expression onto the caller's
//! [`sqlx::QueryBuilder`], binding its own values, so no parameter numbers have to agree
//! across crates; the caller joins the CTE by the name it gave and the columns documented
//! here. The pieces that write held jobs call the schema's functions over them
//! (`airlock_jobs_mark_effect_started`, `airlock_jobs_complete`), which lock the jobs in id
//! order first, as every statement over many held jobs does, so two of them cannot deadlock.

use sqlx::{Postgres, QueryBuilder};

use crate::job::NewJob;
use crate::lease::Lease;

/// The builder every piece pushes onto.
pub type Builder = QueryBuilder<Postgres>;

/// Pushes `cte AS (…)`: marks the effect of each job held under `leases` as started, if its
/// lease has not run out. Yields `(id, attempt)` for each job that was held; the others are
/// left untouched (their holders lost them). Join on both: a lease that was lost may name a
/// held job at another epoch. Nothing else of a held job may change its effect mark. The
/// statement must read the CTE (its function runs whole when it is first read).
pub fn mark_effect_started(qb: &mut Builder, cte: &str, leases: &[Lease]) {
    qb.push(cte).push(" AS (SELECT id, attempt FROM airlock_jobs_mark_effect_started(");
    push_leases(qb, leases);
    qb.push("))");
}

/// Pushes `cte AS (…)`: completes each job held under `leases` (moves it to the finished
/// jobs). Yields `(id, attempt)` for each job completed; the others (lost leases) are left
/// untouched. Join on both; the statement must read the CTE (its function runs whole when
/// it is first read). Like every completion of this process, it deletes the rows instead
/// while [`crate::set_delete_completed`] is on.
pub fn complete(qb: &mut Builder, cte: &str, leases: &[Lease]) {
    qb.push(cte).push(" AS (SELECT id, attempt FROM airlock_jobs_complete(");
    push_leases(qb, leases);
    qb.push(", ").push_bind(crate::lease::keeps_completed()).push("))");
}

/// Pushes `cte AS (…)`: inserts `jobs`, without a NOTIFY (wake the workers with a
/// [`crate::Waker`] after the commit), only if the CTE `guard` yields a row. A job whose
/// unique key a live job holds already, or an earlier job of `jobs` holds, is skipped.
/// Yields `(id)` of each job inserted.
pub fn enqueue_if(qb: &mut Builder, cte: &str, jobs: &[NewJob], guard: &str) {
    let jobs: Vec<&NewJob> = crate::enqueue::first_of_each_key(jobs).map(|(_, j)| j).collect();
    let ids: Vec<_> = jobs.iter().map(|_| airlock_core::ids::JobId::new()).collect();
    qb.push(cte).push(
        " AS (INSERT INTO jobs_live (id, kind, queue, payload, priority, run_at, max_attempts, effect_class, \
                                      unique_key, slot) \
         SELECT t.id, t.kind, t.queue, t.payload, t.priority, coalesce(t.run_at, now()), t.max_attempts, \
                t.effect_class, t.unique_key, (SELECT current FROM job_ring) \
         FROM unnest(",
    );
    qb.push_bind(ids).push("::uuid[], ");
    qb.push_bind(jobs.iter().map(|j| j.kind.clone()).collect::<Vec<_>>()).push("::text[], ");
    qb.push_bind(jobs.iter().map(|j| j.queue.clone()).collect::<Vec<_>>()).push("::text[], ");
    qb.push_bind(jobs.iter().map(|j| j.payload.clone()).collect::<Vec<_>>()).push("::jsonb[], ");
    qb.push_bind(jobs.iter().map(|j| j.priority).collect::<Vec<_>>()).push("::smallint[], ");
    qb.push_bind(jobs.iter().map(|j| j.run_at).collect::<Vec<_>>()).push("::timestamptz[], ");
    qb.push_bind(jobs.iter().map(|j| j.max_attempts).collect::<Vec<_>>()).push("::int[], ");
    qb.push_bind(jobs.iter().map(|j| j.effect_class).collect::<Vec<_>>()).push("::effect_class[], ");
    qb.push_bind(jobs.iter().map(|j| j.unique_key.clone()).collect::<Vec<_>>()).push("::text[]) ");
    qb.push(
        "AS t(id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key) \
         WHERE EXISTS (SELECT 1 FROM ",
    );
    qb.push(guard).push(") AND (t.unique_key IS NULL OR airlock_job_key_free(t.unique_key)) RETURNING id)");
}

/// Pushes a condition that holds while `lease` is held (the job `running` at that epoch):
/// for a statement of another table that must change nothing once its job's holder lost it.
pub fn push_is_held(qb: &mut Builder, lease: Lease) {
    qb.push("EXISTS (SELECT 1 FROM jobs WHERE jobs.id = ");
    qb.push_bind(lease.id);
    qb.push(" AND jobs.attempt = ");
    qb.push_bind(lease.attempt);
    qb.push(" AND jobs.state = 'running')");
}

/// The arrays of the leases' ids and attempts, as two bound arguments.
fn push_leases(qb: &mut Builder, leases: &[Lease]) {
    qb.push_bind(leases.iter().map(|l| l.id).collect::<Vec<_>>());
    qb.push("::uuid[], ");
    qb.push_bind(leases.iter().map(|l| l.attempt).collect::<Vec<_>>());
    qb.push("::int[]");
}
