//! SQL of `artifacts`: bodies stored once per content (sha256).

use sqlx::PgExecutor;

use crate::artifact::Artifact;

/// Stores an artifact (a no-op when the same content is stored already).
pub async fn put_artifact(db: impl PgExecutor<'_>, artifact: &Artifact) -> Result<String, sqlx::Error> {
    let sha = artifact.sha256_hex();
    let bytes = artifact.canonical_bytes();
    sqlx::query("INSERT INTO artifacts (sha256, body, size_bytes) VALUES ($1, $2, $3) ON CONFLICT (sha256) DO NOTHING")
        .bind(&sha)
        .bind(artifact.to_json())
        .bind(bytes.len() as i32)
        .execute(db)
        .await?;
    Ok(sha)
}

pub async fn get_artifact(db: impl PgExecutor<'_>, sha: &str) -> Result<Option<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT body FROM artifacts WHERE sha256 = $1").bind(sha).fetch_optional(db).await
}
