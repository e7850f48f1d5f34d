//! Authorizations: a non-repeatable tool call the model asked for, held before it runs
//! until a human grants or denies that exact call.
//!
//! A grant names the sha256 of the canonical JSON of the arguments the human was shown
//! (computed as an artifact's hash is); any other hash is refused as stale, so what runs
//! is what was seen. Granted, the call runs once (it is an effect of the run, and a
//! non-repeatable effect is never started twice); denied, the model is told and the call
//! never runs. Either decision is audited with its note and sends the turn back to its queue.

use airlock_core::audit;
use airlock_core::ids::{AuthorizationId, RunId, TurnId};
use airlock_core::principals::Principal;
use airlock_delivery::artifact::canonical_sha256;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{FromRow, PgExecutor, PgPool, Postgres, Transaction};

use crate::error::TurnError;
use crate::turn::{self, TurnAction, TurnState};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "authorization_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum AuthorizationState {
    Pending,
    Granted,
    Denied,
}

impl AuthorizationState {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthorizationState::Pending => "pending",
            AuthorizationState::Granted => "granted",
            AuthorizationState::Denied => "denied",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Pending, Self::Granted, Self::Denied].into_iter().find(|a| a.as_str() == s)
    }
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Authorization {
    pub id: AuthorizationId,
    pub turn_id: TurnId,
    pub run_id: RunId,
    pub call_step: String,
    pub tool_id: String,
    pub arguments: Value,
    pub arguments_sha256: String,
    pub state: AuthorizationState,
    pub decided_by: Option<String>,
    pub note: Option<String>,
    pub created_at: DateTime<Utc>,
    pub decided_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, turn_id, run_id, call_step, tool_id, arguments, arguments_sha256, state, decided_by, note, \
     created_at, decided_at";

/// What the run waits on while authorization `id` is pending.
pub fn waiting_key(id: AuthorizationId) -> String {
    format!("authorization:{id}")
}

/// The hash a grant must carry: of the canonical JSON of `arguments`.
pub fn arguments_sha256(arguments: &Value) -> String {
    canonical_sha256(arguments)
}

/// The JSON shape of an authorization, as a turn and the admin list show it.
pub fn view(a: &Authorization) -> Value {
    json!({
        "id": a.id, "turn_id": a.turn_id, "run_id": a.run_id, "tool_id": a.tool_id, "arguments": a.arguments,
        "arguments_sha256": a.arguments_sha256, "state": a.state, "decided_by": a.decided_by, "note": a.note,
        "created_at": a.created_at, "decided_at": a.decided_at,
    })
}

/// The authorization of call `call_step` of a turn, if it was asked for.
pub async fn of_call(
    db: impl PgExecutor<'_>,
    turn_id: TurnId,
    call_step: &str,
) -> Result<Option<Authorization>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM turn_authorizations WHERE turn_id = $1 AND call_step = $2"
    )))
    .bind(turn_id)
    .bind(call_step)
    .fetch_optional(db)
    .await
}

/// The turn's latest authorization.
pub async fn latest_of(db: impl PgExecutor<'_>, turn_id: TurnId) -> Result<Option<Authorization>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM turn_authorizations WHERE turn_id = $1 ORDER BY created_at DESC, id DESC LIMIT 1"
    )))
    .bind(turn_id)
    .fetch_optional(db)
    .await
}

/// The id of the turn's pending authorization, if any.
pub async fn pending_of(db: impl PgExecutor<'_>, turn_id: TurnId) -> Result<Option<AuthorizationId>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM turn_authorizations WHERE turn_id = $1 AND state = 'pending'")
        .bind(turn_id)
        .fetch_optional(db)
        .await
}

/// Authorizations in `state`, oldest first, after `after` (a `(created_at, id)` cursor).
pub async fn list(
    db: impl PgExecutor<'_>,
    state: Option<AuthorizationState>,
    after: Option<(DateTime<Utc>, uuid::Uuid)>,
    limit: i64,
) -> Result<Vec<Authorization>, sqlx::Error> {
    let (at, id) = after.unzip();
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM turn_authorizations
         WHERE ($1::authorization_state IS NULL OR state = $1)
           AND ($2::timestamptz IS NULL OR (created_at, id) > ($2, $3))
         ORDER BY created_at, id LIMIT $4"
    )))
    .bind(state)
    .bind(at)
    .bind(id)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Asks a human about call `call_step` of the turn driven at `epoch`: the authorization,
/// the turn in `authorization_required` and its run waiting on it, in the caller's
/// transaction. Returns `None` when the driver no longer holds the turn.
#[allow(clippy::too_many_arguments)]
pub async fn request(
    tx: &mut Transaction<'_, Postgres>,
    turn_id: TurnId,
    run_id: RunId,
    epoch: i64,
    call_step: &str,
    tool_id: &str,
    arguments: &Value,
) -> Result<Option<Authorization>, sqlx::Error> {
    let moved = sqlx::query(
        "UPDATE agent_turns SET state = 'authorization_required', updated_at = now()
         WHERE id = $1 AND epoch = $2 AND state = 'running'",
    )
    .bind(turn_id)
    .bind(epoch)
    .execute(&mut **tx)
    .await?;
    if moved.rows_affected() == 0 {
        return Ok(None);
    }
    let id = AuthorizationId::new();
    let sha = arguments_sha256(arguments);
    let auth: Authorization = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO turn_authorizations (id, turn_id, run_id, call_step, tool_id, arguments, arguments_sha256)
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(turn_id)
    .bind(run_id)
    .bind(call_step)
    .bind(tool_id)
    .bind(arguments)
    .bind(&sha)
    .fetch_one(&mut **tx)
    .await?;
    airlock_runs::run::wait_on(tx, run_id, &waiting_key(id)).await?;
    turn::event(
        &mut **tx,
        turn_id,
        &format!("authorization:{call_step}"),
        "authorization_required",
        &json!({"authorization_id": id, "tool_id": tool_id, "arguments_sha256": sha}),
    )
    .await?;
    metrics::counter!(airlock_core::metrics::TURN_AUTHORIZATIONS, "state" => "pending").increment(1);
    Ok(Some(auth))
}

/// A human's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision<'a> {
    /// Allow the call whose arguments hash to this, once.
    Grant {
        arguments_sha256: &'a str,
    },
    Deny,
}

/// Decides a pending authorization: recorded with the human and their note, audited, the
/// run active again and the turn back in its queue (its driver runs the call, or tells the
/// model it was denied). A grant with another hash than the call's is refused, nothing
/// changed.
pub async fn decide(
    pool: &PgPool,
    who: &Principal,
    id: AuthorizationId,
    decision: Decision<'_>,
    note: &str,
) -> Result<Authorization, TurnError> {
    let note = airlock_core::text::human_note(Some(note), "note").map_err(TurnError::Invalid)?;
    if let Decision::Grant { arguments_sha256 } = decision
        && !(arguments_sha256.len() == 64 && arguments_sha256.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(TurnError::Invalid("arguments_sha256: the 64 hex digits of the call's arguments hash".into()));
    }
    let mut tx = pool.begin().await?;
    let auth: Authorization = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM turn_authorizations WHERE id = $1 FOR UPDATE"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or(TurnError::NotFound("authorization"))?;
    if auth.state != AuthorizationState::Pending {
        return Err(TurnError::InvalidTransition(format!("authorization {id} is {} already", auth.state.as_str())));
    }
    let turn = turn::lock(&mut tx, auth.turn_id).await?.ok_or(TurnError::NotFound("turn"))?;
    if turn::next(turn.state, TurnAction::Resume).is_none() {
        return Err(TurnError::InvalidTransition(format!(
            "turn {} is {}: nothing waits on this authorization",
            turn.id,
            turn.state.as_str()
        )));
    }
    let (state, action) = match decision {
        Decision::Grant { arguments_sha256 } => {
            if !arguments_sha256.eq_ignore_ascii_case(&auth.arguments_sha256) {
                return Err(TurnError::StaleArguments(format!(
                    "arguments_sha256 {arguments_sha256} is not the hash of this call's arguments: reload the authorization and check the arguments again"
                )));
            }
            (AuthorizationState::Granted, "authorization.grant")
        }
        Decision::Deny => (AuthorizationState::Denied, "authorization.deny"),
    };
    let auth: Authorization = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE turn_authorizations SET state = $2, decided_by = $3, note = $4, decided_at = now()
         WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(state)
    .bind(&who.name)
    .bind(note)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("UPDATE agent_turns SET state = 'queued', updated_at = now() WHERE id = $1")
        .bind(turn.id)
        .execute(&mut *tx)
        .await?;
    airlock_runs::run::resume(&mut tx, auth.run_id, &waiting_key(id)).await?;
    turn::event(
        &mut *tx,
        turn.id,
        &format!("decision:{}", auth.call_step),
        state.as_str(),
        &json!({"authorization_id": id, "by": who.name, "note": note}),
    )
    .await?;
    turn::enqueue(&mut tx, turn.id).await?;
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action,
            target_kind: "authorization",
            target_id: id.to_string(),
            reason: Some(note),
            data: json!({"turn_id": turn.id, "run_id": auth.run_id, "tool_id": auth.tool_id,
                         "arguments_sha256": auth.arguments_sha256}),
        },
    )
    .await?;
    tx.commit().await?;
    metrics::counter!(airlock_core::metrics::TURN_AUTHORIZATIONS, "state" => state.as_str()).increment(1);
    Ok(auth)
}

/// `POST /v1/turns/{id}/resume`: once the turn's authorization is decided, makes sure its
/// job is queued (a decision queues it already; this is for an agent that wants to be
/// sure). 409 while it is pending or when the turn has none.
pub async fn resume(pool: &PgPool, turn_id: TurnId, agent: &str) -> Result<(), TurnError> {
    let mut tx = pool.begin().await?;
    let turn = turn::lock(&mut tx, turn_id).await?.filter(|t| t.agent == agent).ok_or(TurnError::NotFound("turn"))?;
    let latest = latest_of(&mut *tx, turn_id).await?;
    let decided = latest.as_ref().is_some_and(|a| a.state != AuthorizationState::Pending);
    if !decided || turn.state.is_terminal() || turn.state == TurnState::AuthorizationRequired {
        return Err(TurnError::InvalidTransition(match latest {
            Some(a) if a.state == AuthorizationState::Pending => {
                format!("turn {turn_id} waits for authorization {}: a human grants or denies it first", a.id)
            }
            _ if turn.state.is_terminal() => format!("turn {turn_id} is {}", turn.state.as_str()),
            _ => format!("turn {turn_id} has no authorization to resume from"),
        }));
    }
    turn::enqueue(&mut tx, turn_id).await?;
    tx.commit().await?;
    Ok(())
}
