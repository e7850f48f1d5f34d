//! HTTP pieces both services share: the error body, bearer authentication, a JSON body
//! extractor whose refusals use the error body, health routes, and list pages.
//!
//! Errors answer `{"error": {"code", "message"}}`. 5xx bodies are opaque; their cause is
//! logged once, here.

use axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

use crate::principals::{self, Principal, Role};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Validation(String),
    #[error("a valid bearer token is required")]
    Unauthenticated,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    InvalidTransition(String),
    #[error("{0}")]
    StaleArtifact(String),
    #[error("{0}")]
    IdempotencyConflict(String),
    #[error("{0}")]
    BudgetExhausted(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl ApiError {
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Validation(_) => (StatusCode::BAD_REQUEST, "VALIDATION"),
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "UNAUTHENTICATED"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "FORBIDDEN"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "NOT_FOUND"),
            ApiError::InvalidTransition(_) => (StatusCode::CONFLICT, "INVALID_TRANSITION"),
            ApiError::StaleArtifact(_) => (StatusCode::CONFLICT, "STALE_ARTIFACT"),
            ApiError::IdempotencyConflict(_) => (StatusCode::CONFLICT, "IDEMPOTENCY_CONFLICT"),
            ApiError::BudgetExhausted(_) => (StatusCode::CONFLICT, "BUDGET_EXHAUSTED"),
            ApiError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL"),
        }
    }

    pub fn not_found(what: &str) -> Self {
        ApiError::NotFound(format!("{what} not found"))
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Internal(e.into())
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInner<'a>,
}
#[derive(Serialize)]
struct ErrorInner<'a> {
    code: &'a str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let message = match &self {
            ApiError::Internal(e) => {
                tracing::error!(error = ?e, "internal error");
                "internal error".to_string()
            }
            other => other.to_string(),
        };
        (status, Json(ErrorBody { error: ErrorInner { code, message } })).into_response()
    }
}

/// A JSON body. Malformed JSON, a wrong content type, unknown fields and wrong types are
/// all `400 VALIDATION`; a body over the route's limit is `413 PAYLOAD_TOO_LARGE`.
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let value = match Json::<serde_json::Value>::from_request(req, state).await {
            Ok(Json(v)) => v,
            Err(rej) if rej.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(ApiError::PayloadTooLarge("request body too large".into()));
            }
            Err(rej) => return Err(ApiError::Validation(rej.body_text())),
        };
        // Every request body is an object: serde would otherwise read a struct from an array.
        if !value.is_object() {
            return Err(ApiError::Validation("the request body must be a JSON object".into()));
        }
        if let Some((path, why)) = unstorable(&value, "") {
            return Err(ApiError::Validation(format!("{path}: {why}")));
        }
        serde_json::from_value(value).map(JsonBody).map_err(|e| ApiError::Validation(format!("invalid body: {e}")))
    }
}

/// The largest magnitude a JSON number may have: Postgres stores numbers exactly, and one
/// near the edge of a double would not read back.
pub const MAX_JSON_NUMBER: f64 = 1e300;

/// The path of the first value Postgres cannot store and give back as it came: a string or
/// key holding a NUL character, or a number too large for a double once normalised.
pub fn unstorable(v: &serde_json::Value, at: &str) -> Option<(String, &'static str)> {
    let here = || if at.is_empty() { "body".to_string() } else { at.to_string() };
    match v {
        serde_json::Value::String(s) if s.contains('\0') => Some((here(), "text may not contain NUL characters")),
        serde_json::Value::Number(n) if n.as_f64().is_some_and(|f| !f.is_finite() || f.abs() > MAX_JSON_NUMBER) => {
            Some((here(), "number out of range"))
        }
        serde_json::Value::Array(items) => {
            items.iter().enumerate().find_map(|(i, item)| unstorable(item, &format!("{at}[{i}]")))
        }
        serde_json::Value::Object(map) => map.iter().find_map(|(k, item)| {
            let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
            if k.contains('\0') { Some((path, "keys may not contain NUL characters")) } else { unstorable(item, &path) }
        }),
        _ => None,
    }
}

/// Refuses a query value that is not printable text.
pub fn printable(field: &str, v: &str) -> Result<(), ApiError> {
    if v.chars().any(char::is_control) || v.len() > 2000 {
        return Err(ApiError::Validation(format!("{field}: must be printable text of at most 2000 bytes")));
    }
    Ok(())
}

/// The principal behind the request's bearer token.
#[derive(Debug, Clone)]
pub struct Auth(pub Principal);

impl Auth {
    /// Refuses unless the principal's role includes `role`.
    pub fn require(&self, role: Role) -> Result<&Principal, ApiError> {
        if self.0.role.at_least(role) {
            Ok(&self.0)
        } else {
            Err(ApiError::Forbidden(format!("role {} may not do this", self.0.role.as_str())))
        }
    }

    /// Refuses unless the principal is an agent; returns its agent id.
    pub fn agent(&self) -> Result<&str, ApiError> {
        match (self.0.role, self.0.agent_id.as_deref()) {
            (Role::Agent, Some(a)) => Ok(a),
            _ => Err(ApiError::Forbidden("only an agent token may use the agent API".into())),
        }
    }
}

impl<S> FromRequestParts<S> for Auth
where
    PgPool: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        // Already authenticated by the authorization layer.
        if let Some(auth) = parts.extensions.get::<Auth>() {
            return Ok(auth.clone());
        }
        let header = parts.headers.get(axum::http::header::AUTHORIZATION).ok_or(ApiError::Unauthenticated)?;
        let value = header.to_str().map_err(|_| ApiError::Unauthenticated)?;
        let token = value.strip_prefix("Bearer ").ok_or(ApiError::Unauthenticated)?.trim();
        let pool = PgPool::from_ref(state);
        match principals::authenticate(&pool, token).await {
            Ok(Some(p)) => Ok(Auth(p)),
            Ok(None) => Err(ApiError::Unauthenticated),
            Err(e) => Err(ApiError::Internal(e.into())),
        }
    }
}

/// `/healthz` (the process answers) and `/readyz` (the database answers and the schema is
/// current), without authentication, documented.
pub fn health_routes<S>() -> utoipa_axum::router::OpenApiRouter<S>
where
    PgPool: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    utoipa_axum::router::OpenApiRouter::new().routes(utoipa_axum::routes!(healthz)).routes(utoipa_axum::routes!(readyz))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", security(()), responses((status = 200, description = "up")))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

/// The database answers and every migration is applied.
#[utoipa::path(get, path = "/readyz", security(()), responses((status = 200, description = "ready"), (status = 503, description = "not ready")))]
pub async fn readyz(axum::extract::State(pool): axum::extract::State<PgPool>) -> (StatusCode, Json<serde_json::Value>) {
    if crate::db::ready(&pool).await {
        (StatusCode::OK, Json(serde_json::json!({"status": "ready"})))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "not ready"})))
    }
}

/// This service's OpenAPI 3 document.
#[utoipa::path(get, path = "/openapi.json", security(()), responses((status = 200, description = "the OpenAPI document")))]
pub async fn openapi_json(
    axum::Extension(doc): axum::Extension<std::sync::Arc<utoipa::openapi::OpenApi>>,
) -> Json<utoipa::openapi::OpenApi> {
    Json((*doc).clone())
}

/// Declares the bearer scheme every non-public route uses.
pub struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("opaque").build()),
        );
    }
}

/// A service's documented routes plus the common ones (health checks, `/metrics`,
/// `/openapi.json`).
pub fn assemble<S>(routes: utoipa_axum::router::OpenApiRouter<S>) -> utoipa_axum::router::OpenApiRouter<S>
where
    PgPool: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    routes.merge(health_routes()).routes(utoipa_axum::routes!(metrics_text)).routes(utoipa_axum::routes!(openapi_json))
}

/// Prometheus metrics of this process (queue and delivery gauges sampled now).
#[utoipa::path(get, path = "/metrics", security(()), responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics_text(axum::extract::State(pool): axum::extract::State<PgPool>) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        crate::metrics::render(&pool).await,
    )
}

/// Counts requests by service, method, matched route and status.
pub async fn count_requests(
    axum::extract::State(service): axum::extract::State<&'static str>,
    matched: Option<axum::extract::MatchedPath>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().as_str().to_string();
    let route = matched.map(|m| m.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let resp = next.run(req).await;
    metrics::counter!(crate::metrics::HTTP_REQUESTS, "service" => service, "method" => method, "route" => route,
        "status" => resp.status().as_u16().to_string())
    .increment(1);
    resp
}

/// Finishes a service: its OpenAPI document served at `/openapi.json`, the authorization
/// table enforced on every route, and the hardening layers (request timeout, security
/// headers, no CORS). Returns the router and the document.
pub fn finish<S>(
    service: &'static str,
    routes: utoipa_axum::router::OpenApiRouter<S>,
    pool: PgPool,
    rules: &'static [RouteRule],
    body_limit: usize,
) -> (Router<S>, utoipa::openapi::OpenApi)
where
    PgPool: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    let (router, doc) = assemble(routes).split_for_parts();
    let shared = std::sync::Arc::new(doc.clone());
    let router = router
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .route_layer(axum::middleware::from_fn_with_state((pool, rules), authorize))
        .route_layer(axum::middleware::from_fn_with_state(service, count_requests))
        .layer(axum::Extension(shared));
    crate::metrics::install();
    (harden(router), doc)
}

/// Request timeout and security headers. No CORS layer: browsers may not call these
/// services from another origin.
pub fn harden<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    use axum::http::{HeaderName, HeaderValue};
    use tower_http::set_header::SetResponseHeaderLayer;
    let header = |name: &'static str, value: &'static str| {
        SetResponseHeaderLayer::if_not_present(HeaderName::from_static(name), HeaderValue::from_static(value))
    };
    router
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            std::time::Duration::from_secs(30),
        ))
        .layer(header("x-content-type-options", "nosniff"))
        .layer(header("x-frame-options", "DENY"))
        .layer(header("referrer-policy", "no-referrer"))
        .layer(header("cache-control", "no-store"))
        .layer(header(
            "content-security-policy",
            "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ))
}

/// One page of a list route.
#[derive(Debug, Serialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<String>,
}

/// `limit` (default 50, at most 1000) and `cursor` of a list route.
#[derive(Debug, Clone, serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    pub limit: Option<i64>,
    pub cursor: Option<String>,
}

impl PageQuery {
    pub fn limit(&self) -> Result<i64, ApiError> {
        match self.limit {
            None => Ok(50),
            Some(n) if (1..=1000).contains(&n) => Ok(n),
            Some(_) => Err(ApiError::Validation("limit must be between 1 and 1000".into())),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}

/// A token that fires on SIGTERM or SIGINT; every binary's root shutdown signal.
pub fn shutdown_on_signals() -> std::io::Result<tokio_util::sync::CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = tokio_util::sync::CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
}

impl From<crate::delivery::pipeline::PipelineError> for ApiError {
    fn from(e: crate::delivery::pipeline::PipelineError) -> Self {
        use crate::delivery::pipeline::PipelineError as P;
        match e {
            P::Validation(v) if v.too_large() => ApiError::PayloadTooLarge(v.to_string()),
            P::Validation(v) => ApiError::Validation(v.to_string()),
            P::Invalid(m) => ApiError::Validation(m),
            P::NotFound(what) => ApiError::not_found(what),
            e @ P::InvalidTransition(_) => ApiError::InvalidTransition(e.to_string()),
            e @ P::StaleArtifact { .. } => ApiError::StaleArtifact(e.to_string()),
            e @ P::IdempotencyConflict { .. } => ApiError::IdempotencyConflict(e.to_string()),
            e @ P::BudgetExhausted => ApiError::BudgetExhausted(e.to_string()),
            P::Forbidden(m) => ApiError::Forbidden(m),
            P::Queue(q) => ApiError::InvalidTransition(q.to_string()),
            P::Db(e) => ApiError::Internal(e.into()),
        }
    }
}

/// Parses an id from a path segment.
pub fn parse_id(s: &str) -> Result<uuid::Uuid, ApiError> {
    uuid::Uuid::parse_str(s).map_err(|_| ApiError::Validation(format!("`{s}` is not a UUID")))
}

/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token needed (health checks, metrics, the OpenAPI document, the web page shell).
    Public,
    /// Only an agent token (the agent API).
    Agent,
    /// A human principal whose role includes this one.
    AtLeast(Role),
}

impl Access {
    /// Whether a principal of `role` passes.
    pub fn allows(self, role: Role) -> bool {
        match self {
            Access::Public => true,
            Access::Agent => role == Role::Agent,
            Access::AtLeast(r) => role.at_least(r),
        }
    }
}

/// One line of a service's authorization table.
#[derive(Debug, Clone, Copy)]
pub struct RouteRule {
    pub method: &'static str,
    /// The route as the router declares it (`/v1/runs/{id}`).
    pub path: &'static str,
    pub access: Access,
}

/// Enforces a service's authorization table before any handler runs: authenticates the
/// bearer token (401), checks the role (403), and hands the principal to the handler.
/// A route missing from the table is refused (fail closed).
pub async fn authorize(
    axum::extract::State((pool, rules)): axum::extract::State<(PgPool, &'static [RouteRule])>,
    matched: Option<axum::extract::MatchedPath>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().as_str().to_string();
    let Some(path) = matched.as_ref().map(|m| m.as_str().to_string()) else {
        return ApiError::not_found("route").into_response();
    };
    let Some(rule) = rules.iter().find(|r| r.method == method && r.path == path) else {
        tracing::error!(method, path, "route missing from the authorization table: refused");
        return ApiError::Forbidden("this route has no authorization rule".into()).into_response();
    };
    if rule.access == Access::Public {
        return next.run(req).await;
    }
    let token = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    let Some(token) = token else {
        return ApiError::Unauthenticated.into_response();
    };
    let principal = match principals::authenticate(&pool, &token).await {
        Ok(Some(p)) => p,
        Ok(None) => return ApiError::Unauthenticated.into_response(),
        Err(e) => return ApiError::Internal(e.into()).into_response(),
    };
    if !rule.access.allows(principal.role) {
        return ApiError::Forbidden(format!("role {} may not call {method} {path}", principal.role.as_str()))
            .into_response();
    }
    req.extensions_mut().insert(Auth(principal));
    next.run(req).await
}
