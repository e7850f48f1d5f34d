//! HTTP pieces both services share: the error body, bearer authentication, a JSON body
//! extractor whose refusals use the error body, health routes, and list pages.
//!
//! Errors answer `{"error": {"code", "message"}}`. 5xx bodies are opaque; their cause is
//! logged once, here.

use axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(JsonBody(v)),
            Err(rej) => {
                if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    Err(ApiError::PayloadTooLarge("request body too large".into()))
                } else {
                    Err(ApiError::Validation(rej.body_text()))
                }
            }
        }
    }
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
/// current), without authentication.
pub fn health_routes<S>() -> Router<S>
where
    PgPool: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    Router::new().route("/healthz", get(|| async { Json(serde_json::json!({"status": "ok"})) })).route(
        "/readyz",
        get(|axum::extract::State(pool): axum::extract::State<PgPool>| async move {
            if crate::db::ready(&pool).await {
                (StatusCode::OK, Json(serde_json::json!({"status": "ready"})))
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "not ready"})))
            }
        }),
    )
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
            P::Queue(q) => ApiError::InvalidTransition(q.to_string()),
            P::Db(e) => ApiError::Internal(e.into()),
        }
    }
}

/// Parses an id from a path segment.
pub fn parse_id(s: &str) -> Result<uuid::Uuid, ApiError> {
    uuid::Uuid::parse_str(s).map_err(|_| ApiError::Validation(format!("`{s}` is not a UUID")))
}
