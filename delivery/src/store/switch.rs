//! SQL of `settings`: the global send switch.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

/// The global send switch.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct SendSwitch {
    pub enabled: bool,
    pub updated_by: String,
    pub updated_at: DateTime<Utc>,
    pub reason: String,
}

pub async fn send_switch(db: impl PgExecutor<'_>) -> Result<SendSwitch, sqlx::Error> {
    sqlx::query_as("SELECT send_enabled AS enabled, updated_by, updated_at, reason FROM settings WHERE id = 1")
        .fetch_one(db)
        .await
}

/// Reads the switch with a share lock: a flip waits for this transaction, and this
/// transaction sees any flip committed before it.
pub async fn send_enabled_locked(db: impl PgExecutor<'_>) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT send_enabled FROM settings WHERE id = 1 FOR SHARE").fetch_one(db).await
}

pub async fn set_send_switch(
    db: impl PgExecutor<'_>,
    enabled: bool,
    by: &str,
    reason: &str,
) -> Result<SendSwitch, sqlx::Error> {
    sqlx::query_as(
        r#"UPDATE settings SET send_enabled = $1, updated_by = $2, reason = $3, updated_at = now() WHERE id = 1
           RETURNING send_enabled AS enabled, updated_by, updated_at, reason"#,
    )
    .bind(enabled)
    .bind(by)
    .bind(reason)
    .fetch_one(db)
    .await
}
