//! The admin HTTP service: reviewers work the queue of deliveries, operators flip the send
//! switch and watch jobs and workers. Every route checks the caller's role; every human
//! action is audited (in the same transaction as the action).

use std::sync::Arc;

use airlock_core::config::Config;
use airlock_core::delivery::pipeline::{self, Resolution};
use airlock_core::delivery::state::DeliveryState;
use airlock_core::delivery::store::{self, Actor};
use airlock_core::delivery::view;
use airlock_core::http::{ApiError, Auth, JsonBody, Page, parse_id};
use airlock_core::principals::Role;
use airlock_core::queue::JobState;
use axum::extract::{DefaultBodyLimit, FromRef, Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;

/// What every admin handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
}

/// The whole admin router.
pub fn router(state: AppState) -> Router {
    let body_limit = state.config.delivery.max_artifact_bytes + 64 * 1024;
    Router::new()
        .route("/admin/v1/deliveries", get(list_deliveries))
        .route("/admin/v1/deliveries/{id}", get(get_delivery))
        .route("/admin/v1/deliveries/{id}/accept", post(accept))
        .route("/admin/v1/deliveries/{id}/edit", post(edit))
        .route("/admin/v1/deliveries/{id}/approve", post(approve))
        .route("/admin/v1/deliveries/{id}/reject", post(reject))
        .route("/admin/v1/deliveries/{id}/resolve", post(resolve))
        .route("/admin/v1/deliveries/{id}/cancel", post(cancel))
        .route("/admin/v1/send-enabled", get(get_send_enabled).put(put_send_enabled))
        .route("/admin/v1/audit", get(list_audit))
        .route("/admin/v1/jobs", get(list_jobs))
        .route("/admin/v1/workers", get(list_workers))
        .layer(DefaultBodyLimit::max(body_limit))
        .merge(airlock_core::http::health_routes())
        .with_state(state)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    airlock_core::http::PageQuery { limit, cursor: None }.limit()
}

fn encode_cursor(s: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
}

fn decode_cursor(c: &str) -> Result<String, ApiError> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| ApiError::Validation("cursor: not a cursor this service issued".into()))
}

async fn list_deliveries(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Reviewer)?;
    let limit = page_limit(q.limit)?;
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => {
            Some(DeliveryState::parse(s).ok_or_else(|| ApiError::Validation(format!("state: unknown state `{s}`")))?)
        }
    };
    let after = match &q.cursor {
        None => None,
        Some(c) => {
            let raw = decode_cursor(c)?;
            let (at, id) = raw.split_once('|').ok_or_else(|| ApiError::Validation("cursor: malformed".into()))?;
            let at = chrono::DateTime::parse_from_rfc3339(at)
                .map_err(|_| ApiError::Validation("cursor: malformed".into()))?
                .with_timezone(&chrono::Utc);
            Some((at, parse_id(id)?))
        }
    };
    let rows = store::list(&pool, state, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = match (more, rows.last()) {
        (true, Some(last)) => Some(encode_cursor(&format!(
            "{}|{}",
            last.created_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            last.id
        ))),
        _ => None,
    };
    Ok(Json(Page { items: rows.iter().map(view::summary).collect(), next }))
}

async fn get_delivery(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Reviewer)?;
    let d = store::get(&pool, parse_id(&id)?).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(Json(view::render(&pool, &d, true).await?))
}

async fn full(pool: &PgPool, d: &store::Delivery) -> Result<Json<Value>, ApiError> {
    Ok(Json(view::render(pool, d, true).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoteBody {
    note: Option<String>,
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EditBody {
    artifact: Value,
    note: Option<String>,
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveBody {
    artifact_sha256: String,
    note: Option<String>,
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: Option<String>,
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    resolution: String,
    note: Option<String>,
}

async fn resolve(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ResolveBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let resolution = Resolution::parse(&body.resolution).ok_or_else(|| {
        ApiError::Validation("resolution: must be \"confirmed_sent\", \"resend\" or \"cancel\"".into())
    })?;
    let d =
        pipeline::resolve(&state.pool, &state.config, who, parse_id(&id)?, resolution, body.note.as_deref()).await?;
    full(&state.pool, &d).await
}

async fn get_send_enabled(State(pool): State<PgPool>, auth: Auth) -> Result<Json<store::SendSwitch>, ApiError> {
    auth.require(Role::Reviewer)?;
    Ok(Json(store::send_switch(&pool).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SwitchBody {
    enabled: bool,
    reason: Option<String>,
}

async fn put_send_enabled(
    State(pool): State<PgPool>,
    auth: Auth,
    JsonBody(body): JsonBody<SwitchBody>,
) -> Result<Json<store::SendSwitch>, ApiError> {
    let who = auth.require(Role::Operator)?;
    Ok(Json(pipeline::set_send_enabled(&pool, who, body.enabled, body.reason.as_deref()).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    limit: Option<i64>,
    cursor: Option<String>,
}

async fn list_audit(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<AuditQuery>,
) -> Result<Json<Page<airlock_core::audit::Entry>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let before = match &q.cursor {
        None => None,
        Some(c) => {
            Some(decode_cursor(c)?.parse::<i64>().map_err(|_| ApiError::Validation("cursor: malformed".into()))?)
        }
    };
    let mut rows = airlock_core::audit::list(&pool, before, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|e| encode_cursor(&e.id.to_string())) } else { None };
    Ok(Json(Page { items: rows, next }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobsQuery {
    state: Option<String>,
    kind: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

async fn list_jobs(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<JobsQuery>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(JobState::parse(s).ok_or_else(|| ApiError::Validation(format!("state: unknown state `{s}`")))?),
    };
    let after = match &q.cursor {
        None => None,
        Some(c) => Some(parse_id(&decode_cursor(c)?)?),
    };
    let rows = airlock_core::queue::list(&pool, state, q.kind.as_deref(), after, limit + 1)
        .await
        .map_err(|e| ApiError::Internal(e.into()))?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let next = if more { rows.last().map(|j| encode_cursor(&j.id.to_string())) } else { None };
    let counts = airlock_core::queue::count_by_kind_state(&pool).await.map_err(|e| ApiError::Internal(e.into()))?;
    Ok(Json(json!({"items": rows, "next": next, "counts": counts})))
}

async fn list_workers(State(pool): State<PgPool>, auth: Auth) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let rows = airlock_core::fleet::list(&pool).await?;
    Ok(Json(json!({"items": rows, "next": null})))
}
