//! Principals: who holds a bearer token, and in which role.
//!
//! A token is 256 random bits, shown once at creation; the database keeps only its
//! sha256, so a leaked database does not leak working tokens. Lookup is by hash.

use base64::Engine;
use chrono::{DateTime, Utc};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use crate::secret::Secret;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "principal_role", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Agent,
    Reviewer,
    Operator,
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "agent" => Some(Role::Agent),
            "reviewer" => Some(Role::Reviewer),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Reviewer => "reviewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    /// Whether this role includes everything `other` may do (admin ⊇ operator ⊇
    /// reviewer; an agent includes only itself).
    pub fn at_least(self, other: Role) -> bool {
        let rank = |r: Role| match r {
            Role::Agent => 0,
            Role::Reviewer => 1,
            Role::Operator => 2,
            Role::Admin => 3,
        };
        match (self, other) {
            (Role::Agent, Role::Agent) => true,
            (Role::Agent, _) | (_, Role::Agent) => false,
            _ => rank(self) >= rank(other),
        }
    }
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Principal {
    pub id: Uuid,
    pub name: String,
    pub role: Role,
    pub agent_id: Option<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// When the token stops being accepted; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// The last time the token was accepted, to the minute.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// The columns of a [`Principal`], for `concat!` into static SQL.
macro_rules! columns {
    () => {
        "id, name, role, agent_id, created_at, revoked_at, expires_at, last_used_at"
    };
}

#[derive(Debug, thiserror::Error)]
pub enum PrincipalError {
    #[error("a principal named `{0}` exists already")]
    NameTaken(String),
    #[error("{0}")]
    Invalid(&'static str),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Prefix that makes airlock tokens recognisable (e.g. by secret scanners).
const TOKEN_PREFIX: &str = "alk_";

/// Makes a fresh random token.
pub fn generate_token() -> Secret {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    Secret::new(format!("{TOKEN_PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)))
}

fn token_hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// Creates a principal and returns it with its token (the only time the token exists
/// outside its holder).
pub async fn create(
    db: impl PgExecutor<'_>,
    name: &str,
    role: Role,
    agent_id: Option<&str>,
) -> Result<(Principal, Secret), PrincipalError> {
    create_expiring(db, name, role, agent_id, None).await
}

/// [`create`] with a token refused once `expires_in` has passed (`None`: never).
pub async fn create_expiring(
    db: impl PgExecutor<'_>,
    name: &str,
    role: Role,
    agent_id: Option<&str>,
    expires_in: Option<std::time::Duration>,
) -> Result<(Principal, Secret), PrincipalError> {
    let name = name.trim();
    let expires_in = match expires_in {
        None => None,
        Some(d) if d.is_zero() || d > MAX_EXPIRY => {
            return Err(PrincipalError::Invalid("an expiry must be more than 0 s and at most 10 years"));
        }
        Some(d) => Some(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
    };
    if name.is_empty() || name.len() > 200 {
        return Err(PrincipalError::Invalid("name must be 1 to 200 characters"));
    }
    if name.chars().any(|c| c.is_control() || crate::text::is_format(c)) {
        return Err(PrincipalError::Invalid(
            "name must not contain control characters or invisible or direction-changing format characters",
        ));
    }
    match (role, agent_id) {
        (Role::Agent, None) => return Err(PrincipalError::Invalid("an agent principal needs --agent AGENT_ID")),
        (Role::Agent, Some(a)) if a.trim().is_empty() || a.len() > 200 => {
            return Err(PrincipalError::Invalid("agent id must be 1 to 200 characters"));
        }
        (r, Some(_)) if r != Role::Agent => {
            return Err(PrincipalError::Invalid("only an agent principal is bound to an agent"));
        }
        _ => {}
    }
    let token = generate_token();
    let res = sqlx::query_as(concat!(
        "INSERT INTO principals (id, name, role, agent_id, token_sha256, expires_at)
             VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6::bigint / 1e6))
             RETURNING ",
        columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(name)
    .bind(role)
    .bind(agent_id)
    .bind(token_hash(token.expose()))
    .bind(expires_in)
    .fetch_one(db)
    .await;
    match res {
        Ok(p) => Ok((p, token)),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Err(PrincipalError::NameTaken(name.into())),
        Err(e) => Err(e.into()),
    }
}

/// The longest expiry a token may be given.
const MAX_EXPIRY: std::time::Duration = std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// Finds the live principal holding `token`, if any. A revoked token is refused from
/// the moment its revocation commits, an expiring one from its expiry (every request looks
/// it up). Records the use, at most once a minute per principal, in the same statement.
pub async fn authenticate(db: impl PgExecutor<'_>, token: &str) -> Result<Option<Principal>, sqlx::Error> {
    if !token.starts_with(TOKEN_PREFIX) || token.len() > 200 {
        return Ok(None);
    }
    let hash = token_hash(token);
    #[derive(FromRow)]
    struct Row {
        token_sha256: Vec<u8>,
        #[sqlx(flatten)]
        principal: Principal,
    }
    let row: Option<Row> = sqlx::query_as(concat!(
        "WITH live AS (
             SELECT token_sha256, ",
        columns!(),
        " FROM principals
             WHERE token_sha256 = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())),
         touched AS (
             UPDATE principals p SET last_used_at = now() FROM live
             WHERE p.id = live.id AND (p.last_used_at IS NULL OR p.last_used_at < now() - interval '1 minute'))
         SELECT * FROM live"
    ))
    .bind(&hash)
    .fetch_optional(db)
    .await?;
    // The index finds the row by hash; the final comparison does not leak timing.
    Ok(row.filter(|r| constant_time_eq(&r.token_sha256, &hash)).map(|r| r.principal))
}

/// Compares two byte strings in time that depends only on their length.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Every principal, oldest first (tokens are never shown again).
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<Principal>, sqlx::Error> {
    sqlx::query_as(concat!("SELECT ", columns!(), " FROM principals ORDER BY created_at, id")).fetch_all(db).await
}

/// Revokes a principal's token by name; true when it was live.
pub async fn revoke(db: impl PgExecutor<'_>, name: &str, by: &str) -> Result<bool, sqlx::Error> {
    let r =
        sqlx::query("UPDATE principals SET revoked_at = now(), revoked_by = $2 WHERE name = $1 AND revoked_at IS NULL")
            .bind(name)
            .bind(by)
            .execute(db)
            .await?;
    Ok(r.rows_affected() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_nest() {
        assert!(Role::Admin.at_least(Role::Operator));
        assert!(Role::Operator.at_least(Role::Reviewer));
        assert!(!Role::Reviewer.at_least(Role::Operator));
        assert!(!Role::Agent.at_least(Role::Reviewer));
        assert!(!Role::Admin.at_least(Role::Agent));
        assert!(Role::Agent.at_least(Role::Agent));
    }

    #[test]
    fn constant_time_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn tokens_are_distinct_and_long() {
        let a = generate_token();
        let b = generate_token();
        assert_ne!(a, b);
        assert!(a.expose().len() >= 40);
    }
}
