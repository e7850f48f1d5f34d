//! SQL of `approvals`: by a human bound to an artifact hash, or by a standing grant.

use airlock_core::ids::{DeliveryId, GrantId};
use sqlx::PgExecutor;
use uuid::Uuid;

pub async fn insert_approval(
    db: impl PgExecutor<'_>,
    delivery_id: DeliveryId,
    artifact_sha256: &str,
    approver: Option<&str>,
    grant_id: Option<GrantId>,
    note: Option<&str>,
) -> Result<(), sqlx::Error> {
    let approval = NewApproval { delivery_id, artifact_sha256, approver, grant_id, note };
    insert_approvals(db, std::slice::from_ref(&approval)).await
}

/// One approval to record: by a human (`approver`) or a standing grant (`grant_id`).
#[derive(Debug, Clone)]
pub struct NewApproval<'a> {
    pub delivery_id: DeliveryId,
    pub artifact_sha256: &'a str,
    pub approver: Option<&'a str>,
    pub grant_id: Option<GrantId>,
    pub note: Option<&'a str>,
}

/// Records several approvals with one statement.
pub async fn insert_approvals(db: impl PgExecutor<'_>, approvals: &[NewApproval<'_>]) -> Result<(), sqlx::Error> {
    if approvals.is_empty() {
        return Ok(());
    }
    sqlx::query(
        r#"INSERT INTO approvals (id, delivery_id, artifact_sha256, approver, grant_id, note)
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::uuid[], $6::text[])"#,
    )
    .bind(approvals.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.delivery_id).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.artifact_sha256).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.approver).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.grant_id).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.note).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(())
}
