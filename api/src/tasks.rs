//! Sandboxed tasks, for agents: `POST /v1/tasks` asks for a command to run in a sandbox
//! tier; `GET /v1/tasks/{id}` shows the task with its tier decision and outcome.
//!
//! An agent sees only its own tasks (anything else is 404). Input is parsed before any
//! write, so a refused request leaves no rows; whether the agent may have the tier, the
//! context or the secrets it asks for is decided (and logged) by the `sandbox.select` job.

use airlock_http::{ApiError, Auth, JsonBody, parse_id};
use airlock_sandbox::service;
use airlock_sandbox::spec::{TaskBody, TaskRequest};
use airlock_sandbox::{store, view};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::AppState;

/// Asks for a command to run in a sandbox.
#[utoipa::path(post, path = "/v1/tasks",
    request_body(content = Object, description = "command (argv), mode (agent|platform|human|hybrid, default hybrid), \
        requested_tier, reason, effect (pure|idempotent, default pure), kind, size (small|medium|large), \
        env (literal variables), secrets (keyring names), context (agent ids whose context is mounted read-only)"),
    responses((status = 201, description = "`{id, state}`: stored, selection pending"),
        (status = 400, description = "invalid (nothing stored)"), (status = 401), (status = 403)))]
pub async fn create_task(
    State(state): State<AppState>,
    auth: Auth,
    JsonBody(body): JsonBody<TaskBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let req = TaskRequest::parse(body, &state.config.sandbox).map_err(ApiError::validation)?;
    let task = service::submit(&state.pool, &auth.0, agent, &req).await?;
    Ok((StatusCode::CREATED, Json(json!({"id": task.id, "state": task.state}))))
}

/// A task of the calling agent, with its latest tier decision and the outcome of its run.
#[utoipa::path(get, path = "/v1/tasks/{id}", params(("id" = String, Path, description = "task id")),
    responses((status = 200, description = "`{id, state, decision, outcome, …}`"),
        (status = 404, description = "no such task of this agent")))]
pub async fn get_task(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    match store::get_task(&state.pool, parse_id(&id)?).await? {
        Some(t) if t.agent == agent => Ok(Json(view::task(&state.pool, &t, false).await?)),
        _ => Err(ApiError::not_found("task")),
    }
}
