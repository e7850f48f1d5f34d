//! The `workers` table: one row per worker process, kept fresh by heartbeats, so that
//! operators can see the fleet and what each member holds.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct WorkerRow {
    pub id: String,
    pub host: String,
    pub pid: i32,
    pub version: String,
    pub queues: Option<Vec<String>>,
    pub concurrency: i32,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    pub in_flight: i32,
    pub stopped_at: Option<DateTime<Utc>>,
}

/// Registers a starting worker (a restarted process with the same id starts afresh).
pub async fn register(
    db: impl PgExecutor<'_>,
    id: &str,
    host: &str,
    queues: Option<&[String]>,
    concurrency: i32,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO workers (id, host, pid, version, queues, concurrency)
           VALUES ($1, $2, $3, $4, $5, $6)
           ON CONFLICT (id) DO UPDATE SET host = excluded.host, pid = excluded.pid,
               version = excluded.version, queues = excluded.queues, concurrency = excluded.concurrency,
               started_at = now(), heartbeat_at = now(), in_flight = 0, stopped_at = NULL"#,
    )
    .bind(id)
    .bind(host)
    .bind(std::process::id() as i32)
    .bind(env!("CARGO_PKG_VERSION"))
    .bind(queues)
    .bind(concurrency)
    .execute(db)
    .await?;
    Ok(())
}

pub async fn heartbeat(db: impl PgExecutor<'_>, id: &str, in_flight: i32) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE workers SET heartbeat_at = now(), in_flight = $2 WHERE id = $1")
        .bind(id)
        .bind(in_flight)
        .execute(db)
        .await?;
    Ok(())
}

pub async fn mark_stopped(db: impl PgExecutor<'_>, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE workers SET stopped_at = now(), in_flight = 0 WHERE id = $1").bind(id).execute(db).await?;
    Ok(())
}

/// Every worker, live ones first.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<WorkerRow>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM workers ORDER BY stopped_at IS NOT NULL, heartbeat_at DESC LIMIT 1000")
        .fetch_all(db)
        .await
}
