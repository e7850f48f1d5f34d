//! SQL of `send_attempts`: an attempt is committed (outcome NULL) before its effect.

use airlock_core::ids::{DeliveryId, JobId};
use airlock_queue::Lease;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// One attempt to start: the delivery, the lease its send job is held under, the id the
/// attempt gets and the artifact it sends.
#[derive(Debug, Clone)]
pub struct NewAttempt<'a> {
    pub id: Uuid,
    pub delivery_id: DeliveryId,
    pub lease: Lease,
    pub artifact_sha256: &'a str,
}

/// Transaction A's writes for sends whose jobs are held under their leases, in one
/// statement: marks each job's effect as started (refused once its lease has run out) and
/// records its attempt. Returns the `(job, epoch)` of each lease that was held: only those
/// are marked and recorded; nothing is written for a lease that was lost.
pub async fn start_attempts(
    db: impl PgExecutor<'_>,
    worker: &str,
    attempts: &[NewAttempt<'_>],
) -> Result<Vec<(JobId, i32)>, sqlx::Error> {
    if attempts.is_empty() {
        return Ok(Vec::new());
    }
    let leases: Vec<Lease> = attempts.iter().map(|a| a.lease).collect();
    let mut qb = airlock_queue::piece::Builder::new("WITH ");
    airlock_queue::piece::mark_effect_started(&mut qb, "held", &leases);
    qb.push(
        " INSERT INTO send_attempts (id, delivery_id, job_id, lease_attempt, worker, artifact_sha256) \
          SELECT t.id, t.delivery_id, t.job_id, t.attempt, ",
    );
    qb.push_bind(worker.to_string());
    qb.push(", t.sha FROM unnest(");
    qb.push_bind(attempts.iter().map(|a| a.id).collect::<Vec<_>>());
    qb.push("::uuid[], ");
    qb.push_bind(attempts.iter().map(|a| a.delivery_id).collect::<Vec<_>>());
    qb.push("::uuid[], ");
    qb.push_bind(leases.iter().map(|l| l.id()).collect::<Vec<_>>());
    qb.push("::uuid[], ");
    qb.push_bind(leases.iter().map(|l| l.attempt()).collect::<Vec<_>>());
    qb.push("::int4[], ");
    qb.push_bind(attempts.iter().map(|a| a.artifact_sha256.to_string()).collect::<Vec<_>>());
    qb.push(
        "::text[]) AS t (id, delivery_id, job_id, attempt, sha) \
         JOIN held ON held.id = t.job_id AND held.attempt = t.attempt RETURNING job_id, lease_attempt",
    );
    qb.build_query_as().fetch_all(db).await
}

/// Sets the outcome of an attempt that has none yet.
pub async fn finish_attempt(
    db: impl PgExecutor<'_>,
    attempt_id: Uuid,
    outcome: &str,
    detail: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        r#"UPDATE send_attempts SET outcome = $2, detail = $3, finished_at = now()
           WHERE id = $1 AND outcome IS NULL"#,
    )
    .bind(attempt_id)
    .bind(outcome)
    .bind(detail)
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Closes every open attempt of a job (the rescuer, after its holder vanished).
pub async fn finish_open_attempts_of_job(
    db: impl PgExecutor<'_>,
    job_id: JobId,
    outcome: &str,
) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        r#"UPDATE send_attempts SET outcome = $2, detail = 'the worker lost its lease before recording an outcome',
               finished_at = now()
           WHERE job_id = $1 AND outcome IS NULL"#,
    )
    .bind(job_id)
    .bind(outcome)
    .execute(db)
    .await?;
    Ok(r.rows_affected())
}

#[derive(Debug, Clone, FromRow, Serialize, Deserialize)]
pub struct Attempt {
    pub id: Uuid,
    pub job_id: JobId,
    pub lease_attempt: i32,
    pub worker: String,
    pub artifact_sha256: String,
    pub started_at: DateTime<Utc>,
    pub outcome: Option<String>,
    pub detail: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
}

pub async fn attempts(db: impl PgExecutor<'_>, delivery_id: DeliveryId) -> Result<Vec<Attempt>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, job_id, lease_attempt, worker, artifact_sha256, started_at, outcome, detail, finished_at
           FROM send_attempts WHERE delivery_id = $1 ORDER BY started_at, id"#,
    )
    .bind(delivery_id)
    .fetch_all(db)
    .await
}
