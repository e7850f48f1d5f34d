//! Durable runs, for agents: create and read a run, take it over (`claim`), record steps
//! of its replay log, begin effects and record their outcomes, and end it.
//!
//! Every write names the holder epoch the caller holds (`STALE_EPOCH` otherwise) and is
//! refused once the run is terminal (`INVALID_TRANSITION`); an agent sees only its own runs
//! (anything else is 404). See `docs/runs.md` for the protocol a resumable client follows.

use airlock_http::{ApiError, Auth, JsonBody, Page, decode_cursor, encode_cursor, page_limit, parse_id};
use airlock_queue::EffectClass;
use airlock_runs::budget::{self, Limits, Usage};
use airlock_runs::effects::{self, BeginEffect, Begun, Outcome};
use airlock_runs::steps::{self, NewStep, Recorded, StepKind};
use airlock_runs::{RunError, run, view};
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use crate::AppState;

/// Asked limits: 0 (or absent) takes the agent's ceiling.
#[derive(Debug, Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default)]
    max_steps: i64,
    #[serde(default)]
    max_tokens: i64,
    #[serde(default)]
    max_cost_micros: i64,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    #[serde(default)]
    budget: Budget,
    /// A JSON object: what the run starts from.
    #[serde(default)]
    inputs: Option<Value>,
}

/// What a step spends beside the step itself.
#[derive(Debug, Deserialize, Default, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct UsageBody {
    tokens: i64,
    cost_micros: i64,
}

impl From<UsageBody> for Usage {
    fn from(u: UsageBody) -> Self {
        Usage { tokens: u.tokens, cost_micros: u.cost_micros }
    }
}

/// Refuses a JSON value larger than the configured `runs.max_data_bytes`.
fn within(state: &AppState, field: &str, v: &Value) -> Result<(), ApiError> {
    let max = state.config.runs.max_data_bytes;
    if serde_json::to_vec(v).map_or(usize::MAX, |b| b.len()) > max {
        return Err(ApiError::payload_too_large(format!("{field}: larger than runs.max_data_bytes ({max} bytes)")));
    }
    Ok(())
}

/// Starts a run with a budget within the agent's ceilings; the caller holds it at epoch 1.
#[utoipa::path(post, path = "/v1/runs", request_body = CreateRun,
    responses((status = 201, description = "the run: `{id, state, epoch, budget, …}`"),
        (status = 400, description = "invalid, or a limit above the agent's ceiling (named)"),
        (status = 401, description = "no valid token"), (status = 403, description = "not an agent token"),
        (status = 413, description = "inputs too large")))]
pub async fn create_run(
    State(state): State<AppState>,
    auth: Auth,
    JsonBody(req): JsonBody<CreateRun>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let b = &req.budget;
    let asked = Limits { max_steps: b.max_steps, max_tokens: b.max_tokens, max_cost_micros: b.max_cost_micros };
    let limits = budget::limits_for(&state.config.runs, agent, asked)?;
    let inputs = req.inputs.unwrap_or_else(|| json!({}));
    if !inputs.is_object() {
        return Err(ApiError::validation("inputs: must be a JSON object"));
    }
    within(&state, "inputs", &inputs)?;
    let r = run::create(&state.pool, agent, &auth.0.name, &inputs, limits).await?;
    Ok((StatusCode::CREATED, Json(view::run(&r))))
}

/// A run of the calling agent, with its state, epoch and budget used.
#[utoipa::path(get, path = "/v1/runs/{id}", params(("id" = String, Path, description = "run id")),
    responses((status = 200, description = "the run"), (status = 400, description = "not a run id"),
        (status = 404, description = "no such run of this agent")))]
pub async fn get_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let r = run::get(&state.pool, parse_id(&id)?, agent).await?.ok_or_else(|| ApiError::not_found("run"))?;
    Ok(Json(view::run(&r)))
}

/// Takes the run over (a resumed process): the caller holds it at epoch + 1, and every
/// write of an older epoch is refused from now on.
#[utoipa::path(post, path = "/v1/runs/{id}/claim", params(("id" = String, Path, description = "run id")),
    responses((status = 200, description = "the run, with its new epoch"), (status = 404, description = "no such run of this agent"),
        (status = 409, description = "INVALID_TRANSITION: the run is terminal")))]
pub async fn claim_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let r = run::claim(&state.pool, parse_id(&id)?, agent, &auth.0.name).await?;
    Ok(Json(view::run(&r)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordStep {
    /// The holder epoch the caller holds.
    epoch: i64,
    step_id: String,
    /// `model_output`, `tool_result`, `clock`, `random`, `input` or `note`.
    kind: String,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    usage: UsageBody,
}

/// Records a non-deterministic input of the run. A step recorded before is answered as it
/// was recorded (`replayed: true`), whatever was sent now.
#[utoipa::path(post, path = "/v1/runs/{id}/steps", params(("id" = String, Path, description = "run id")), request_body = RecordStep,
    responses((status = 201, description = "recorded, budget spent"), (status = 200, description = "recorded before: the recorded step, `replayed: true`"),
        (status = 400, description = "invalid"), (status = 404, description = "no such run of this agent"),
        (status = 409, description = "STALE_EPOCH, REPLAY_DIVERGED (recorded as another kind), BUDGET_EXHAUSTED (nothing recorded; the run is `budget_exhausted`) or INVALID_TRANSITION (the run does not take steps)"),
        (status = 413, description = "data too large")))]
pub async fn record_step(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<RecordStep>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let kind = StepKind::parse_recordable(&body.kind)
        .ok_or_else(|| ApiError::validation("kind: one of model_output, tool_result, clock, random, input, note"))?;
    let data = body.data.unwrap_or_else(|| json!({}));
    within(&state, "data", &data)?;
    let new = NewStep { step_id: &body.step_id, kind, data: &data, usage: body.usage.into() };
    match steps::record(&state.pool, parse_id(&id)?, agent, body.epoch, &new).await? {
        Recorded::New(s) => Ok((StatusCode::CREATED, Json(view::step(&s, false)))),
        Recorded::Replayed(s) => Ok((StatusCode::OK, Json(view::step(&s, true)))),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct StepsQuery {
    limit: Option<i64>,
    cursor: Option<String>,
}

/// The replay log in order (`seq`), effects and deliveries included.
#[utoipa::path(get, path = "/v1/runs/{id}/steps", params(("id" = String, Path, description = "run id"), StepsQuery),
    responses((status = 200, description = "`{items, next}`"), (status = 400, description = "invalid cursor or limit"),
        (status = 404, description = "no such run of this agent")))]
pub async fn list_steps(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    Query(q): Query<StepsQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    let agent = auth.agent()?;
    let r = run::get(&state.pool, parse_id(&id)?, agent).await?.ok_or_else(|| ApiError::not_found("run"))?;
    let limit = page_limit(q.limit)?;
    let after = match q.cursor.as_deref() {
        Some(c) => decode_cursor(c)?.parse::<i64>().map_err(|_| ApiError::validation("cursor: malformed"))?,
        None => 0,
    };
    let rows = steps::list(&state.pool, r.id, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = if more { rows.last().map(|s| encode_cursor(&s.seq.to_string())) } else { None };
    Ok(Json(Page { items: rows.iter().map(|s| view::step(s, false)).collect(), next }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BeginEffectBody {
    epoch: i64,
    step_id: String,
    /// `idempotent` or `non_repeatable`.
    effect_class: String,
    #[serde(default)]
    target: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    usage: UsageBody,
}

/// Begins an external write, committed (and its budget spent) before the caller performs
/// it; answers what to do: perform it with the key, skip it, or wait for a human.
#[utoipa::path(post, path = "/v1/runs/{id}/effects", params(("id" = String, Path, description = "run id")), request_body = BeginEffectBody,
    responses((status = 201, description = "started: attempt 1, perform the write with `idempotency_key`"),
        (status = 200, description = "begun before: the recorded outcome (`replayed: true`, skip the write), or a new attempt of an idempotent effect with the same key (redo it)"),
        (status = 202, description = "started before without an outcome, not repeatable: `awaiting_human`, the run is `waiting`"),
        (status = 400, description = "invalid"), (status = 404, description = "no such run of this agent"),
        (status = 409, description = "STALE_EPOCH, REPLAY_DIVERGED, BUDGET_EXHAUSTED or INVALID_TRANSITION")))]
pub async fn begin_effect(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<BeginEffectBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let effect_class = match body.effect_class.as_str() {
        "idempotent" => EffectClass::Idempotent,
        "non_repeatable" => EffectClass::NonRepeatable,
        _ => return Err(ApiError::validation("effect_class: `idempotent` or `non_repeatable`")),
    };
    let new = BeginEffect {
        step_id: &body.step_id,
        effect_class,
        target: &body.target,
        description: &body.description,
        usage: body.usage.into(),
    };
    let begun = effects::begin(&state.pool, parse_id(&id)?, agent, &auth.0.name, body.epoch, &new).await?;
    Ok(match begun {
        Begun::Started { effect, first: true } => (StatusCode::CREATED, Json(view::effect(&effect))),
        Begun::Started { effect, first: false } | Begun::Recorded(effect) => {
            (StatusCode::OK, Json(view::effect(&effect)))
        }
        Begun::AwaitingHuman(effect) => (StatusCode::ACCEPTED, Json(view::effect(&effect))),
    })
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OutcomeBody {
    epoch: i64,
    /// The attempt the write was made under.
    attempt: i32,
    /// `succeeded` or `failed`.
    outcome: String,
    #[serde(default)]
    result: Option<Value>,
}

/// Records what the write of the effect's latest attempt did.
#[utoipa::path(post, path = "/v1/runs/{id}/effects/{step_id}/outcome",
    params(("id" = String, Path, description = "run id"), ("step_id" = String, Path, description = "the effect's step id")),
    request_body = OutcomeBody,
    responses((status = 200, description = "the effect with its outcome (the same outcome again is answered as recorded)"),
        (status = 400, description = "invalid"), (status = 404, description = "no such run or effect"),
        (status = 409, description = "STALE_EPOCH, or INVALID_TRANSITION (not the latest attempt, or it has another outcome)"),
        (status = 413, description = "result too large")))]
pub async fn record_outcome(
    State(state): State<AppState>,
    auth: Auth,
    Path((id, step_id)): Path<(String, String)>,
    JsonBody(body): JsonBody<OutcomeBody>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let result = body.result.unwrap_or_else(|| json!({}));
    within(&state, "result", &result)?;
    let run_id = parse_id(&id)?;
    let outcome = match body.outcome.as_str() {
        "succeeded" => Outcome::Succeeded,
        "failed" => Outcome::Failed,
        _ => return Err(ApiError::validation("outcome: `succeeded` or `failed`")),
    };
    let e = effects::record_outcome(
        &state.pool,
        run_id,
        agent,
        &auth.0.name,
        body.epoch,
        &step_id,
        body.attempt,
        outcome,
        &result,
    )
    .await?;
    Ok(Json(view::effect(&e)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    epoch: i64,
    #[serde(default)]
    result: Option<Value>,
}

/// Ends the run with its result.
#[utoipa::path(post, path = "/v1/runs/{id}/complete", params(("id" = String, Path, description = "run id")), request_body = CompleteBody,
    responses((status = 200, description = "the run, `completed`"), (status = 404, description = "no such run of this agent"),
        (status = 409, description = "STALE_EPOCH or INVALID_TRANSITION"), (status = 413, description = "result too large")))]
pub async fn complete_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CompleteBody>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let result = body.result.unwrap_or_else(|| json!({}));
    within(&state, "result", &result)?;
    let r = run::complete(&state.pool, parse_id(&id)?, agent, body.epoch, &result).await?;
    Ok(Json(view::run(&r)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailBody {
    epoch: i64,
    #[serde(default)]
    error: Option<Value>,
}

/// Ends the run with an error.
#[utoipa::path(post, path = "/v1/runs/{id}/fail", params(("id" = String, Path, description = "run id")), request_body = FailBody,
    responses((status = 200, description = "the run, `failed`"), (status = 404, description = "no such run of this agent"),
        (status = 409, description = "STALE_EPOCH or INVALID_TRANSITION"), (status = 413, description = "error too large")))]
pub async fn fail_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<FailBody>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let error = body.error.unwrap_or_else(|| json!({}));
    within(&state, "error", &error)?;
    let r = run::fail(&state.pool, parse_id(&id)?, agent, body.epoch, &error).await?;
    Ok(Json(view::run(&r)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRunBody {
    reason: Option<String>,
}

/// Cancels the run (no epoch needed): every later step and effect is refused, whoever asks.
#[utoipa::path(post, path = "/v1/runs/{id}/cancel", params(("id" = String, Path, description = "run id")), request_body = CancelRunBody,
    responses((status = 200, description = "the run, `cancelled`"), (status = 400, description = "no reason"),
        (status = 404, description = "no such run of this agent"), (status = 409, description = "INVALID_TRANSITION: already ended")))]
pub async fn cancel_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CancelRunBody>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let reason = reason(body.reason.as_deref())?;
    let mut conn = state.pool.acquire().await?;
    let r = run::cancel(&mut conn, parse_id(&id)?, Some(agent), &reason).await?;
    Ok(Json(view::run(&r)))
}

/// A reason of 1 to 2000 characters.
pub fn reason(r: Option<&str>) -> Result<String, RunError> {
    match r.map(str::trim) {
        Some(s) if !s.is_empty() && s.chars().count() <= 2000 => Ok(s.to_string()),
        _ => Err(RunError::Invalid("reason: 1 to 2000 characters are required".into())),
    }
}
