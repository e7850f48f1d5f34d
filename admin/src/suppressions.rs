//! The suppression routes: recipients nothing may be sent to (operator+, audited).

use airlock_core::principals::Role;
use airlock_delivery::store::suppressions::{self as store, Suppression};
use airlock_delivery::suppressions::{self, NewSuppression};
use airlock_http::{ApiError, Auth, JsonBody, Page, decode_cursor, encode_cursor, page_limit, parse_id};
use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use sqlx::PgPool;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::server::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(create_suppression, list_suppressions)).routes(routes!(lift_suppression))
}

/// A suppression to create: exactly one of `address` and `domain`, and why.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct SuppressionBody {
    /// A bare email address.
    address: Option<String>,
    /// A domain; it covers every domain under it too.
    domain: Option<String>,
    /// Why (recorded in the audit log).
    reason: Option<String>,
}

/// Suppresses an address or a domain (audited): a submission to it is refused with 409
/// `RECIPIENT_SUPPRESSED`, and an approved delivery to it fails at send time, never sent.
#[utoipa::path(post, path = "/admin/v1/suppressions", request_body = SuppressionBody,
    responses((status = 201, description = "the new suppression"),
              (status = 200, description = "the recipient was suppressed already: that suppression, unchanged"),
              (status = 400, description = "VALIDATION: not one address or domain, or no reason"),
              (status = 401, description = "UNAUTHENTICATED"), (status = 403, description = "FORBIDDEN: operator or admin only")))]
async fn create_suppression(
    State(pool): State<PgPool>,
    auth: Auth,
    JsonBody(body): JsonBody<SuppressionBody>,
) -> Result<(StatusCode, Json<Suppression>), ApiError> {
    let who = auth.require(Role::Operator)?;
    let new = NewSuppression { address: body.address, domain: body.domain, reason: body.reason };
    let (s, created) = suppressions::create(&pool, who, &new).await?;
    Ok((if created { StatusCode::CREATED } else { StatusCode::OK }, Json(s)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// Lifted suppressions too (`true`); live ones only by default.
    include_lifted: Option<bool>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Suppressions, newest first.
#[utoipa::path(get, path = "/admin/v1/suppressions", params(ListQuery),
    responses((status = 200, description = "a page of suppressions, newest first"),
              (status = 400, description = "VALIDATION: a bad limit or cursor"),
              (status = 401, description = "UNAUTHENTICATED"), (status = 403, description = "FORBIDDEN: operator or admin only")))]
async fn list_suppressions(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<ListQuery>,
) -> Result<Json<Page<Suppression>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let before = match &q.cursor {
        None => None,
        Some(c) => Some(parse_id::<uuid::Uuid>(&decode_cursor(c)?)?),
    };
    let mut rows = store::list_suppressions(&pool, q.include_lifted.unwrap_or(false), before, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|s| encode_cursor(&s.id.to_string())) } else { None };
    Ok(Json(Page { items: rows, next }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
struct LiftQuery {
    /// Why (recorded in the audit log).
    reason: Option<String>,
}

/// Lifts a suppression (audited); the row stays, with who lifted it and when.
#[utoipa::path(delete, path = "/admin/v1/suppressions/{id}", params(("id" = String, Path, description = "suppression id"), LiftQuery),
    responses((status = 200, description = "the suppression, lifted"),
              (status = 400, description = "VALIDATION: a malformed id or reason"),
              (status = 401, description = "UNAUTHENTICATED"), (status = 403, description = "FORBIDDEN: operator or admin only"),
              (status = 404, description = "NOT_FOUND: no such suppression"),
              (status = 409, description = "INVALID_TRANSITION: lifted already")))]
async fn lift_suppression(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    Query(q): Query<LiftQuery>,
) -> Result<Json<Suppression>, ApiError> {
    let who = auth.require(Role::Operator)?;
    let id: uuid::Uuid = parse_id(&id)?;
    Ok(Json(suppressions::lift(&pool, who, id, q.reason.as_deref()).await?))
}
