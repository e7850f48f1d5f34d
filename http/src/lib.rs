//! airlock-http: the HTTP surface both services share, and the only crate that knows what a
//! failure's kind means in HTTP.
//!
//! A tour (one module for now, in this order): [`ApiError`] and [`status_of`] (the error
//! body, and the one table from an error kind to a status); [`JsonBody`] (a JSON body
//! extractor whose refusals use the error body); [`Auth`], [`Access`], [`RouteRule`] and
//! [`authorize`] (bearer tokens and the role table, enforced before any handler);
//! [`assemble`] and [`finish`] (router assembly with the health routes, `/metrics` and
//! `/openapi.json`); [`harden`] (security headers); [`Page`] and
//! [`PageQuery`] (list pages); [`serve`].
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

mod serve;
pub use serve::{ServeLimits, serve};

use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::metrics::Gauges;
use airlock_core::principals::{self, Principal, Role};

/// The error every handler returns: a kind (which decides the status and the code), the
/// message the caller reads, and, for a 5xx, the cause that is logged once and never shown.
#[derive(Debug)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// For `RATE_LIMITED`: sent as `Retry-After` (whole seconds, rounded up).
    pub retry_after: Option<std::time::Duration>,
    cause: Option<anyhow::Error>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The status of each kind: the one place a failure becomes HTTP.
pub fn status_of(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::Validation => StatusCode::BAD_REQUEST,
        ErrorKind::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorKind::Forbidden => StatusCode::FORBIDDEN,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::InvalidTransition
        | ErrorKind::StaleArtifact
        | ErrorKind::IdempotencyConflict
        | ErrorKind::BudgetExhausted
        | ErrorKind::StaleEpoch
        | ErrorKind::ReplayDiverged
        | ErrorKind::RecipientSuppressed => StatusCode::CONFLICT,
        ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), retry_after: None, cause: None }
    }

    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        (status_of(self.kind), self.kind.code())
    }

    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Validation, message)
    }

    pub fn unauthenticated() -> Self {
        Self::new(ErrorKind::Unauthenticated, "a valid bearer token is required")
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Forbidden, message)
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorKind::NotFound, format!("{what} not found"))
    }

    pub fn invalid_transition(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidTransition, message)
    }

    pub fn payload_too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PayloadTooLarge, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// A failure that is not the caller's: logged with its cause, answered opaquely.
    pub fn internal(cause: impl Into<anyhow::Error>) -> Self {
        Self {
            kind: ErrorKind::Internal,
            message: "internal error".into(),
            retry_after: None,
            cause: Some(cause.into()),
        }
    }
}

/// Any domain error becomes the answer its kind says; an internal one keeps its cause for
/// the log.
impl<E: DomainError> From<E> for ApiError {
    fn from(e: E) -> Self {
        let kind = e.kind();
        if kind == ErrorKind::Internal {
            return ApiError::internal(e);
        }
        Self { kind, message: e.to_string(), retry_after: e.retry_after(), cause: None }
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
        if let Some(cause) = &self.cause {
            tracing::error!(error = ?cause, "internal error");
        }
        let mut resp = (status, Json(ErrorBody { error: ErrorInner { code, message: self.message } })).into_response();
        if let Some(after) = self.retry_after {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            if let Ok(v) = axum::http::HeaderValue::from_str(&secs.max(1).to_string()) {
                resp.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
            }
        }
        resp
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
                return Err(ApiError::payload_too_large("request body too large"));
            }
            Err(rej) => return Err(ApiError::validation(rej.body_text())),
        };
        // Every request body is an object: serde would otherwise read a struct from an array.
        if !value.is_object() {
            return Err(ApiError::validation("the request body must be a JSON object"));
        }
        if let Some((path, why)) = unstorable(&value, "") {
            return Err(ApiError::validation(format!("{path}: {why}")));
        }
        serde_json::from_value(value).map(JsonBody).map_err(|e| ApiError::validation(format!("invalid body: {e}")))
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
        return Err(ApiError::validation(format!("{field}: must be printable text of at most 2000 bytes")));
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
            Err(ApiError::forbidden(format!("role {} may not do this", self.0.role.as_str())))
        }
    }

    /// Refuses unless the principal is an agent; returns its agent id.
    pub fn agent(&self) -> Result<&str, ApiError> {
        match (self.0.role, self.0.agent_id.as_deref()) {
            (Role::Agent, Some(a)) => Ok(a),
            _ => Err(ApiError::forbidden("only an agent token may use the agent API")),
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
        let header = parts.headers.get(axum::http::header::AUTHORIZATION).ok_or(ApiError::unauthenticated())?;
        let value = header.to_str().map_err(|_| ApiError::unauthenticated())?;
        let token = value.strip_prefix("Bearer ").ok_or(ApiError::unauthenticated())?.trim();
        let pool = PgPool::from_ref(state);
        match principals::authenticate(&pool, token).await {
            Ok(Some(p)) => Ok(Auth(p)),
            Ok(None) => Err(ApiError::unauthenticated()),
            Err(e) => Err(ApiError::internal(e)),
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
    if airlock_core::db::ready(&pool).await {
        (StatusCode::OK, Json(serde_json::json!({"status": "ready"})))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "not ready"})))
    }
}

/// This service's OpenAPI 3 document.
#[utoipa::path(get, path = "/openapi.json", security(()), responses((status = 200, description = "the OpenAPI document")))]
pub async fn openapi_json(axum::Extension(doc): axum::Extension<std::sync::Arc<serde_json::Value>>) -> Response {
    Json(&*doc).into_response()
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

/// Prometheus metrics of this process (queue and delivery gauges sampled at most every
/// `http.metrics_sample_seconds`).
#[utoipa::path(get, path = "/metrics", security(()), responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics_text(
    axum::extract::State(pool): axum::extract::State<PgPool>,
    axum::Extension(gauges): axum::Extension<Gauges>,
    sampling: Option<axum::Extension<MetricsSampling>>,
) -> impl IntoResponse {
    let every = sampling.map_or(MetricsSampling::default().0, |s| s.0.0);
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        airlock_core::metrics::render_sampled(&pool, gauges, every).await,
    )
}

/// How often `/metrics` samples the database's gauges (`http.metrics_sample_seconds`);
/// [`serve`] hands it to the routes.
#[derive(Debug, Clone, Copy)]
pub struct MetricsSampling(pub std::time::Duration);

impl Default for MetricsSampling {
    fn default() -> Self {
        Self(std::time::Duration::from_secs(airlock_core::config::HttpServeConfig::default().metrics_sample_seconds))
    }
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
    metrics::counter!(airlock_core::metrics::HTTP_REQUESTS, "service" => service, "method" => method, "route" => route,
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
    gauges: Gauges,
) -> (Router<S>, utoipa::openapi::OpenApi)
where
    PgPool: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    let (router, doc) = assemble(routes).split_for_parts();
    let shared = std::sync::Arc::new(complete_document(&doc));
    let router = router
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .route_layer(axum::middleware::from_fn_with_state((pool, rules), authorize))
        .route_layer(axum::middleware::from_fn_with_state(service, count_requests))
        .layer(axum::Extension(shared))
        .layer(axum::Extension(gauges));
    airlock_core::metrics::install();
    (harden(router), doc)
}

/// What every error answer of every route says, for the OpenAPI document.
fn error_description(status: &str) -> &'static str {
    match status {
        "400" => "invalid input (`VALIDATION`); nothing was written",
        "401" => "no valid bearer token (`UNAUTHENTICATED`)",
        "403" => "the token's role may not do this (`FORBIDDEN`)",
        "404" => "no such resource, or not the caller's (`NOT_FOUND`)",
        "408" => "the request took too long (`REQUEST_TIMEOUT`)",
        "409" => {
            "the state does not allow it (`INVALID_TRANSITION`, `STALE_ARTIFACT`, `IDEMPOTENCY_CONFLICT`, `BUDGET_EXHAUSTED`, `STALE_EPOCH`, `REPLAY_DIVERGED`, `RECIPIENT_SUPPRESSED`)"
        }
        "413" => "the body is over the route's limit (`PAYLOAD_TOO_LARGE`)",
        "429" => "over a rate limit (`RATE_LIMITED`); `Retry-After` says when to try again",
        "503" => "a dependency is unavailable (`UNAVAILABLE`)",
        s if s.starts_with('5') => "an internal error; the body is opaque (`INTERNAL`)",
        _ => "an error",
    }
}

/// Completes a service's OpenAPI document where the route annotations leave it to the
/// shared conventions: the error body (one shape for every route) declared once and named
/// by every 4xx and 5xx answer, a description on every answer, 401 and 403 on every
/// authenticated route, and a schema on every request body. The result is valid OpenAPI
/// 3.1 (a test runs an independent validator on both services' documents).
pub fn complete_document(doc: &utoipa::openapi::OpenApi) -> serde_json::Value {
    use serde_json::{Value, json};
    let mut v = serde_json::to_value(doc).unwrap_or_else(|_| json!({}));
    let error_ref = json!({"$ref": "#/components/schemas/ErrorBody"});
    if !v["components"].is_object() {
        v["components"] = json!({});
    }
    if !v["components"]["schemas"].is_object() {
        v["components"]["schemas"] = json!({});
    }
    v["components"]["schemas"]["ErrorBody"] = json!({
        "type": "object",
        "description": "Every error answer: a stable code and a message for people.",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "description": "SNAKE_UPPER_CODE, e.g. VALIDATION, NOT_FOUND", "examples": ["VALIDATION"]},
                "message": {"type": "string"}
            }
        }}
    });
    let public_security = json!([{}]);
    let methods = ["get", "put", "post", "delete", "patch"];
    if let Some(paths) = v["paths"].as_object_mut() {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else { continue };
            for (method, op) in item.iter_mut() {
                if !methods.contains(&method.as_str()) {
                    continue;
                }
                let public = op.get("security") == Some(&public_security);
                if let Some(body) = op.get_mut("requestBody") {
                    let has_schema =
                        body["content"].as_object().is_some_and(|c| c.values().any(|m| m.get("schema").is_some()));
                    if !has_schema {
                        body["content"] = json!({"application/json": {"schema": {"type": "object"}}});
                    }
                }
                if !op["responses"].is_object() {
                    op["responses"] = json!({});
                }
                let Some(responses) = op["responses"].as_object_mut() else { continue };
                if !public {
                    for status in ["401", "403"] {
                        responses.entry(status).or_insert_with(|| json!({}));
                    }
                }
                for (status, resp) in responses.iter_mut() {
                    let error = status.starts_with('4') || status.starts_with('5');
                    if resp.get("description").and_then(Value::as_str).is_none_or(str::is_empty) {
                        resp["description"] = Value::from(if error { error_description(status) } else { "the answer" });
                    }
                    if error && !resp["content"].is_object() {
                        resp["content"] = json!({"application/json": {"schema": error_ref.clone()}});
                    }
                }
            }
        }
    }
    v
}

/// Security headers (the request timeout is the listener's: [`serve`]). No CORS layer: browsers may not call these
/// services from another origin.
pub fn harden<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    use axum::http::{HeaderName, HeaderValue};
    use tower_http::set_header::SetResponseHeaderLayer;
    let header = |name: &'static str, value: &'static str| {
        SetResponseHeaderLayer::if_not_present(HeaderName::from_static(name), HeaderValue::from_static(value))
    };
    router
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
            Some(_) => Err(ApiError::validation("limit must be between 1 and 1000")),
        }
    }
}

/// The `limit` of a list route (default 50, at most 1000).
pub fn page_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    PageQuery { limit, cursor: None }.limit()
}

/// An opaque cursor: the position, base64url.
pub fn encode_cursor(s: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
}

/// The position inside a cursor this service issued.
pub fn decode_cursor(c: &str) -> Result<String, ApiError> {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| ApiError::validation("cursor: not a cursor this service issued"))
}

/// Reads a `(created_at, id)` cursor of a list ordered oldest first.
pub fn decode_time_cursor<Id: std::str::FromStr>(
    cursor: Option<&str>,
) -> Result<Option<(chrono::DateTime<chrono::Utc>, Id)>, ApiError> {
    let Some(c) = cursor else { return Ok(None) };
    let raw = decode_cursor(c)?;
    let (at, id) = raw.split_once('|').ok_or_else(|| ApiError::validation("cursor: malformed"))?;
    let at = chrono::DateTime::parse_from_rfc3339(at)
        .map_err(|_| ApiError::validation("cursor: malformed"))?
        .with_timezone(&chrono::Utc);
    Ok(Some((at, parse_id(id)?)))
}

/// The cursor after the last row of a full page ordered by `(created_at, id)`; `None` on
/// the last page.
pub fn next_time_cursor<Id: std::fmt::Display>(
    more: bool,
    last: Option<(chrono::DateTime<chrono::Utc>, Id)>,
) -> Option<String> {
    match (more, last) {
        (true, Some((at, id))) => {
            Some(encode_cursor(&format!("{}|{}", at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true), id)))
        }
        _ => None,
    }
}

/// Parses an id (a typed id, or a bare UUID) from a path segment or a query value.
pub fn parse_id<T: std::str::FromStr>(s: &str) -> Result<T, ApiError> {
    s.parse().map_err(|_| ApiError::validation(format!("`{s}` is not a UUID")))
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
        return ApiError::forbidden("this route has no authorization rule").into_response();
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
        return ApiError::unauthenticated().into_response();
    };
    let principal = match principals::authenticate(&pool, &token).await {
        Ok(Some(p)) => p,
        Ok(None) => return ApiError::unauthenticated().into_response(),
        Err(e) => return ApiError::internal(e).into_response(),
    };
    if !rule.access.allows(principal.role) {
        return ApiError::forbidden(format!("role {} may not call {method} {path}", principal.role.as_str()))
            .into_response();
    }
    req.extensions_mut().insert(Auth(principal));
    next.run(req).await
}
