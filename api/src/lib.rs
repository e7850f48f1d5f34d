//! airlock-api: the agent-facing HTTP API.
//!
//! Every route but the health checks needs an agent's bearer token, and an agent sees only
//! its own runs and deliveries (anything else is 404, so ids do not leak). [`router`]
//! builds the service so tests can start it in-process; `main.rs` binds it.

use std::sync::Arc;

use airlock_core::config::Config;
use airlock_core::delivery::pipeline::{self, Submission};
use airlock_core::delivery::store::{self, Actor, Run};
use airlock_core::delivery::view;
use airlock_core::http::{ApiError, Auth, JsonBody, parse_id};
use axum::extract::{DefaultBodyLimit, FromRef, Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;

/// What every agent-API handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
}

/// The whole agent router.
pub fn router(state: AppState) -> Router {
    // Room for the artifact plus the request's own members; larger bodies are 413.
    let body_limit = state.config.delivery.max_artifact_bytes + 64 * 1024;
    Router::new()
        .route("/v1/runs", post(create_run))
        .route("/v1/runs/{id}", get(get_run))
        .route("/v1/deliveries", post(submit_delivery))
        .route("/v1/deliveries/{id}", get(get_delivery))
        .route("/v1/deliveries/{id}/cancel", post(cancel_delivery))
        .layer(DefaultBodyLimit::max(body_limit))
        .merge(airlock_core::http::health_routes())
        .with_state(state)
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Budget {
    #[serde(default)]
    max_steps: i64,
    #[serde(default)]
    max_tokens: i64,
    #[serde(default)]
    max_cost_micros: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRun {
    #[serde(default)]
    budget: Budget,
    #[serde(default)]
    inputs: Option<Value>,
}

fn run_json(r: &Run) -> Value {
    json!({
        "id": r.id,
        "agent": r.agent,
        "state": r.state,
        "inputs": r.inputs,
        "budget": {
            "limit": {"max_steps": r.max_steps, "max_tokens": r.max_tokens, "max_cost_micros": r.max_cost_micros},
            "used": {"steps": r.used_steps, "tokens": r.used_tokens, "cost_micros": r.used_cost_micros},
        },
        "created_at": r.created_at,
    })
}

async fn create_run(
    State(pool): State<PgPool>,
    auth: Auth,
    JsonBody(req): JsonBody<CreateRun>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let b = &req.budget;
    if b.max_steps < 0 || b.max_tokens < 0 || b.max_cost_micros < 0 {
        return Err(ApiError::Validation("budget: limits must be 0 (unlimited) or positive".into()));
    }
    let inputs = req.inputs.unwrap_or_else(|| json!({}));
    if !inputs.is_object() {
        return Err(ApiError::Validation("inputs: must be a JSON object".into()));
    }
    let run = store::insert_run(&pool, agent, &inputs, (b.max_steps, b.max_tokens, b.max_cost_micros)).await?;
    Ok((StatusCode::CREATED, Json(run_json(&run))))
}

async fn get_run(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let run = store::get_run(&pool, parse_id(&id)?, agent).await?.ok_or_else(|| ApiError::not_found("run"))?;
    Ok(Json(run_json(&run)))
}

async fn submit_delivery(
    State(state): State<AppState>,
    auth: Auth,
    JsonBody(body): JsonBody<Value>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let submission = Submission::parse(&body, &pipeline::limits(&state.config))?;
    let (d, created) = pipeline::submit(&state.pool, &state.config, agent, submission).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((
        status,
        Json(json!({
            "id": d.id, "state": d.state, "idempotency_key": d.idempotency_key,
            "artifact_sha256": d.submitted_sha256, "channel": d.channel, "run_id": d.run_id, "step_id": d.step_id,
        })),
    ))
}

/// The delivery, when it belongs to the calling agent.
async fn own_delivery(pool: &PgPool, auth: &Auth, id: &str) -> Result<store::Delivery, ApiError> {
    let agent = auth.agent()?;
    match store::get(pool, parse_id(id)?).await? {
        Some(d) if d.agent == agent => Ok(d),
        _ => Err(ApiError::not_found("delivery")),
    }
}

async fn get_delivery(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let d = own_delivery(&pool, &auth, &id).await?;
    Ok(Json(view::render(&pool, &d, false).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    reason: Option<String>,
}

async fn cancel_delivery(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CancelBody>,
) -> Result<Json<Value>, ApiError> {
    let d = own_delivery(&pool, &auth, &id).await?;
    let actor = Actor::new("agent", d.agent.clone());
    let d = pipeline::cancel(&pool, &actor, None, d.id, body.reason.as_deref()).await?;
    Ok(Json(view::render(&pool, &d, false).await?))
}
