//! The audit log: every human and operator action, hash-chained so that a row altered or
//! removed afterwards breaks the chain.
//!
//! Appends are serialised by a transaction-scoped advisory lock, so the chain never forks.
//!
//! The chain alone cannot show that its newest entries were removed (what is left is still
//! a valid chain): [`head`] exports the newest entry to keep outside Postgres, and
//! [`verify_against`] checks the chain reaches that entry unchanged.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};

use crate::principals::Principal;

/// Advisory lock key of the audit chain.
const AUDIT_LOCK: i64 = 0x4149_524c_4f43_4b01;

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Entry {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub role: String,
    pub action: String,
    pub target_kind: String,
    pub target_id: String,
    pub reason: Option<String>,
    pub data: serde_json::Value,
    #[serde(skip)]
    pub prev_hash: Option<String>,
    pub hash: String,
}

/// One action to record.
#[derive(Debug, Clone)]
pub struct Action<'a> {
    pub action: &'a str,
    pub target_kind: &'a str,
    pub target_id: String,
    pub reason: Option<&'a str>,
    pub data: serde_json::Value,
}

fn entry_hash(prev: Option<&str>, at: &DateTime<Utc>, actor: &str, role: &str, a: &Action<'_>) -> String {
    let content = serde_json::json!({
        "prev": prev, "at": at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true), "actor": actor, "role": role,
        "action": a.action, "target_kind": a.target_kind, "target_id": a.target_id,
        "reason": a.reason, "data": a.data,
    });
    hex::encode(Sha256::digest(content.to_string().as_bytes()))
}

/// Appends an entry for `who` in the caller's transaction.
pub async fn record(tx: &mut Transaction<'_, Postgres>, who: &Principal, a: Action<'_>) -> Result<(), sqlx::Error> {
    record_as(tx, &who.name, who.role.as_str(), a).await
}

/// Appends an entry for a named actor (the CLI, the system).
pub async fn record_as(
    tx: &mut Transaction<'_, Postgres>,
    actor: &str,
    role: &str,
    a: Action<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(AUDIT_LOCK).execute(&mut **tx).await?;
    let prev: Option<String> =
        sqlx::query_scalar("SELECT hash FROM audit_log ORDER BY id DESC LIMIT 1").fetch_optional(&mut **tx).await?;
    // Microsecond precision: what Postgres stores is what the hash covers.
    let at: DateTime<Utc> =
        sqlx::query_scalar("SELECT date_trunc('microseconds', clock_timestamp())").fetch_one(&mut **tx).await?;
    let hash = entry_hash(prev.as_deref(), &at, actor, role, &a);
    sqlx::query(
        r#"INSERT INTO audit_log (at, actor, role, action, target_kind, target_id, reason, data, prev_hash, hash)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"#,
    )
    .bind(at)
    .bind(actor)
    .bind(role)
    .bind(a.action)
    .bind(a.target_kind)
    .bind(&a.target_id)
    .bind(a.reason)
    .bind(&a.data)
    .bind(prev)
    .bind(hash)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Newest first, before the cursor id, of one action only when `action` names it.
pub async fn list(
    db: impl PgExecutor<'_>,
    action: Option<&str>,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<Entry>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT * FROM audit_log WHERE ($1::bigint IS NULL OR id < $1) AND ($3::text IS NULL OR action = $3)
           ORDER BY id DESC LIMIT $2"#,
    )
    .bind(before)
    .bind(limit)
    .bind(action)
    .fetch_all(db)
    .await
}

/// Recomputes the whole chain; returns the id of the first entry that does not verify.
pub async fn verify(db: impl PgExecutor<'_>) -> Result<Option<i64>, sqlx::Error> {
    let rows: Vec<Entry> = sqlx::query_as("SELECT * FROM audit_log ORDER BY id").fetch_all(db).await?;
    let mut prev: Option<String> = None;
    for e in rows {
        let a = Action {
            action: &e.action,
            target_kind: &e.target_kind,
            target_id: e.target_id.clone(),
            reason: e.reason.as_deref(),
            data: e.data.clone(),
        };
        let expect = entry_hash(prev.as_deref(), &e.at, &e.actor, &e.role, &a);
        if e.prev_hash != prev || e.hash != expect {
            return Ok(Some(e.id));
        }
        prev = Some(e.hash);
    }
    Ok(None)
}

/// The newest entry of the chain, as exported to be kept outside the database
/// (`airlock-admin audit export-head`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Head {
    /// The newest entry's id.
    pub id: i64,
    /// Its hash: the whole chain up to it.
    pub hash: String,
    /// How many entries the chain had up to it.
    pub entries: i64,
    /// When it was exported.
    pub exported_at: DateTime<Utc>,
}

/// The head of the chain now; `None` when the log is empty.
pub async fn head(db: impl PgExecutor<'_>) -> Result<Option<Head>, sqlx::Error> {
    #[derive(FromRow)]
    struct Row {
        id: i64,
        hash: String,
        entries: i64,
        exported_at: DateTime<Utc>,
    }
    let row: Option<Row> = sqlx::query_as(
        r#"SELECT id, hash, (SELECT count(*) FROM audit_log) AS entries, now() AS exported_at
           FROM audit_log ORDER BY id DESC LIMIT 1"#,
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|r| Head { id: r.id, hash: r.hash, entries: r.entries, exported_at: r.exported_at }))
}

/// What is wrong with the log, if anything.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Broken {
    #[error("audit entry {0} does not match the chain")]
    Chain(i64),
    #[error("the exported head, entry {0}, is not in the log: entries were removed")]
    HeadMissing(i64),
    #[error("audit entry {0} is not the exported head: it was altered")]
    HeadAltered(i64),
    #[error("the log has {found} entries up to the exported head, which counted {expected}")]
    Count { expected: i64, found: i64 },
}

/// [`verify`], and, with an exported `head`, that the chain still reaches it: the entry is
/// there with the same hash and as many entries before it. Entries newer than the head are
/// checked by the chain alone.
pub async fn verify_against(pool: &sqlx::PgPool, head: Option<&Head>) -> Result<Result<(), Broken>, sqlx::Error> {
    if let Some(id) = verify(pool).await? {
        return Ok(Err(Broken::Chain(id)));
    }
    let Some(h) = head else { return Ok(Ok(())) };
    let found: Option<String> =
        sqlx::query_scalar("SELECT hash FROM audit_log WHERE id = $1").bind(h.id).fetch_optional(pool).await?;
    match found {
        None => return Ok(Err(Broken::HeadMissing(h.id))),
        Some(hash) if hash != h.hash => return Ok(Err(Broken::HeadAltered(h.id))),
        Some(_) => {}
    }
    let count: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE id <= $1").bind(h.id).fetch_one(pool).await?;
    if count != h.entries {
        return Ok(Err(Broken::Count { expected: h.entries, found: count }));
    }
    Ok(Ok(()))
}
