//! SQL of `suppressions` (recipients nothing may be sent to) and `delivery_recipients`
//! (what the per-recipient limit counts).
//!
//! A change to the suppressions takes [`SUPPRESSIONS_LOCK`] exclusively; a submission and
//! transaction A of a send take it shared before they read them. So a suppression committed
//! before a send's transaction A is seen by it, and one made while it runs waits for it
//! (the send started before the suppression existed).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

/// Advisory lock key of the suppression list.
const SUPPRESSIONS_LOCK: i64 = 0x4149_524c_4f43_4b02;
/// Advisory lock class of one agent's submissions (the other key is the agent's hash).
const AGENT_LIMIT_CLASS: i32 = 0x4149_0001;
/// Advisory lock class of one recipient's submissions.
const RECIPIENT_LIMIT_CLASS: i32 = 0x4149_0002;

#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type, Serialize)]
#[sqlx(type_name = "suppression_kind", rename_all = "lowercase")]
#[serde(rename_all = "lowercase")]
pub enum SuppressionKind {
    Address,
    Domain,
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Suppression {
    pub id: Uuid,
    pub kind: SuppressionKind,
    pub value: String,
    pub reason: String,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub lifted_at: Option<DateTime<Utc>>,
    pub lifted_by: Option<String>,
}

/// Takes the suppression list's lock for reading, for the rest of the transaction.
pub async fn lock_suppressions_shared(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock_shared($1)").bind(SUPPRESSIONS_LOCK).execute(db).await?;
    Ok(())
}

/// Takes the suppression list's lock for a change, for the rest of the transaction.
pub async fn lock_suppressions(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(SUPPRESSIONS_LOCK).execute(db).await?;
    Ok(())
}

/// The live suppressions among `addresses` and `domains` (all lowercase).
pub async fn matching_suppressions(
    db: impl PgExecutor<'_>,
    addresses: &[String],
    domains: &[String],
) -> Result<Vec<Suppression>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT * FROM suppressions WHERE lifted_at IS NULL
             AND ((kind = 'address' AND value = ANY ($1)) OR (kind = 'domain' AND value = ANY ($2)))
           ORDER BY kind, value"#,
    )
    .bind(addresses)
    .bind(domains)
    .fetch_all(db)
    .await
}

/// Inserts a suppression, unless a live one of the same kind and value exists: `None` then.
pub async fn insert_suppression(
    db: impl PgExecutor<'_>,
    kind: SuppressionKind,
    value: &str,
    reason: &str,
    by: &str,
) -> Result<Option<Suppression>, sqlx::Error> {
    sqlx::query_as(
        r#"INSERT INTO suppressions (id, kind, value, reason, created_by) VALUES ($1, $2, $3, $4, $5)
           ON CONFLICT (kind, value) WHERE lifted_at IS NULL DO NOTHING RETURNING *"#,
    )
    .bind(Uuid::now_v7())
    .bind(kind)
    .bind(value)
    .bind(reason)
    .bind(by)
    .fetch_optional(db)
    .await
}

/// The live suppression of this kind and value, if any.
pub async fn find_live_suppression(
    db: impl PgExecutor<'_>,
    kind: SuppressionKind,
    value: &str,
) -> Result<Option<Suppression>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM suppressions WHERE kind = $1 AND value = $2 AND lifted_at IS NULL")
        .bind(kind)
        .bind(value)
        .fetch_optional(db)
        .await
}

/// Lifts a live suppression; `None` when there is no live one with this id.
pub async fn lift_suppression(db: impl PgExecutor<'_>, id: Uuid, by: &str) -> Result<Option<Suppression>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE suppressions SET lifted_at = now(), lifted_by = $2 WHERE id = $1 AND lifted_at IS NULL RETURNING *",
    )
    .bind(id)
    .bind(by)
    .fetch_optional(db)
    .await
}

pub async fn get_suppression(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<Suppression>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM suppressions WHERE id = $1").bind(id).fetch_optional(db).await
}

/// Suppressions newest first, before a cursor id; lifted ones only when asked for.
pub async fn list_suppressions(
    db: impl PgExecutor<'_>,
    include_lifted: bool,
    before: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Suppression>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT * FROM suppressions WHERE ($1 OR lifted_at IS NULL) AND ($2::uuid IS NULL OR id < $2)
           ORDER BY id DESC LIMIT $3"#,
    )
    .bind(include_lifted)
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Serialises the submissions of `agent` (and, with `recipients`, sorted and lowercase, of
/// each of them) until the transaction ends, so two racing submissions cannot both pass a
/// limit with one place left. The agent first, then the recipients in order: never a cycle.
pub async fn lock_submitters(
    db: &mut sqlx::PgConnection,
    agent: Option<&str>,
    recipients: &[String],
) -> Result<(), sqlx::Error> {
    if let Some(agent) = agent {
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .bind(AGENT_LIMIT_CLASS)
            .bind(agent)
            .execute(&mut *db)
            .await?;
    }
    if !recipients.is_empty() {
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext(r)) FROM unnest($2::text[]) WITH ORDINALITY AS u(r, n) ORDER BY n")
            .bind(RECIPIENT_LIMIT_CLASS)
            .bind(recipients)
            .execute(&mut *db)
            .await?;
    }
    Ok(())
}

/// When `agent` may submit again, if it has made `limit` submissions in the last hour:
/// the seconds until the oldest of the latest `limit` leaves the window.
pub async fn agent_window_full(db: impl PgExecutor<'_>, agent: &str, limit: u32) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT EXTRACT(EPOCH FROM (created_at + interval '1 hour' - now()))::float8 FROM deliveries
           WHERE agent = $1 AND created_at > now() - interval '1 hour'
           ORDER BY created_at DESC OFFSET $2 LIMIT 1"#,
    )
    .bind(agent)
    .bind(i64::from(limit) - 1)
    .fetch_optional(db)
    .await
}

/// Those of `addresses` that were sent `limit` emails in the last day, each with the
/// seconds until one of them leaves the window.
pub async fn recipients_window_full(
    db: impl PgExecutor<'_>,
    addresses: &[String],
    limit: u32,
) -> Result<Vec<(String, f64)>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT r.address, EXTRACT(EPOCH FROM (x.created_at + interval '1 day' - now()))::float8
           FROM unnest($1::text[]) AS r(address)
           CROSS JOIN LATERAL (SELECT d.created_at FROM delivery_recipients d
                               WHERE d.address = r.address AND d.created_at > now() - interval '1 day'
                               ORDER BY d.created_at DESC OFFSET $2 LIMIT 1) x
           ORDER BY r.address"#,
    )
    .bind(addresses)
    .bind(i64::from(limit) - 1)
    .fetch_all(db)
    .await
}
