//! Enqueueing, in the caller's transaction, so a job commits with the row it serves.

use airlock_core::ids::JobId;
use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};

use crate::job::{EffectClass, Enqueued, NewJob, QueueError};
use crate::waker::NOTIFY_CHANNEL;

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
    let ids: Vec<JobId> = jobs.iter().map(|_| JobId::new()).collect();
    // A key twice in the batch: the first job is inserted (if no live job holds the key);
    // the others are told its id, as a later enqueue would be.
    let rows: Vec<(JobId, &NewJob)> = first_of_each_key(jobs).map(|(i, j)| (ids[i], j)).collect();
    let kinds: Vec<&str> = rows.iter().map(|(_, j)| j.kind.as_str()).collect();
    let queues: Vec<&str> = rows.iter().map(|(_, j)| j.queue.as_str()).collect();
    let payloads: Vec<&serde_json::Value> = rows.iter().map(|(_, j)| &j.payload).collect();
    let priorities: Vec<i16> = rows.iter().map(|(_, j)| j.priority).collect();
    let run_ats: Vec<Option<DateTime<Utc>>> = rows.iter().map(|(_, j)| j.run_at).collect();
    let max_attempts: Vec<i32> = rows.iter().map(|(_, j)| j.max_attempts).collect();
    let classes: Vec<EffectClass> = rows.iter().map(|(_, j)| j.effect_class).collect();
    let keys: Vec<Option<&str>> = rows.iter().map(|(_, j)| j.unique_key.as_deref()).collect();
    let row_ids: Vec<JobId> = rows.iter().map(|(i, _)| *i).collect();

    // Rows whose unique key a live job holds are skipped (see `airlock_job_key_free`, which
    // holds the key until the commit); the existing job is looked up afterwards in the same
    // transaction. The same statement sends one NOTIFY per queue that got a row, unless told
    // not to (`woke` is one row, so joining it keeps every inserted id).
    let inserted: Vec<JobId> = sqlx::query_scalar(
        r#"
        WITH inserted AS (
            INSERT INTO jobs_live (id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key,
                                   slot)
            SELECT id, kind, queue, payload, priority, coalesce(run_at, now()), max_attempts, effect_class, unique_key,
                   (SELECT current FROM job_ring)
            FROM unnest($1::uuid[], $2::text[], $3::text[], $4::jsonb[], $5::smallint[],
                        $6::timestamptz[], $7::int[], $8::effect_class[], $9::text[])
                 AS t(id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key)
            WHERE unique_key IS NULL OR airlock_job_key_free(unique_key)
            RETURNING id, queue),
        woke AS (SELECT count(pg_notify($10, queue)) FROM (SELECT DISTINCT queue FROM inserted) q WHERE $11)
        SELECT inserted.id FROM inserted CROSS JOIN woke
        "#,
    )
    .bind(&row_ids)
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
    let inserted: std::collections::HashSet<JobId> = inserted.into_iter().collect();
    for (id, job) in ids.iter().zip(jobs) {
        if inserted.contains(id) {
            out.push(Enqueued { id: *id, inserted: true });
        } else {
            let key = job.unique_key.as_deref().unwrap_or_default();
            let existing: JobId = sqlx::query_scalar(
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

/// The jobs of `jobs` to insert, with their places: every one without a unique key, and the
/// first of each key.
pub(crate) fn first_of_each_key(jobs: &[NewJob]) -> impl Iterator<Item = (usize, &NewJob)> {
    let mut seen = std::collections::HashSet::new();
    jobs.iter().enumerate().filter(move |(_, j)| j.unique_key.as_deref().is_none_or(|k| seen.insert(k)))
}
