//! Agent turns, for reviewers: the non-repeatable calls waiting for a human, each with its
//! tool, its exact arguments and their hash; a grant bound to that hash, or a denial, each
//! audited with its note; and one turn as its agent sees it.

use airlock_agent::authorization::{self, AuthorizationState, Decision};
use airlock_agent::{turn, view};
use airlock_core::principals::Role;
use airlock_http::{ApiError, Auth, JsonBody, Page, decode_time_cursor, next_time_cursor, page_limit, parse_id};
use axum::Json;
use axum::extract::{Path, Query, State};
use serde::Deserialize;
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use crate::server::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuthorizationsQuery {
    /// `pending` (the default), `granted` or `denied`.
    state: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Authorizations, oldest first: by default the calls waiting for a human.
#[utoipa::path(get, path = "/admin/v1/authorizations", params(AuthorizationsQuery),
    responses((status = 200, description = "`{items, next}`: `{id, turn_id, run_id, tool_id, arguments, arguments_sha256, state, …}`"),
        (status = 400, description = "unknown state or bad cursor"), (status = 401, description = "no valid token"),
        (status = 403, description = "not a reviewer")))]
pub async fn list_authorizations(
    State(state): State<AppState>,
    auth: Auth,
    Query(q): Query<AuthorizationsQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Reviewer)?;
    let wanted = match q.state.as_deref() {
        None | Some("pending") => AuthorizationState::Pending,
        Some(s) => AuthorizationState::parse(s)
            .ok_or_else(|| ApiError::validation("state: `pending`, `granted` or `denied`"))?,
    };
    let limit = page_limit(q.limit)?;
    let after = decode_time_cursor::<uuid::Uuid>(q.cursor.as_deref())?;
    let rows = authorization::list(&state.pool, Some(wanted), after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = next_time_cursor(more, rows.last().map(|a| (a.created_at, a.id)));
    Ok(Json(Page { items: rows.iter().map(view::authorization).collect(), next }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantBody {
    /// The hash of the arguments the reviewer was shown.
    arguments_sha256: Option<String>,
    /// Why (required).
    note: Option<String>,
}

/// Allows that exact call once; the turn resumes and runs it (audited). Another hash than
/// the call's is refused, nothing changed.
#[utoipa::path(post, path = "/admin/v1/authorizations/{id}/grant", params(("id" = String, Path, description = "authorization id")),
    request_body = GrantBody,
    responses((status = 200, description = "the authorization, `granted`"), (status = 400, description = "no hash or no note"),
        (status = 403, description = "not a reviewer"), (status = 404, description = "no such authorization"),
        (status = 409, description = "STALE_ARTIFACT (another hash) or INVALID_TRANSITION (decided already, or the turn ended)")))]
pub async fn grant(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<GrantBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let sha = body.arguments_sha256.as_deref().ok_or_else(|| ApiError::validation("arguments_sha256: is required"))?;
    let decision = Decision::Grant { arguments_sha256: sha };
    let a = authorization::decide(&state.pool, who, parse_id(&id)?, decision, body.note.as_deref().unwrap_or_default())
        .await?;
    Ok(Json(view::authorization(&a)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DenyBody {
    /// Why (required): the model is told the call was denied.
    note: Option<String>,
}

/// Refuses the call: it never runs, the model is told, the turn goes on (audited).
#[utoipa::path(post, path = "/admin/v1/authorizations/{id}/deny", params(("id" = String, Path, description = "authorization id")),
    request_body = DenyBody,
    responses((status = 200, description = "the authorization, `denied`"), (status = 400, description = "no note"),
        (status = 403, description = "not a reviewer"), (status = 404, description = "no such authorization"),
        (status = 409, description = "INVALID_TRANSITION: decided already, or the turn ended")))]
pub async fn deny(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<DenyBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let a = authorization::decide(
        &state.pool,
        who,
        parse_id(&id)?,
        Decision::Deny,
        body.note.as_deref().unwrap_or_default(),
    )
    .await?;
    Ok(Json(view::authorization(&a)))
}

/// One turn, as its agent sees it.
#[utoipa::path(get, path = "/admin/v1/turns/{id}", params(("id" = String, Path, description = "turn id")),
    responses((status = 200, description = "the turn"), (status = 403, description = "not a reviewer"),
        (status = 404, description = "no such turn")))]
pub async fn get_turn(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Reviewer)?;
    let t = turn::get(&state.pool, parse_id(&id)?, None).await?.ok_or_else(|| ApiError::not_found("turn"))?;
    let a = authorization::latest_of(&state.pool, t.id).await?;
    Ok(Json(view::turn(&t, a.as_ref())))
}
