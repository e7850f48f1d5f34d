//! SQL of `scores`.

use airlock_core::ids::DeliveryId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

#[derive(Debug, Clone, FromRow, Serialize, Deserialize)]
pub struct ScoreRow {
    pub value: f64,
    pub reasons: serde_json::Value,
    pub scorer: String,
    pub threshold: f64,
    pub artifact_sha256: String,
    pub created_at: DateTime<Utc>,
}

pub async fn insert_score(
    db: impl PgExecutor<'_>,
    delivery_id: DeliveryId,
    artifact_sha256: &str,
    value: f64,
    reasons: &[String],
    scorer: &str,
    threshold: f64,
) -> Result<(), sqlx::Error> {
    let score = NewScore { delivery_id, artifact_sha256, value, reasons, scorer, threshold };
    insert_scores(db, std::slice::from_ref(&score)).await
}

/// One score to record.
#[derive(Debug, Clone)]
pub struct NewScore<'a> {
    pub delivery_id: DeliveryId,
    pub artifact_sha256: &'a str,
    pub value: f64,
    pub reasons: &'a [String],
    pub scorer: &'a str,
    pub threshold: f64,
}

/// Records several scores with one statement.
pub async fn insert_scores(db: impl PgExecutor<'_>, scores: &[NewScore<'_>]) -> Result<(), sqlx::Error> {
    if scores.is_empty() {
        return Ok(());
    }
    sqlx::query(
        r#"INSERT INTO scores (id, delivery_id, artifact_sha256, value, reasons, scorer, threshold)
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::float8[], $5::jsonb[], $6::text[],
                                $7::float8[])"#,
    )
    .bind(scores.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.delivery_id).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.artifact_sha256).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.value).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| serde_json::json!(s.reasons)).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.scorer).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.threshold).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(())
}
