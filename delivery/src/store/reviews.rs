//! SQL of `reviews`: accepts, edits and rejections by humans.

use airlock_core::ids::DeliveryId;
use sqlx::PgExecutor;
use uuid::Uuid;

pub async fn insert_review(
    db: impl PgExecutor<'_>,
    delivery_id: DeliveryId,
    action: &str,
    reviewer: &str,
    note: Option<&str>,
    from_sha: &str,
    to_sha: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO reviews (id, delivery_id, action, reviewer, note, from_sha256, to_sha256)
           VALUES ($1, $2, $3, $4, $5, $6, $7)"#,
    )
    .bind(Uuid::now_v7())
    .bind(delivery_id)
    .bind(action)
    .bind(reviewer)
    .bind(note)
    .bind(from_sha)
    .bind(to_sha)
    .execute(db)
    .await?;
    Ok(())
}

/// Who produced an artifact version of a delivery by editing it, if anyone did.
pub async fn edited_by(
    db: impl PgExecutor<'_>,
    delivery_id: DeliveryId,
    sha: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT reviewer FROM reviews WHERE delivery_id = $1 AND action = 'edit' AND to_sha256 = $2
           ORDER BY created_at DESC, id DESC LIMIT 1"#,
    )
    .bind(delivery_id)
    .bind(sha)
    .fetch_optional(db)
    .await
}
