//! Standing grants: approvals a human created in advance, scoped (channel, agents,
//! recipient domains or webhook origins, minimum score), expiring and count-limited.
//!
//! Invariants:
//! - A grant is used only by a delivery in `awaiting_approval` (never `in_review`).
//! - Using a grant is one guarded `UPDATE … SET uses = uses + n WHERE uses + n <= max_uses`
//!   under a row lock, so racing workers can never overspend it.
//! - A grant's scope cannot change after creation (a trigger refuses it); it can only be
//!   used up, expire, or be revoked.

use airlock_core::error::{DomainError, ErrorKind};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};

use crate::artifact::{Artifact, Channel, origin_of};
use airlock_core::audit;
use airlock_core::ids::GrantId;
use airlock_core::principals::Principal;

/// The longest a grant may live.
pub const MAX_LIFETIME_DAYS: i64 = 366;
/// The most uses a grant may allow.
pub const MAX_USES: i32 = 1_000_000;

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Grant {
    pub id: GrantId,
    pub created_by: String,
    pub reason: String,
    pub channel: Channel,
    pub agent_ids: Vec<String>,
    pub recipient_domains: Vec<String>,
    pub webhook_origins: Vec<String>,
    pub min_score: f64,
    pub expires_at: DateTime<Utc>,
    pub max_uses: i32,
    pub uses: i32,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub revoked_by: Option<String>,
}

/// A grant as an operator asks for it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewGrant {
    pub channel: String,
    pub agent_ids: Vec<String>,
    #[serde(default)]
    pub recipient_domains: Vec<String>,
    #[serde(default)]
    pub webhook_origins: Vec<String>,
    pub min_score: f64,
    pub expires_at: DateTime<Utc>,
    pub max_uses: i32,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("{0}")]
    Invalid(String),
    #[error("grant not found")]
    NotFound,
    #[error("the grant is already revoked")]
    AlreadyRevoked,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for GrantError {
    fn kind(&self) -> ErrorKind {
        match self {
            GrantError::Invalid(_) => ErrorKind::Validation,
            GrantError::NotFound => ErrorKind::NotFound,
            GrantError::AlreadyRevoked => ErrorKind::InvalidTransition,
            GrantError::Db(_) => ErrorKind::Internal,
        }
    }
}

fn invalid(m: impl Into<String>) -> GrantError {
    GrantError::Invalid(m.into())
}

/// A checked grant request, normalised (lowercase domains, canonical origins).
#[derive(Debug, Clone)]
struct Checked {
    channel: Channel,
    agent_ids: Vec<String>,
    recipient_domains: Vec<String>,
    webhook_origins: Vec<String>,
}

impl NewGrant {
    fn check(&self, now: DateTime<Utc>) -> Result<Checked, GrantError> {
        let channel =
            Channel::parse(&self.channel).ok_or_else(|| invalid("channel: must be \"email\" or \"webhook\""))?;
        if self.agent_ids.is_empty() || self.agent_ids.len() > 100 {
            return Err(invalid("agent_ids: name 1 to 100 agents"));
        }
        let mut agent_ids = Vec::new();
        for a in &self.agent_ids {
            let a = a.trim();
            if a.is_empty() || a.len() > 200 || a.contains('*') {
                return Err(invalid("agent_ids: each is an agent id (no wildcards)"));
            }
            agent_ids.push(a.to_string());
        }
        if !(0.0..=1.0).contains(&self.min_score) {
            return Err(invalid("min_score: must be between 0 and 1"));
        }
        if self.expires_at <= now {
            return Err(invalid("expires_at: must be in the future"));
        }
        if self.expires_at > now + chrono::Duration::days(MAX_LIFETIME_DAYS) {
            return Err(invalid(format!("expires_at: at most {MAX_LIFETIME_DAYS} days ahead")));
        }
        if !(1..=MAX_USES).contains(&self.max_uses) {
            return Err(invalid(format!("max_uses: between 1 and {MAX_USES}")));
        }
        if self.reason.trim().is_empty() || self.reason.len() > 2000 {
            return Err(invalid("reason: 1 to 2000 characters are required"));
        }
        let (mut domains, mut origins) = (Vec::new(), Vec::new());
        match channel {
            Channel::Email => {
                if self.recipient_domains.is_empty() || !self.webhook_origins.is_empty() {
                    return Err(invalid("recipient_domains: an email grant names 1 or more domains, and no origins"));
                }
                for d in &self.recipient_domains {
                    let d = d.trim().trim_start_matches('@').to_ascii_lowercase();
                    let ok = !d.is_empty()
                        && d.len() <= 253
                        && d.contains('.')
                        && d.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
                    if !ok {
                        return Err(invalid(format!("recipient_domains: `{d}` is not a domain")));
                    }
                    domains.push(d);
                }
            }
            Channel::Webhook => {
                if self.webhook_origins.is_empty() || !self.recipient_domains.is_empty() {
                    return Err(invalid("webhook_origins: a webhook grant names 1 or more origins, and no domains"));
                }
                for o in &self.webhook_origins {
                    let norm = crate::policy::normalize_origin(o)
                        .ok_or_else(|| invalid(format!("webhook_origins: `{o}` is not an origin")))?;
                    origins.push(norm);
                }
            }
        }
        Ok(Checked { channel, agent_ids, recipient_domains: domains, webhook_origins: origins })
    }
}

/// Creates a grant (audited).
pub async fn create(tx: &mut Transaction<'_, Postgres>, who: &Principal, g: &NewGrant) -> Result<Grant, GrantError> {
    let c = g.check(Utc::now())?;
    let grant: Grant = sqlx::query_as(
        r#"INSERT INTO grants (id, created_by, reason, channel, agent_ids, recipient_domains, webhook_origins,
                               min_score, expires_at, max_uses)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING *"#,
    )
    .bind(GrantId::new())
    .bind(&who.name)
    .bind(g.reason.trim())
    .bind(c.channel)
    .bind(&c.agent_ids)
    .bind(&c.recipient_domains)
    .bind(&c.webhook_origins)
    .bind(g.min_score)
    .bind(g.expires_at)
    .bind(g.max_uses)
    .fetch_one(&mut **tx)
    .await?;
    audit::record(
        tx,
        who,
        audit::Action {
            action: "grant.create",
            target_kind: "grant",
            target_id: grant.id.to_string(),
            reason: Some(&grant.reason),
            data: json!({
                "channel": grant.channel, "agent_ids": grant.agent_ids, "recipient_domains": grant.recipient_domains,
                "webhook_origins": grant.webhook_origins, "min_score": grant.min_score,
                "expires_at": grant.expires_at, "max_uses": grant.max_uses,
            }),
        },
    )
    .await?;
    Ok(grant)
}

/// Revokes a grant at once (audited).
pub async fn revoke(
    tx: &mut Transaction<'_, Postgres>,
    who: &Principal,
    id: GrantId,
    reason: &str,
) -> Result<Grant, GrantError> {
    let current: Grant = sqlx::query_as("SELECT * FROM grants WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?
        .ok_or(GrantError::NotFound)?;
    if current.revoked_at.is_some() {
        return Err(GrantError::AlreadyRevoked);
    }
    let grant: Grant =
        sqlx::query_as("UPDATE grants SET revoked_at = now(), revoked_by = $2 WHERE id = $1 RETURNING *")
            .bind(id)
            .bind(&who.name)
            .fetch_one(&mut **tx)
            .await?;
    audit::record(
        tx,
        who,
        audit::Action {
            action: "grant.revoke",
            target_kind: "grant",
            target_id: id.to_string(),
            reason: Some(reason),
            data: json!({"uses": grant.uses}),
        },
    )
    .await?;
    Ok(grant)
}

/// Grants, newest first, before a cursor id.
pub async fn list(db: impl PgExecutor<'_>, before: Option<GrantId>, limit: i64) -> Result<Vec<Grant>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM grants WHERE ($1::uuid IS NULL OR id < $1) ORDER BY id DESC LIMIT $2")
        .bind(before)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// Uses one matching live grant for a delivery, if any: returns its id. Call inside the
/// transaction that approves the delivery, so the use and the approval commit together.
/// (The pipeline uses [`find_match`] and [`consume`] apart, to hold the grant's row lock
/// only for the end of its transaction.)
pub async fn try_use(
    tx: &mut Transaction<'_, Postgres>,
    agent: &str,
    artifact: &Artifact,
    score: f64,
) -> Result<Option<GrantId>, sqlx::Error> {
    let mut passed_over = Vec::new();
    while let Some(id) = find_match(&mut **tx, agent, artifact, score, &passed_over).await? {
        if consume(&mut **tx, id).await? {
            return Ok(Some(id));
        }
        passed_over.push(id);
    }
    Ok(None)
}

/// The live grant that would approve this delivery, if any (the one expiring first),
/// leaving out `passed_over`. Takes no lock: [`consume`] decides.
pub async fn find_match(
    db: impl PgExecutor<'_>,
    agent: &str,
    artifact: &Artifact,
    score: f64,
    passed_over: &[GrantId],
) -> Result<Option<GrantId>, sqlx::Error> {
    let (channel, domains, origin) = match artifact {
        Artifact::Email { email } => {
            let mut d: Vec<String> = email.recipients().map(|a| a.domain().to_ascii_lowercase()).collect();
            d.sort();
            d.dedup();
            (Channel::Email, d, None)
        }
        Artifact::Webhook { webhook } => (Channel::Webhook, Vec::new(), origin_of(&webhook.url)),
    };
    if channel == Channel::Webhook && origin.is_none() {
        return Ok(None);
    }
    sqlx::query_scalar(
        r#"SELECT id FROM grants
           WHERE revoked_at IS NULL AND expires_at > now() AND uses < max_uses
             AND channel = $1 AND $2 = ANY (agent_ids) AND min_score <= $3
             AND (($1 = 'email' AND recipient_domains @> $4::text[])
                  OR ($1 = 'webhook' AND $5 = ANY (webhook_origins)))
             AND id <> ALL ($6)
           ORDER BY expires_at, id
           LIMIT 1"#,
    )
    .bind(channel)
    .bind(agent)
    .bind(score)
    .bind(&domains)
    .bind(origin)
    .bind(passed_over)
    .fetch_optional(db)
    .await
}

/// Counts one use of a grant if it is still live and not used up; false otherwise. The row
/// lock it takes makes a racing user wait and then re-check, so `max_uses` is never
/// exceeded; call it last before the commit, as every other user of the grant waits.
pub async fn consume(db: impl PgExecutor<'_>, id: GrantId) -> Result<bool, sqlx::Error> {
    consume_many(db, id, 1).await
}

/// Counts `n` uses of a grant at once (deliveries approved together), all or none: false
/// when the grant is no longer live or has fewer than `n` uses left.
pub async fn consume_many(db: impl PgExecutor<'_>, id: GrantId, n: i32) -> Result<bool, sqlx::Error> {
    let used: Option<GrantId> = sqlx::query_scalar(
        r#"UPDATE grants SET uses = uses + $2
           WHERE id = $1 AND revoked_at IS NULL AND expires_at > now() AND uses + $2 <= max_uses
           RETURNING id"#,
    )
    .bind(id)
    .bind(n)
    .fetch_optional(db)
    .await?;
    Ok(used.is_some())
}

/// How many more uses a grant may give now (0 once it is revoked, expired or used up).
pub async fn uses_left(db: impl PgExecutor<'_>, id: GrantId) -> Result<i32, sqlx::Error> {
    let left: Option<i32> = sqlx::query_scalar(
        r#"SELECT CASE WHEN revoked_at IS NULL AND expires_at > now() THEN greatest(max_uses - uses, 0) ELSE 0 END
           FROM grants WHERE id = $1"#,
    )
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(left.unwrap_or(0))
}
