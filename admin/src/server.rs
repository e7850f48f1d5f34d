//! The admin HTTP service: reviewers work the queue of deliveries, operators flip the send
//! switch and watch jobs and workers. Every route checks the caller's role; every human
//! action is audited (in the same transaction as the action).

use std::sync::Arc;

use airlock_core::config::Config;
use airlock_core::principals::Role;
use airlock_delivery::grants;
use airlock_delivery::pipeline::{self, Resolution};
use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::{self, Actor};
use airlock_delivery::view;
use airlock_http::{
    Access, ApiError, Auth, BearerAuth, JsonBody, Page, RouteRule, decode_cursor, decode_time_cursor, encode_cursor,
    next_time_cursor, page_limit, parse_id,
};
use airlock_queue::JobState;
use axum::extract::{FromRef, Path, Query, State};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use utoipa::{IntoParams, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// What every admin handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
}

/// Who may call each route of this service: the one authorization table, enforced by
/// [`airlock_http::authorize`] before any handler runs.
pub const ROUTES: &[RouteRule] = &[
    RouteRule { method: "GET", path: "/admin/v1/deliveries", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/approve", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/deliveries/{id}", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/accept", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/edit", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/approve", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/reject", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/resolve", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/deliveries/{id}/cancel", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/send-enabled", access: REVIEWER },
    RouteRule { method: "PUT", path: "/admin/v1/send-enabled", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/grants", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/grants", access: OPERATOR },
    RouteRule { method: "DELETE", path: "/admin/v1/grants/{id}", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/suppressions", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/suppressions", access: OPERATOR },
    RouteRule { method: "DELETE", path: "/admin/v1/suppressions/{id}", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/audit", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/jobs", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/workers", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/tasks", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/tasks/{id}", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/tasks/{id}/choose", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/sandbox/decisions", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/sandbox/report", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/runs", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/runs/{id}", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/runs/{id}/cancel", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/runs/{id}/effects/{step_id}/resolve", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/authorizations", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/authorizations/{id}/grant", access: REVIEWER },
    RouteRule { method: "POST", path: "/admin/v1/authorizations/{id}/deny", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/turns/{id}", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/agents/{id}", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/agents/{id}/migrations", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/migrations/{id}", access: OPERATOR },
    RouteRule { method: "GET", path: "/admin/v1/me", access: REVIEWER },
    RouteRule { method: "GET", path: "/admin/v1/queues", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/queues/{name}/pause", access: OPERATOR },
    RouteRule { method: "POST", path: "/admin/v1/queues/{name}/resume", access: OPERATOR },
    RouteRule { method: "GET", path: "/", access: Access::Public },
    RouteRule { method: "GET", path: "/app.js", access: Access::Public },
    RouteRule { method: "GET", path: "/app.css", access: Access::Public },
    RouteRule { method: "GET", path: "/healthz", access: Access::Public },
    RouteRule { method: "GET", path: "/readyz", access: Access::Public },
    RouteRule { method: "GET", path: "/metrics", access: Access::Public },
    RouteRule { method: "GET", path: "/openapi.json", access: Access::Public },
];

const REVIEWER: Access = Access::AtLeast(Role::Reviewer);
const OPERATOR: Access = Access::AtLeast(Role::Operator);

#[derive(OpenApi)]
#[openapi(
    info(title = "airlock admin API", description = "Review, approval, the send switch, grants, audit, jobs and workers."),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

/// The routes with their OpenAPI description.
pub fn documented_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(list_deliveries))
        .routes(routes!(approve_batch))
        .routes(routes!(get_delivery))
        .routes(routes!(accept))
        .routes(routes!(edit))
        .routes(routes!(approve))
        .routes(routes!(reject))
        .routes(routes!(resolve))
        .routes(routes!(cancel))
        .routes(routes!(get_send_enabled, put_send_enabled))
        .routes(routes!(create_grant, list_grants))
        .routes(routes!(revoke_grant))
        .routes(routes!(list_audit))
        .routes(routes!(list_jobs))
        .routes(routes!(list_workers))
        .routes(routes!(crate::sandbox::list_tasks))
        .routes(routes!(crate::sandbox::get_task))
        .routes(routes!(crate::sandbox::choose))
        .routes(routes!(crate::sandbox::list_decisions))
        .routes(routes!(crate::sandbox::get_report))
        .routes(routes!(crate::runs::list_runs))
        .routes(routes!(crate::runs::get_run))
        .routes(routes!(crate::turns::list_authorizations))
        .routes(routes!(crate::turns::grant))
        .routes(routes!(crate::turns::deny))
        .routes(routes!(crate::turns::get_turn))
        .routes(routes!(crate::runs::cancel_run))
        .routes(routes!(crate::runs::resolve_effect))
        .routes(routes!(crate::queues::me))
        .routes(routes!(crate::queues::list_queues))
        .routes(routes!(crate::queues::pause))
        .routes(routes!(crate::queues::resume))
        .merge(crate::capsule::routes())
        .merge(crate::suppressions::routes())
        .routes(routes!(crate::page::index))
        .routes(routes!(crate::page::script))
        .routes(routes!(crate::page::style))
}

/// The OpenAPI document of this service.
pub fn openapi() -> utoipa::openapi::OpenApi {
    airlock_http::assemble(documented_routes()).split_for_parts().1
}

/// The whole admin router.
pub fn router(state: AppState) -> Router {
    let body_limit = state.config.delivery.max_artifact_bytes + 64 * 1024;
    let (router, _) = airlock_http::finish(
        "admin",
        documented_routes(),
        state.pool.clone(),
        ROUTES,
        body_limit,
        airlock_delivery::metrics::gauges,
    );
    router.with_state(state)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/v1/deliveries", params(ListQuery), responses((status = 200, description = "deliveries, oldest first, each with its subject or URL and its score; `state` may list several states separated by commas"), (status = 400, description = "an unknown state, a bad limit or a cursor this service did not issue")))]
async fn list_deliveries(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Reviewer)?;
    let limit = page_limit(q.limit)?;
    // One state, or several separated by commas (the review queue is two).
    let states = match q.state.as_deref() {
        None | Some("") => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|s| DeliveryState::parse(s).ok_or_else(|| ApiError::validation(format!("state: unknown state `{s}`"))))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let after = decode_time_cursor(q.cursor.as_deref())?;
    let rows = store::list(&pool, &states, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = next_time_cursor(more, rows.last().map(|last| (last.delivery.created_at, last.delivery.id)));
    let items = rows.iter().map(view::row).collect();
    Ok(Json(Page { items, next }))
}

#[utoipa::path(get, path = "/admin/v1/deliveries/{id}", params(("id" = String, Path, description = "delivery id")), responses((status = 200, description = "everything, artifact included"), (status = 404)))]
async fn get_delivery(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Reviewer)?;
    let (_, v) = view::show(&pool, parse_id(&id)?, true, None).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(Json(v))
}

async fn full(pool: &PgPool, d: &store::Delivery) -> Result<Json<Value>, ApiError> {
    Ok(Json(view::render(pool, d, true).await?))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct NoteBody {
    note: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/accept", params(("id" = String, Path, description = "delivery id")), request_body = NoteBody, responses((status = 200, description = "awaiting approval"), (status = 409)))]
async fn accept(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<NoteBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let d = pipeline::accept(&pool, who, parse_id(&id)?, body.note.as_deref()).await?;
    full(&pool, &d).await
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct EditBody {
    #[schema(value_type = Object)]
    artifact: Value,
    note: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/edit", params(("id" = String, Path, description = "delivery id")), request_body = EditBody, responses((status = 200, description = "a new artifact version, awaiting approval"), (status = 400), (status = 409)))]
async fn edit(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<EditBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let d =
        pipeline::edit(&state.pool, &state.config, who, parse_id(&id)?, &body.artifact, body.note.as_deref()).await?;
    full(&state.pool, &d).await
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ApproveBody {
    artifact_sha256: String,
    note: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/approve", params(("id" = String, Path, description = "delivery id")), request_body = ApproveBody, responses((status = 200, description = "approved"), (status = 409, description = "STALE_ARTIFACT or INVALID_TRANSITION")))]
async fn approve(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ApproveBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let d =
        pipeline::approve(&state.pool, &state.config, who, parse_id(&id)?, &body.artifact_sha256, body.note.as_deref())
            .await?;
    full(&state.pool, &d).await
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/reject", params(("id" = String, Path, description = "delivery id")), request_body = ReasonBody, responses((status = 200, description = "rejected"), (status = 409)))]
async fn reject(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ReasonBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let d = pipeline::reject(&pool, who, parse_id(&id)?, body.reason.as_deref()).await?;
    full(&pool, &d).await
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/cancel", params(("id" = String, Path, description = "delivery id")), request_body = ReasonBody, responses((status = 200, description = "cancelled"), (status = 409)))]
async fn cancel(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ReasonBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Operator)?;
    let actor = Actor::new(who.role.as_str(), who.name.clone());
    let d = pipeline::cancel(&pool, &actor, Some(who), parse_id(&id)?, body.reason.as_deref()).await?;
    full(&pool, &d).await
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    resolution: String,
    note: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/deliveries/{id}/resolve", params(("id" = String, Path, description = "delivery id")), request_body = ResolveBody, responses((status = 200, description = "settled"), (status = 409)))]
async fn resolve(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ResolveBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let resolution = Resolution::parse(&body.resolution)
        .ok_or_else(|| ApiError::validation("resolution: must be \"confirmed_sent\", \"resend\" or \"cancel\""))?;
    let d =
        pipeline::resolve(&state.pool, &state.config, who, parse_id(&id)?, resolution, body.note.as_deref()).await?;
    full(&state.pool, &d).await
}

#[utoipa::path(get, path = "/admin/v1/send-enabled", responses((status = 200, description = "the global send switch")))]
async fn get_send_enabled(State(pool): State<PgPool>, auth: Auth) -> Result<Json<store::SendSwitch>, ApiError> {
    auth.require(Role::Reviewer)?;
    Ok(Json(store::send_switch(&pool).await?))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct SwitchBody {
    enabled: bool,
    reason: Option<String>,
}

#[utoipa::path(put, path = "/admin/v1/send-enabled", request_body = SwitchBody, responses((status = 200, description = "flipped (audited)"), (status = 400)))]
async fn put_send_enabled(
    State(pool): State<PgPool>,
    auth: Auth,
    JsonBody(body): JsonBody<SwitchBody>,
) -> Result<Json<store::SendSwitch>, ApiError> {
    let who = auth.require(Role::Operator)?;
    Ok(Json(pipeline::set_send_enabled(&pool, who, body.enabled, body.reason.as_deref()).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    /// Only the entries of this action (`send_switch.set`: the switch's history).
    action: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/v1/audit", params(AuditQuery), responses((status = 200, description = "the audit log, newest first (of one action with `action`)"), (status = 400, description = "a bad limit, action or cursor")))]
async fn list_audit(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<AuditQuery>,
) -> Result<Json<Page<airlock_core::audit::Entry>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let before = match &q.cursor {
        None => None,
        Some(c) => Some(decode_cursor(c)?.parse::<i64>().map_err(|_| ApiError::validation("cursor: malformed"))?),
    };
    if let Some(a) = &q.action {
        airlock_http::printable("action", a)?;
    }
    let mut rows = airlock_core::audit::list(&pool, q.action.as_deref(), before, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|e| encode_cursor(&e.id.to_string())) } else { None };
    Ok(Json(Page { items: rows, next }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct JobsQuery {
    state: Option<String>,
    kind: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[utoipa::path(get, path = "/admin/v1/jobs", params(JobsQuery), responses((status = 200, description = "jobs and counts by kind and state")))]
async fn list_jobs(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<JobsQuery>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    if let Some(kind) = &q.kind {
        airlock_http::printable("kind", kind)?;
    }
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(JobState::parse(s).ok_or_else(|| ApiError::validation(format!("state: unknown state `{s}`")))?),
    };
    let after = match &q.cursor {
        None => None,
        Some(c) => Some(parse_id(&decode_cursor(c)?)?),
    };
    let rows = airlock_queue::list(&pool, state, q.kind.as_deref(), after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = if more { rows.last().map(|j| encode_cursor(&j.id.to_string())) } else { None };
    let counts = airlock_queue::count_by_kind_state(&pool).await?;
    Ok(Json(json!({"items": rows, "next": next, "counts": counts})))
}

#[utoipa::path(get, path = "/admin/v1/workers", responses((status = 200, description = "the fleet")))]
async fn list_workers(State(pool): State<PgPool>, auth: Auth) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let rows = airlock_queue::fleet::list(&pool).await?;
    Ok(Json(json!({"items": rows, "next": null})))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct BatchItem {
    id: String,
    artifact_sha256: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    items: Vec<BatchItem>,
    note: Option<String>,
}

/// Approves several deliveries at once, each bound to the hash its approver saw: all or
/// nothing.
#[utoipa::path(post, path = "/admin/v1/deliveries/approve", request_body = BatchBody,
    responses((status = 200, description = "all approved"), (status = 400), (status = 409, description = "none approved")))]
async fn approve_batch(
    State(state): State<AppState>,
    auth: Auth,
    JsonBody(body): JsonBody<BatchBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let items = body
        .items
        .iter()
        .map(|i| Ok((parse_id(&i.id)?, i.artifact_sha256.clone())))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let done = pipeline::approve_batch(&state.pool, &state.config, who, &items, body.note.as_deref()).await?;
    Ok(Json(json!({"items": done.iter().map(view::summary).collect::<Vec<_>>(), "next": null})))
}

/// Creates a standing grant (audited).
#[utoipa::path(post, path = "/admin/v1/grants", request_body(content = Object, description = "channel, agent_ids, recipient_domains or webhook_origins, min_score, expires_at, max_uses, reason"),
    responses((status = 201, description = "the grant"), (status = 400)))]
async fn create_grant(
    State(pool): State<PgPool>,
    auth: Auth,
    JsonBody(body): JsonBody<grants::NewGrant>,
) -> Result<(axum::http::StatusCode, Json<grants::Grant>), ApiError> {
    let who = auth.require(Role::Operator)?;
    let mut tx = pool.begin().await?;
    let g = grants::create(&mut tx, who, &body).await?;
    tx.commit().await?;
    Ok((axum::http::StatusCode::CREATED, Json(g)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct GrantsQuery {
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Grants, newest first.
#[utoipa::path(get, path = "/admin/v1/grants", params(GrantsQuery), responses((status = 200, description = "grants")))]
async fn list_grants(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<GrantsQuery>,
) -> Result<Json<Page<grants::Grant>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let before = match &q.cursor {
        None => None,
        Some(c) => Some(parse_id(&decode_cursor(c)?)?),
    };
    let mut rows = grants::list(&pool, before, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|g| encode_cursor(&g.id.to_string())) } else { None };
    Ok(Json(Page { items: rows, next }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct RevokeQuery {
    reason: Option<String>,
}

/// Revokes a grant at once (audited).
#[utoipa::path(delete, path = "/admin/v1/grants/{id}", params(("id" = String, Path, description = "grant id"), RevokeQuery),
    responses((status = 200, description = "revoked"), (status = 404), (status = 409, description = "already revoked")))]
async fn revoke_grant(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    Query(q): Query<RevokeQuery>,
) -> Result<Json<grants::Grant>, ApiError> {
    let who = auth.require(Role::Operator)?;
    if let Some(r) = &q.reason {
        airlock_http::printable("reason", r)?;
    }
    let reason = q.reason.as_deref().map(str::trim).filter(|r| !r.is_empty()).unwrap_or("revoked");
    let mut tx = pool.begin().await?;
    let g = grants::revoke(&mut tx, who, parse_id(&id)?, reason).await?;
    tx.commit().await?;
    Ok(Json(g))
}
