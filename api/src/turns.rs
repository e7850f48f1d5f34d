//! Agent turns, for agents: ask for a turn inside a run, read it and its events, cancel it,
//! and resume it once a human decided its authorization. See `docs/agent-turns.md`.
//!
//! An agent sees only its own turns (anything else is 404). A turn's request names a
//! configured model and configured tools, within the configured limits; anything else is
//! 400 with nothing written.

use airlock_agent::authorization;
use airlock_agent::turn::{self, NewTurn};
use airlock_agent::view;
use airlock_http::{ApiError, Auth, JsonBody, Page, decode_cursor, encode_cursor, page_limit, parse_id};
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use crate::AppState;

/// Asks for a turn of the run: a configured model driven through the action protocol with
/// the named tools. The same `step_id` again is the same turn.
#[utoipa::path(post, path = "/v1/runs/{id}/turns", params(("id" = String, Path, description = "run id")),
    request_body(content = Object, description = "step_id, model, instructions, input, tools, limits, deliver"),
    responses((status = 201, description = "queued: `{id, run_id, state}`"), (status = 200, description = "the same step_id again: the same turn"),
        (status = 400, description = "invalid: an unknown model or tool, a limit above its ceiling (named), …"),
        (status = 404, description = "no such run of this agent"),
        (status = 409, description = "IDEMPOTENCY_CONFLICT (the step asked for another turn) or INVALID_TRANSITION (the run is not active)")))]
pub async fn create_turn(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Value>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let run_id = parse_id(&id)?;
    let new = NewTurn::parse(&body, &state.config, &state.catalogue)?;
    let (t, created) = turn::create(&state.pool, run_id, agent, auth.0.id, &new).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((
        status,
        Json(json!({"id": t.id, "run_id": t.run_id, "state": t.state, "model": t.model, "step_id": t.step_id})),
    ))
}

/// A turn of the calling agent: its state, rounds, final text, delivery, authorization.
#[utoipa::path(get, path = "/v1/turns/{id}", params(("id" = String, Path, description = "turn id")),
    responses((status = 200, description = "the turn"), (status = 400, description = "not a turn id"),
        (status = 404, description = "no such turn of this agent")))]
pub async fn get_turn(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let t = turn::get(&state.pool, parse_id(&id)?, Some(agent)).await?.ok_or_else(|| ApiError::not_found("turn"))?;
    let auth = authorization::latest_of(&state.pool, t.id).await?;
    Ok(Json(view::turn(&t, auth.as_ref())))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// From `next` of the previous page.
    cursor: Option<String>,
    /// 1 to 1000 (50 by default).
    limit: Option<i64>,
}

/// What the turn went through, in order, a page at a time.
#[utoipa::path(get, path = "/v1/turns/{id}/events", params(("id" = String, Path, description = "turn id"), EventsQuery),
    responses((status = 200, description = "`{items: [{seq, kind, data, at}], next}`"), (status = 400, description = "bad cursor or limit"),
        (status = 404, description = "no such turn of this agent")))]
pub async fn turn_events(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    let agent = auth.agent()?;
    let t = turn::get(&state.pool, parse_id(&id)?, Some(agent)).await?.ok_or_else(|| ApiError::not_found("turn"))?;
    let limit = page_limit(q.limit)?;
    let after = match q.cursor.as_deref() {
        Some(c) => decode_cursor(c)?.parse::<i64>().map_err(|_| ApiError::validation("cursor: malformed"))?,
        None => 0,
    };
    let rows = turn::events(&state.pool, t.id, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = if more { rows.last().map(|e| encode_cursor(&e.seq.to_string())) } else { None };
    Ok(Json(Page { items: rows.iter().map(view::event).collect(), next }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelTurnBody {
    reason: Option<String>,
}

/// Cancels a turn that has not ended: no later effect happens, a model reply in flight is
/// ignored.
#[utoipa::path(post, path = "/v1/turns/{id}/cancel", params(("id" = String, Path, description = "turn id")), request_body = CancelTurnBody,
    responses((status = 200, description = "the cancelled turn"), (status = 400, description = "no reason"),
        (status = 404, description = "no such turn of this agent"), (status = 409, description = "INVALID_TRANSITION: it has ended")))]
pub async fn cancel_turn(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CancelTurnBody>,
) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    let t = turn::cancel(&state.pool, parse_id(&id)?, agent, body.reason.as_deref().unwrap_or_default()).await?;
    let auth = authorization::latest_of(&state.pool, t.id).await?;
    Ok(Json(view::turn(&t, auth.as_ref())))
}

/// Resumes a turn whose authorization a human decided (a decision resumes it by itself;
/// this makes sure).
#[utoipa::path(post, path = "/v1/turns/{id}/resume", params(("id" = String, Path, description = "turn id")),
    responses((status = 202, description = "queued"), (status = 404, description = "no such turn of this agent"),
        (status = 409, description = "INVALID_TRANSITION: its authorization is pending, or it has none, or it has ended")))]
pub async fn resume_turn(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let id = parse_id(&id)?;
    authorization::resume(&state.pool, id, agent).await?;
    Ok((StatusCode::ACCEPTED, Json(json!({"id": id, "state": "queued"}))))
}
