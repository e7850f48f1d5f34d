//! The `agent_turns` table: a turn's request, its state, what it went through
//! (`turn_events`), and the one table of legal moves.
//!
//! A turn is asked for inside a run (`POST /v1/runs/{id}/turns`), keyed by the run's
//! `step_id`: asking again returns the same turn. Its `agent.turn` job drives it
//! ([`crate::engine`]); each execution claims the run, and every write of the turn names the
//! run epoch its driver holds (`epoch`), so a driver that lost its job changes nothing.

use airlock_core::config::Config;
use airlock_core::config::agent::AgentConfig;
use airlock_core::ids::{DeliveryId, RunId, TurnId};
use airlock_delivery::artifact::Artifact;
use airlock_queue::NewJob;
use airlock_runs::RunState;
use airlock_runs::steps::check_step_id;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, PgPool, Postgres, Transaction};

use crate::catalogue::Catalogue;
use crate::error::TurnError;

/// The job kind that drives a turn.
pub const TURN_JOB: &str = "agent.turn";
/// The longest `step_id` of a turn: its rounds' steps are named under it.
pub const MAX_STEP_ID_CHARS: usize = 160;
/// The longest `instructions` of a turn, in bytes.
pub const MAX_INSTRUCTIONS_BYTES: usize = 32 * 1024;
/// The most tools one turn may be given.
pub const MAX_TOOLS: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "turn_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum TurnState {
    Queued,
    Running,
    AuthorizationRequired,
    Completed,
    Failed,
    Cancelled,
    ModelUnavailable,
    ModelProtocolError,
    BudgetExhausted,
}

impl TurnState {
    pub const ALL: [TurnState; 9] = [
        TurnState::Queued,
        TurnState::Running,
        TurnState::AuthorizationRequired,
        TurnState::Completed,
        TurnState::Failed,
        TurnState::Cancelled,
        TurnState::ModelUnavailable,
        TurnState::ModelProtocolError,
        TurnState::BudgetExhausted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Queued => "queued",
            TurnState::Running => "running",
            TurnState::AuthorizationRequired => "authorization_required",
            TurnState::Completed => "completed",
            TurnState::Failed => "failed",
            TurnState::Cancelled => "cancelled",
            TurnState::ModelUnavailable => "model_unavailable",
            TurnState::ModelProtocolError => "model_protocol_error",
            TurnState::BudgetExhausted => "budget_exhausted",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        !matches!(self, TurnState::Queued | TurnState::Running | TurnState::AuthorizationRequired)
    }
}

/// What moves a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnAction {
    /// A driver took it up.
    Start,
    /// A non-repeatable call waits for a human.
    Pause,
    /// A human decided the call: the turn goes back to its queue.
    Resume,
    /// It ended: with the final text, or one of the ways a turn fails.
    End(TurnState),
    /// Its agent cancelled it (or its run ended).
    Cancel,
}

/// The state `action` moves a turn in `from` to, if the move is legal.
pub fn next(from: TurnState, action: TurnAction) -> Option<TurnState> {
    use TurnAction as A;
    use TurnState as S;
    match (from, action) {
        (S::Queued | S::Running, A::Start) => Some(S::Running),
        (S::Running, A::Pause) => Some(S::AuthorizationRequired),
        (S::AuthorizationRequired, A::Resume) => Some(S::Queued),
        (S::Queued | S::Running, A::End(to)) if to.is_terminal() && to != S::Cancelled => Some(to),
        (S::Queued | S::Running | S::AuthorizationRequired, A::Cancel) => Some(S::Cancelled),
        _ => None,
    }
}

/// A turn's limits, within the configured ceilings (`agent.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_rounds: u32,
    pub max_tool_calls: u32,
    pub max_context_bytes: usize,
    pub max_result_bytes: usize,
}

impl Limits {
    /// The limits asked for (`{"max_rounds", "max_tool_calls", "max_context_bytes",
    /// "max_result_bytes"}`, each optional, 0 or absent for the ceiling), each within its
    /// ceiling.
    pub fn within(ceilings: &AgentConfig, asked: Option<&Value>) -> Result<Self, TurnError> {
        let empty = Map::new();
        let asked = match asked {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(_) => return Err(TurnError::Invalid("limits: must be an object".into())),
        };
        const KEYS: [&str; 4] = ["max_rounds", "max_tool_calls", "max_context_bytes", "max_result_bytes"];
        if let Some(k) = asked.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(TurnError::Invalid(format!("limits.{k}: unknown field")));
        }
        let within = |key: &str, ceiling: u64| -> Result<u64, TurnError> {
            match asked.get(key) {
                None | Some(Value::Null) => Ok(ceiling),
                Some(v) => match v.as_u64() {
                    Some(0) => Ok(ceiling),
                    Some(n) if n <= ceiling => Ok(n),
                    Some(n) => Err(TurnError::Invalid(format!(
                        "limits.{key}: {n} is above the ceiling of {ceiling} (agent.{key}); ask for at most {ceiling}, or 0"
                    ))),
                    None => {
                        Err(TurnError::Invalid(format!("limits.{key}: must be 0 (the ceiling) or a positive integer")))
                    }
                },
            }
        };
        Ok(Self {
            max_rounds: within("max_rounds", ceilings.max_rounds.into())? as u32,
            max_tool_calls: within("max_tool_calls", ceilings.max_tool_calls.into())? as u32,
            max_context_bytes: within("max_context_bytes", ceilings.max_context_bytes as u64)? as usize,
            max_result_bytes: within("max_result_bytes", ceilings.max_result_bytes as u64)? as usize,
        })
    }
}

/// A turn as stored.
#[derive(Debug, Clone, FromRow)]
pub struct Turn {
    pub id: TurnId,
    pub run_id: RunId,
    pub step_id: String,
    pub agent: String,
    pub model: String,
    pub instructions: String,
    pub input: String,
    pub tools: Vec<String>,
    pub limits: Json<Limits>,
    pub deliver: Option<Value>,
    pub state: TurnState,
    pub rounds: i32,
    pub tool_calls: i32,
    pub final_text: Option<String>,
    pub delivery_id: Option<DeliveryId>,
    pub error: Option<Value>,
    pub epoch: i64,
    /// The token that asked for the turn (the tasks it starts are asked by it).
    pub principal_id: Option<uuid::Uuid>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, run_id, step_id, agent, model, instructions, input, tools, limits, deliver, state, rounds, \
     tool_calls, final_text, delivery_id, error, epoch, principal_id, created_at, updated_at, finished_at";

/// A checked request for a turn.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTurn {
    pub step_id: String,
    pub model: String,
    pub instructions: String,
    pub input: String,
    pub tools: Vec<String>,
    pub limits: Limits,
    pub deliver: Option<Value>,
}

impl NewTurn {
    /// Parses and checks `POST /v1/runs/{id}/turns`: a configured model, configured tools,
    /// limits within the ceilings, a `deliver` that makes a valid email once it has a body.
    /// Anything else is refused, naming the field, with nothing written.
    pub fn parse(body: &Value, cfg: &Config, catalogue: &Catalogue) -> Result<Self, TurnError> {
        let invalid = |m: String| TurnError::Invalid(m);
        let map = body.as_object().ok_or_else(|| invalid("body must be a JSON object".into()))?;
        const KEYS: [&str; 7] = ["step_id", "model", "instructions", "input", "tools", "limits", "deliver"];
        if let Some(k) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(invalid(format!("{k}: unknown field")));
        }
        let text = |key: &str, required: bool| -> Result<String, TurnError> {
            match map.get(key) {
                Some(Value::String(s)) => Ok(s.clone()),
                None | Some(Value::Null) if !required => Ok(String::new()),
                None | Some(Value::Null) => Err(invalid(format!("{key}: is required"))),
                Some(_) => Err(invalid(format!("{key}: must be a string"))),
            }
        };
        let step_id = text("step_id", true)?;
        check_step_id(&step_id)?;
        if step_id.chars().count() > MAX_STEP_ID_CHARS {
            return Err(invalid(format!("step_id: at most {MAX_STEP_ID_CHARS} characters for a turn")));
        }
        let model = text("model", true)?;
        if !cfg.models.contains_key(&model) {
            let known: Vec<&str> = cfg.models.keys().map(String::as_str).collect();
            return Err(invalid(format!("model: `{model}` is not a configured model (models.<name>: {known:?})")));
        }
        let instructions = text("instructions", false)?;
        if instructions.len() > MAX_INSTRUCTIONS_BYTES {
            return Err(invalid(format!("instructions: at most {MAX_INSTRUCTIONS_BYTES} bytes")));
        }
        let input = text("input", true)?;
        if input.trim().is_empty() {
            return Err(invalid("input: must not be empty".into()));
        }
        let limits = Limits::within(&cfg.agent, map.get("limits"))?;
        if input.len() + instructions.len() > limits.max_context_bytes {
            return Err(invalid(format!(
                "input: with the instructions, {} bytes; the turn's context is at most {} bytes (limits.max_context_bytes)",
                input.len() + instructions.len(),
                limits.max_context_bytes
            )));
        }
        let tools = match map.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => {
                let mut out: Vec<String> = Vec::new();
                for (i, t) in a.iter().enumerate() {
                    let Some(t) = t.as_str() else { return Err(invalid(format!("tools[{i}]: must be a string"))) };
                    if !catalogue.has(t) {
                        return Err(invalid(format!("tools[{i}]: `{t}` is not a configured tool")));
                    }
                    if out.iter().any(|o| o == t) {
                        return Err(invalid(format!("tools[{i}]: `{t}` is listed twice")));
                    }
                    out.push(t.to_string());
                }
                if out.len() > MAX_TOOLS {
                    return Err(invalid(format!("tools: at most {MAX_TOOLS}")));
                }
                out
            }
            Some(_) => return Err(invalid("tools: must be an array of tool ids".into())),
        };
        let deliver = match map.get("deliver") {
            None | Some(Value::Null) => None,
            Some(d) => Some(check_deliver(d, cfg)?),
        };
        Ok(Self { step_id, model, instructions, input, tools, limits, deliver })
    }
}

/// `{"channel": "email", "email": {"from", "to", "cc", "subject"}}`: checked by making the
/// email it will be, with a placeholder body.
fn check_deliver(d: &Value, cfg: &Config) -> Result<Value, TurnError> {
    let invalid = |m: String| TurnError::Invalid(format!("deliver: {m}"));
    let map = d.as_object().ok_or_else(|| invalid("must be an object or null".into()))?;
    if let Some(k) = map.keys().find(|k| !["channel", "email"].contains(&k.as_str())) {
        return Err(invalid(format!("{k}: unknown field")));
    }
    if map.get("channel").and_then(Value::as_str) != Some("email") {
        return Err(invalid("channel: must be \"email\" (the final text is the email's body)".into()));
    }
    let email = map.get("email").and_then(Value::as_object).ok_or_else(|| invalid("email: is required".into()))?;
    if let Some(k) = email.keys().find(|k| !["from", "to", "cc", "subject"].contains(&k.as_str())) {
        return Err(invalid(format!("email.{k}: unknown field (the body is the turn's final text)")));
    }
    let email = Value::Object(email.clone());
    let artifact = final_artifact(&email, "x", cfg).map_err(|e| invalid(e.to_string()))?;
    airlock_delivery::pipeline::check_policy(cfg, &artifact).map_err(|e| invalid(e.to_string()))?;
    Ok(json!({"channel": "email", "email": email}))
}

/// The email of a turn's final text, from its `deliver.email`.
pub fn final_artifact(
    email: &Value,
    text: &str,
    cfg: &Config,
) -> Result<Artifact, airlock_delivery::artifact::ValidationError> {
    let mut email = email.clone();
    email["text"] = Value::String(text.to_string());
    if email.get("cc").is_none() {
        email["cc"] = json!([]);
    }
    Artifact::from_parts("email", Some(&email), None, &airlock_delivery::pipeline::limits(cfg))
}

/// Creates the turn and enqueues its job (which wakes the workers), in one transaction. The same `step_id` with the
/// same request returns the turn it made (`false`); with another request it is a conflict.
pub async fn create(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    principal_id: uuid::Uuid,
    new: &NewTurn,
) -> Result<(Turn, bool), TurnError> {
    let mut tx = pool.begin().await?;
    let run = airlock_runs::run::lock(&mut tx, run_id, Some(agent)).await?.ok_or(TurnError::NotFound("run"))?;
    if let Some(turn) = by_step(&mut *tx, run_id, &new.step_id).await? {
        tx.commit().await?;
        if same_request(&turn, new) {
            return Ok((turn, false));
        }
        return Err(TurnError::IdempotencyConflict(format!(
            "step `{}` of this run already asked for another turn ({})",
            new.step_id, turn.id
        )));
    }
    if run.state != RunState::Active {
        return Err(TurnError::InvalidTransition(format!(
            "run {run_id} is {}: a turn needs an active run",
            run.state.as_str()
        )));
    }
    let id = TurnId::new();
    let turn: Turn = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO agent_turns (id, run_id, step_id, agent, model, instructions, input, tools, limits, deliver, principal_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(run_id)
    .bind(&new.step_id)
    .bind(agent)
    .bind(&new.model)
    .bind(&new.instructions)
    .bind(&new.input)
    .bind(&new.tools)
    .bind(Json(new.limits))
    .bind(&new.deliver)
    .bind(principal_id)
    .fetch_one(&mut *tx)
    .await?;
    event(&mut *tx, id, "queued", "queued", &json!({"model": new.model, "tools": new.tools})).await?;
    enqueue(&mut tx, id).await?;
    tx.commit().await?;
    metrics::counter!(airlock_core::metrics::TURNS, "state" => "queued").increment(1);
    Ok((turn, true))
}

fn same_request(t: &Turn, new: &NewTurn) -> bool {
    t.model == new.model
        && t.instructions == new.instructions
        && t.input == new.input
        && t.tools == new.tools
        && t.limits.0 == new.limits
        && t.deliver == new.deliver
}

/// Enqueues the turn's job (one live job a turn: a second is the first).
pub async fn enqueue(tx: &mut Transaction<'_, Postgres>, id: TurnId) -> Result<(), TurnError> {
    let job = NewJob::new(TURN_JOB, json!({"turn_id": id})).unique_key(format!("turn:{id}")).max_attempts(25);
    airlock_queue::enqueue(tx, &job).await?;
    Ok(())
}

async fn by_step(db: impl PgExecutor<'_>, run_id: RunId, step_id: &str) -> Result<Option<Turn>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM agent_turns WHERE run_id = $1 AND step_id = $2")))
        .bind(run_id)
        .bind(step_id)
        .fetch_optional(db)
        .await
}

/// A turn of `agent` (another agent's turn is not found), or any turn (`None`).
pub async fn get(db: impl PgExecutor<'_>, id: TurnId, agent: Option<&str>) -> Result<Option<Turn>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM agent_turns WHERE id = $1 AND ($2::text IS NULL OR agent = $2)"
    )))
    .bind(id)
    .bind(agent)
    .fetch_optional(db)
    .await
}

/// The turns of a run that have not ended, oldest first.
pub async fn open_of_run(db: impl PgExecutor<'_>, run_id: RunId) -> Result<Vec<TurnId>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM agent_turns WHERE run_id = $1 AND finished_at IS NULL ORDER BY created_at, id")
        .bind(run_id)
        .fetch_all(db)
        .await
}

/// The same turn, locked, in a transaction.
pub async fn lock(tx: &mut Transaction<'_, Postgres>, id: TurnId) -> Result<Option<Turn>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM agent_turns WHERE id = $1 FOR UPDATE")))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await
}

/// Appends an event, once for its `key`; returns whether it was new.
pub async fn event(
    db: impl PgExecutor<'_>,
    id: TurnId,
    key: &str,
    kind: &str,
    data: &Value,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "WITH s AS (UPDATE agent_turns SET next_event = next_event + 1
                    WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM turn_events WHERE turn_id = $1 AND key = $2)
                    RETURNING next_event - 1 AS seq)
         INSERT INTO turn_events (turn_id, seq, key, kind, data) SELECT $1, seq, $2, $3, $4 FROM s
         ON CONFLICT (turn_id, key) DO NOTHING",
    )
    .bind(id)
    .bind(key)
    .bind(kind)
    .bind(data)
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// One event of a turn.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Event {
    pub seq: i64,
    pub kind: String,
    pub data: Value,
    pub at: DateTime<Utc>,
}

/// The turn's events after `after`, in order.
pub async fn events(db: impl PgExecutor<'_>, id: TurnId, after: i64, limit: i64) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as("SELECT seq, kind, data, at FROM turn_events WHERE turn_id = $1 AND seq > $2 ORDER BY seq LIMIT $3")
        .bind(id)
        .bind(after)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// A driver takes the turn up at run epoch `epoch` (from `queued` or `running`: a driver
/// after one that died). `None`: the turn is not its to drive (ended, paused, or taken by a
/// newer epoch).
pub async fn start(db: impl PgExecutor<'_>, id: TurnId, epoch: i64) -> Result<Option<Turn>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE agent_turns SET state = 'running', epoch = $2, updated_at = now()
         WHERE id = $1 AND state IN ('queued', 'running') AND epoch < $2 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(epoch)
    .fetch_optional(db)
    .await
}

/// The counters the driver at `epoch` has reached; false when it no longer drives the turn.
pub async fn progress(
    db: impl PgExecutor<'_>,
    id: TurnId,
    epoch: i64,
    rounds: i32,
    tool_calls: i32,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE agent_turns SET rounds = $3, tool_calls = $4, updated_at = now()
         WHERE id = $1 AND epoch = $2 AND state = 'running'",
    )
    .bind(id)
    .bind(epoch)
    .bind(rounds)
    .bind(tool_calls)
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// How a turn ends.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub state: TurnState,
    pub final_text: Option<String>,
    pub delivery_id: Option<DeliveryId>,
    /// `{"code", "message"}` for a turn that did not complete.
    pub error: Option<Value>,
}

impl Ending {
    pub fn failed(state: TurnState, code: &str, message: impl Into<String>) -> Self {
        Self {
            state,
            final_text: None,
            delivery_id: None,
            error: Some(json!({"code": code, "message": message.into()})),
        }
    }
}

/// Ends the turn driven at `epoch`, with its event; false when it had ended already or
/// another driver holds it.
pub async fn end(
    tx: &mut Transaction<'_, Postgres>,
    id: TurnId,
    epoch: i64,
    ending: &Ending,
    rounds: i32,
    tool_calls: i32,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE agent_turns SET state = $3, final_text = $4, delivery_id = $5, error = $6, rounds = $7,
                tool_calls = $8, finished_at = now(), updated_at = now()
         WHERE id = $1 AND epoch = $2 AND state IN ('queued', 'running')",
    )
    .bind(id)
    .bind(epoch)
    .bind(ending.state)
    .bind(&ending.final_text)
    .bind(ending.delivery_id)
    .bind(&ending.error)
    .bind(rounds)
    .bind(tool_calls)
    .execute(&mut **tx)
    .await?;
    if r.rows_affected() == 0 {
        return Ok(false);
    }
    let mut data = json!({"state": ending.state, "rounds": rounds, "tool_calls": tool_calls});
    if let Some(e) = &ending.error {
        data["error"] = e.clone();
    }
    if let Some(d) = ending.delivery_id {
        data["delivery_id"] = json!(d);
    }
    event(&mut **tx, id, "ended", ending.state.as_str(), &data).await?;
    metrics::counter!(airlock_core::metrics::TURNS, "state" => ending.state.as_str()).increment(1);
    Ok(true)
}

/// Ends a turn that has not ended, whoever drives it (its run ended, or its job failed for
/// good); false when it had ended already. A pending authorization stays as it is, and can
/// no longer be decided.
pub async fn end_any(tx: &mut Transaction<'_, Postgres>, id: TurnId, ending: &Ending) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE agent_turns SET state = $2, error = $3, finished_at = now(), updated_at = now()
         WHERE id = $1 AND state IN ('queued', 'running', 'authorization_required')",
    )
    .bind(id)
    .bind(ending.state)
    .bind(&ending.error)
    .execute(&mut **tx)
    .await?;
    if r.rows_affected() == 0 {
        return Ok(false);
    }
    let data = json!({"state": ending.state, "error": ending.error});
    event(&mut **tx, id, "ended", ending.state.as_str(), &data).await?;
    metrics::counter!(airlock_core::metrics::TURNS, "state" => ending.state.as_str()).increment(1);
    Ok(true)
}

/// Cancels a turn of `agent` that has not ended: every later effect is refused, a reply
/// in flight is ignored, a run waiting on its authorization is active again.
pub async fn cancel(pool: &PgPool, id: TurnId, agent: &str, reason: &str) -> Result<Turn, TurnError> {
    let reason = reason.trim();
    if reason.is_empty() || reason.chars().count() > 2000 {
        return Err(TurnError::Invalid("reason: 1 to 2000 characters, is required".into()));
    }
    let mut tx = pool.begin().await?;
    let turn = lock(&mut tx, id).await?.filter(|t| t.agent == agent).ok_or(TurnError::NotFound("turn"))?;
    if next(turn.state, TurnAction::Cancel).is_none() {
        return Err(TurnError::InvalidTransition(format!(
            "turn {id} is {}: only a turn that has not ended can be cancelled",
            turn.state.as_str()
        )));
    }
    let error = json!({"code": "CANCELLED", "message": reason});
    let turn: Turn = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE agent_turns SET state = 'cancelled', error = $2, finished_at = now(), updated_at = now()
         WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(&error)
    .fetch_one(&mut *tx)
    .await?;
    if let Some(auth) = crate::authorization::pending_of(&mut *tx, id).await? {
        airlock_runs::run::resume(&mut tx, turn.run_id, &crate::authorization::waiting_key(auth)).await?;
    }
    event(&mut *tx, id, "ended", "cancelled", &json!({"state": "cancelled", "error": error})).await?;
    tx.commit().await?;
    metrics::counter!(airlock_core::metrics::TURNS, "state" => "cancelled").increment(1);
    Ok(turn)
}

/// Whether the turn has been cancelled (or ended otherwise) since `epoch` took it up, or
/// another driver holds it: the driver must stop before its next effect.
pub async fn still_driven(db: impl PgExecutor<'_>, id: TurnId, epoch: i64) -> Result<bool, sqlx::Error> {
    let n: Option<i64> = sqlx::query_scalar("SELECT epoch FROM agent_turns WHERE id = $1 AND state = 'running'")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(n == Some(epoch))
}

/// Ends every turn of a run that was cancelled, in the caller's transaction.
pub async fn end_with_cancelled_run(tx: &mut Transaction<'_, Postgres>, run_id: RunId) -> Result<usize, sqlx::Error> {
    let ending = Ending::failed(TurnState::Cancelled, "RUN_CANCELLED", "the run was cancelled");
    let mut n = 0;
    for id in open_of_run(&mut **tx, run_id).await? {
        n += usize::from(end_any(tx, id, &ending).await?);
    }
    Ok(n)
}

/// Queues again the turns of a run that a human unblocked (an effect settled): a turn that
/// waited on it goes on.
pub async fn requeue_run(pool: &PgPool, run_id: RunId) -> Result<usize, TurnError> {
    let mut tx = pool.begin().await?;
    let mut n = 0;
    for id in open_of_run(&mut *tx, run_id).await? {
        if lock(&mut tx, id).await?.is_some_and(|t| matches!(t.state, TurnState::Queued | TurnState::Running)) {
            enqueue(&mut tx, id).await?;
            n += 1;
        }
    }
    tx.commit().await?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_table() {
        use TurnAction as A;
        use TurnState as S;
        let ends = [S::Completed, S::Failed, S::ModelUnavailable, S::ModelProtocolError, S::BudgetExhausted];
        let mut expected: Vec<(S, A, S)> = vec![
            (S::Queued, A::Start, S::Running),
            (S::Running, A::Start, S::Running),
            (S::Running, A::Pause, S::AuthorizationRequired),
            (S::AuthorizationRequired, A::Resume, S::Queued),
            (S::Queued, A::Cancel, S::Cancelled),
            (S::Running, A::Cancel, S::Cancelled),
            (S::AuthorizationRequired, A::Cancel, S::Cancelled),
        ];
        for to in ends {
            expected.push((S::Queued, A::End(to), to));
            expected.push((S::Running, A::End(to), to));
        }
        let actions: Vec<A> =
            [A::Start, A::Pause, A::Resume, A::Cancel].into_iter().chain(S::ALL.into_iter().map(A::End)).collect();
        for from in S::ALL {
            for a in &actions {
                let want = expected.iter().find(|(f, x, _)| *f == from && x == a).map(|(_, _, to)| *to);
                assert_eq!(next(from, *a), want, "{from:?} by {a:?}");
            }
            assert_eq!(S::parse(from.as_str()), Some(from));
        }
        let terminal: Vec<S> = S::ALL.into_iter().filter(|s| s.is_terminal()).collect();
        assert_eq!(terminal, [ends[..2].to_vec(), vec![S::Cancelled], ends[2..].to_vec()].concat());
    }
}
