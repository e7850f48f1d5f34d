//! Queue pauses: a paused queue is skipped by claims (running jobs go on); workers hear of
//! a pause or resume by NOTIFY and re-read the list at least every [`PAUSES_MAX_AGE`].

use std::time::Duration;

use sqlx::PgExecutor;

use crate::job::QueueError;
use crate::waker::NOTIFY_CHANNEL;

/// Payload prefix of the notification sent when a queue is paused or resumed (the rest is
/// the queue's name): workers that keep the paused queues between claims re-read them.
pub const PAUSE_NOTIFY_PREFIX: &str = "paused:";
/// How long a worker may claim with the paused queues it read last.
pub const PAUSES_MAX_AGE: Duration = Duration::from_secs(1);

/// Pauses a queue: workers stop claiming from it (running jobs go on) as soon as they hear
/// the notification, and within [`PAUSES_MAX_AGE`] if they miss it.
pub async fn pause_queue(db: impl PgExecutor<'_>, queue: &str, reason: &str) -> Result<(), QueueError> {
    sqlx::query(
        "WITH p AS (INSERT INTO queue_pauses (queue, reason) VALUES ($1, $2) ON CONFLICT (queue) DO NOTHING) \
         SELECT pg_notify($3, $4)",
    )
    .bind(queue)
    .bind(reason)
    .bind(NOTIFY_CHANNEL)
    .bind(format!("{PAUSE_NOTIFY_PREFIX}{queue}"))
    .execute(db)
    .await?;
    Ok(())
}

/// Resumes a paused queue and wakes workers.
pub async fn resume_queue(db: impl PgExecutor<'_>, queue: &str) -> Result<(), QueueError> {
    sqlx::query("WITH d AS (DELETE FROM queue_pauses WHERE queue = $1) SELECT pg_notify($2, $3)")
        .bind(queue)
        .bind(NOTIFY_CHANNEL)
        .bind(format!("{PAUSE_NOTIFY_PREFIX}{queue}"))
        .execute(db)
        .await?;
    Ok(())
}

/// The queues paused now.
pub async fn paused_queues(db: impl PgExecutor<'_>) -> Result<Vec<String>, QueueError> {
    Ok(sqlx::query_scalar("SELECT coalesce(array_agg(queue ORDER BY queue), '{}') FROM queue_pauses")
        .fetch_one(db)
        .await?)
}

/// A paused queue: since when and why.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct Pause {
    pub queue: String,
    pub paused_at: chrono::DateTime<chrono::Utc>,
    pub reason: String,
}

/// Every pause, by queue name.
pub async fn list_pauses(db: impl PgExecutor<'_>) -> Result<Vec<Pause>, QueueError> {
    Ok(sqlx::query_as("SELECT queue, paused_at, reason FROM queue_pauses ORDER BY queue").fetch_all(db).await?)
}
