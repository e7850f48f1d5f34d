//! The `agents` table: which node holds each agent, at which epoch, and the epoch
//! allocator that gives every migration a fresh epoch.
//!
//! Every change is a guarded UPDATE naming the expected state; no row matching is a typed
//! error, never a silent overwrite.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

use airlock_core::error::{DomainError, ErrorKind};

use super::AgentId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, sqlx::Type)]
#[sqlx(type_name = "agent_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum AgentState {
    /// Only in the capsule store; no node runs it.
    Stored,
    /// Its holder node runs it.
    Active,
    /// A migration owns it.
    Migrating,
}

/// What moves an agent between its states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AgentAction {
    /// A capsule imported as a new agent, or as a newer epoch of a stored one.
    Import,
    /// A relocation takes it (a fresh epoch is allocated).
    Relocate,
    /// The relocation moved it: its new holder runs it.
    Arrive,
    /// The relocation did not move it, and it had no holder: back to the store.
    ReturnToStore,
    /// The relocation did not move it: back to the holder it had.
    ReturnToHolder,
}

impl AgentAction {
    pub const ALL: [AgentAction; 5] = [
        AgentAction::Import,
        AgentAction::Relocate,
        AgentAction::Arrive,
        AgentAction::ReturnToStore,
        AgentAction::ReturnToHolder,
    ];
}

/// The one table of an agent's legal moves (the guarded statements below make exactly
/// these). An agent a node runs, or one being relocated, is never imported over: that
/// would make two copies.
pub fn next(from: AgentState, action: AgentAction) -> Option<AgentState> {
    use AgentAction as A;
    use AgentState as S;
    match (from, action) {
        (S::Stored, A::Import) => Some(S::Stored),
        (S::Stored | S::Active, A::Relocate) => Some(S::Migrating),
        (S::Migrating, A::Arrive) => Some(S::Active),
        (S::Migrating, A::ReturnToStore) => Some(S::Stored),
        (S::Migrating, A::ReturnToHolder) => Some(S::Active),
        _ => None,
    }
}

impl AgentState {
    pub const ALL: [AgentState; 3] = [AgentState::Stored, AgentState::Active, AgentState::Migrating];

    pub fn as_str(self) -> &'static str {
        match self {
            AgentState::Stored => "stored",
            AgentState::Active => "active",
            AgentState::Migrating => "migrating",
        }
    }
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Agent {
    pub id: String,
    pub holder: Option<String>,
    pub epoch: i64,
    pub max_epoch: i64,
    pub state: AgentState,
    pub manifest_sha256: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The trusted key that signed the imported capsule.
    pub import_signed_by: Option<String>,
    /// Imported without a trusted signature, by the operator's `--allow-unsigned`.
    pub import_unsigned: Option<bool>,
}

impl Agent {
    /// Why the agent may not be placed on a node from the store with `trusted_keys` as
    /// they are now, if it may not: its import must have been signed by a key still
    /// trusted, or allowed unsigned by the operator.
    pub fn untrusted_import(&self, trusted_keys: &[String]) -> Option<String> {
        match (&self.import_signed_by, self.import_unsigned) {
            (_, Some(true)) => None,
            (Some(key), _) if trusted_keys.iter().any(|k| k.eq_ignore_ascii_case(key)) => None,
            (Some(key), _) => Some(format!(
                "agent {} was imported signed by key {key}, which capsules.trusted_keys no longer holds; \
                 import it again signed by a trusted key, or with --allow-unsigned",
                self.id
            )),
            (None, _) => Some(format!(
                "agent {}'s import recorded no trusted signature; import it again signed by a key of \
                 capsules.trusted_keys, or with --allow-unsigned",
                self.id
            )),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent {0} not found")]
    NotFound(String),
    #[error("{0}")]
    InvalidTransition(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for AgentError {
    fn kind(&self) -> ErrorKind {
        match self {
            AgentError::NotFound(_) => ErrorKind::NotFound,
            AgentError::InvalidTransition(_) => ErrorKind::InvalidTransition,
            AgentError::Db(_) => ErrorKind::Internal,
        }
    }
}

pub async fn get(db: impl PgExecutor<'_>, id: &AgentId) -> Result<Option<Agent>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM agents WHERE id = $1").bind(id.as_str()).fetch_optional(db).await
}

/// Records an imported capsule: a new agent, or a newer epoch of a stored one. An agent
/// that a node runs (or that is migrating) is refused: importing it would make two copies.
pub async fn record_import(
    db: impl PgExecutor<'_>,
    id: &AgentId,
    epoch: i64,
    manifest_sha256: &str,
    signed_by: Option<&str>,
) -> Result<Agent, AgentError> {
    let row: Option<Agent> = sqlx::query_as(
        r#"INSERT INTO agents (id, holder, epoch, max_epoch, state, manifest_sha256, import_signed_by, import_unsigned)
           VALUES ($1, NULL, $2, $2, 'stored', $3, $4, $4 IS NULL)
           ON CONFLICT (id) DO UPDATE SET epoch = $2, max_epoch = $2, manifest_sha256 = $3, updated_at = now(),
                   import_signed_by = $4, import_unsigned = $4 IS NULL
               WHERE agents.state = 'stored' AND agents.max_epoch < $2
           RETURNING *"#,
    )
    .bind(id.as_str())
    .bind(epoch)
    .bind(manifest_sha256)
    .bind(signed_by.map(str::to_ascii_lowercase))
    .fetch_optional(db)
    .await?;
    row.ok_or_else(|| {
        AgentError::InvalidTransition(format!(
            "agent {id} exists with an epoch at least {epoch}, or runs on a node: import a newer epoch of a stored agent"
        ))
    })
}

/// Takes the agent for a migration: `stored|active` → `migrating`, allocating a fresh
/// epoch. Returns the row as it is now (`epoch` the source's, `max_epoch` the new one).
pub async fn begin_migration(db: impl PgExecutor<'_>, id: &AgentId) -> Result<Agent, AgentError> {
    let row: Option<Agent> = sqlx::query_as(
        r#"UPDATE agents SET state = 'migrating', max_epoch = max_epoch + 1, updated_at = now()
           WHERE id = $1 AND state IN ('stored', 'active') RETURNING *"#,
    )
    .bind(id.as_str())
    .fetch_optional(db)
    .await?;
    row.ok_or_else(|| AgentError::InvalidTransition(format!("agent {id} is missing or already migrating")))
}

/// Ends a migration that moved the agent: `migrating` → `active` on its new holder.
pub async fn finish_migration(
    db: impl PgExecutor<'_>,
    id: &AgentId,
    holder: &str,
    epoch: i64,
    manifest_sha256: Option<&str>,
) -> Result<(), AgentError> {
    let r = sqlx::query(
        r#"UPDATE agents SET state = 'active', holder = $2, epoch = $3,
               manifest_sha256 = coalesce($4, manifest_sha256), updated_at = now()
           WHERE id = $1 AND state = 'migrating' AND max_epoch >= $3 AND epoch < $3"#,
    )
    .bind(id.as_str())
    .bind(holder)
    .bind(epoch)
    .bind(manifest_sha256)
    .execute(db)
    .await?;
    if r.rows_affected() == 0 {
        return Err(AgentError::InvalidTransition(format!("agent {id} is not migrating to epoch {epoch}")));
    }
    Ok(())
}

/// Ends a migration that did not move the agent: back to where it was.
pub async fn abort_migration(db: impl PgExecutor<'_>, id: &AgentId) -> Result<(), AgentError> {
    let r = sqlx::query(
        r#"UPDATE agents SET state = CASE WHEN holder IS NULL THEN 'stored'::agent_state ELSE 'active'::agent_state END,
               updated_at = now()
           WHERE id = $1 AND state = 'migrating'"#,
    )
    .bind(id.as_str())
    .execute(db)
    .await?;
    if r.rows_affected() == 0 {
        return Err(AgentError::InvalidTransition(format!("agent {id} is not migrating")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_table() {
        use AgentAction as A;
        use AgentState as S;
        let expected = [
            (S::Stored, A::Import, S::Stored),
            (S::Stored, A::Relocate, S::Migrating),
            (S::Active, A::Relocate, S::Migrating),
            (S::Migrating, A::Arrive, S::Active),
            (S::Migrating, A::ReturnToStore, S::Stored),
            (S::Migrating, A::ReturnToHolder, S::Active),
        ];
        for from in S::ALL {
            for action in A::ALL {
                let want = expected.iter().find(|(f, a, _)| *f == from && *a == action).map(|(_, _, to)| *to);
                assert_eq!(next(from, action), want, "{from:?} by {action:?}");
            }
        }
    }
}
