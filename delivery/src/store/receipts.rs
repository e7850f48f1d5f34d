//! SQL of `receipts`: a send with no receipt is not a success.

use airlock_core::ids::DeliveryId;
use airlock_queue::Lease;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use crate::artifact::Channel;

/// Transaction B's writes after sends that went out, in one statement: completes each job
/// held under its lease, records its receipt and closes its attempt with `detail`. Returns
/// the `(job, epoch)` of each lease that was held: only those are completed and recorded;
/// nothing is written for a lease that was lost.
pub async fn record_sent(
    db: impl PgExecutor<'_>,
    sent: &[(Lease, NewReceipt<'_>, &str)],
) -> Result<Vec<(airlock_core::ids::JobId, i32)>, sqlx::Error> {
    if sent.is_empty() {
        return Ok(Vec::new());
    }
    let leases: Vec<Lease> = sent.iter().map(|(l, _, _)| *l).collect();
    let mut qb = airlock_queue::piece::Builder::new("WITH ");
    airlock_queue::piece::complete(&mut qb, "done", &leases);
    qb.push(", sent AS (SELECT t.* FROM unnest(");
    qb.push_bind(leases.iter().map(|l| l.id()).collect::<Vec<_>>()).push("::uuid[], ");
    qb.push_bind(leases.iter().map(|l| l.attempt()).collect::<Vec<_>>()).push("::int4[], ");
    qb.push_bind(sent.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>()).push("::uuid[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.delivery_id).collect::<Vec<_>>()).push("::uuid[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.attempt_id).collect::<Vec<_>>()).push("::uuid[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.channel).collect::<Vec<_>>()).push("::channel[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.message_id.map(str::to_string)).collect::<Vec<_>>()).push("::text[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.provider_response.map(str::to_string)).collect::<Vec<_>>());
    qb.push("::text[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.payload_sha256.to_string()).collect::<Vec<_>>()).push("::text[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.attempt).collect::<Vec<_>>()).push("::int4[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.worker.map(str::to_string)).collect::<Vec<_>>()).push("::text[], ");
    qb.push_bind(sent.iter().map(|(_, r, _)| r.attested_by.map(str::to_string)).collect::<Vec<_>>());
    qb.push("::text[], ");
    qb.push_bind(sent.iter().map(|(_, _, d)| d.to_string()).collect::<Vec<_>>());
    qb.push(
        "::text[]) AS t (job_id, job_attempt, id, delivery_id, attempt_id, channel, message_id, \
                         provider_response, payload_sha256, attempt, worker, attested_by, detail) \
             JOIN done ON done.id = t.job_id AND done.attempt = t.job_attempt), \
         receipt AS ( \
             INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response, \
                                   payload_sha256, attempt, worker, attested_by) \
             SELECT id, delivery_id, attempt_id, channel, message_id, provider_response, payload_sha256, \
                    attempt, worker, attested_by FROM sent), \
         attempt AS ( \
             UPDATE send_attempts a SET outcome = 'sent', detail = sent.detail, finished_at = now() \
             FROM sent WHERE a.id = sent.attempt_id AND a.outcome IS NULL) \
         SELECT job_id, job_attempt FROM sent",
    );
    qb.build_query_as().fetch_all(db).await
}

#[derive(Debug, Clone, FromRow, Serialize, Deserialize)]
pub struct Receipt {
    pub channel: Channel,
    pub message_id: Option<String>,
    pub provider_response: Option<String>,
    pub payload_sha256: String,
    pub sent_at: DateTime<Utc>,
    pub attempt: i32,
    pub worker: Option<String>,
    pub attested_by: Option<String>,
}

/// What a receipt records.
#[derive(Debug, Clone)]
pub struct NewReceipt<'a> {
    pub delivery_id: DeliveryId,
    pub attempt_id: Option<Uuid>,
    pub channel: Channel,
    pub message_id: Option<&'a str>,
    pub provider_response: Option<&'a str>,
    pub payload_sha256: &'a str,
    pub attempt: i32,
    pub worker: Option<&'a str>,
    pub attested_by: Option<&'a str>,
}

pub async fn insert_receipt(db: impl PgExecutor<'_>, r: &NewReceipt<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response,
                                 payload_sha256, attempt, worker, attested_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"#,
    )
    .bind(Uuid::now_v7())
    .bind(r.delivery_id)
    .bind(r.attempt_id)
    .bind(r.channel)
    .bind(r.message_id)
    .bind(r.provider_response)
    .bind(r.payload_sha256)
    .bind(r.attempt)
    .bind(r.worker)
    .bind(r.attested_by)
    .execute(db)
    .await?;
    Ok(())
}
