//! The node protocol over HTTP (see `airlock_capsule::protocol` for the routes).
//!
//! Every route but `/healthz` requires a valid request signature with a fresh timestamp;
//! every authenticated answer is signed back, so the coordinator can trust it. Errors are
//! `{"error": {"code", "message"}}`; a 4xx means nothing changed on this node.

use std::sync::Arc;

use airlock_capsule::AgentId;
use airlock_capsule::protocol::{
    self, AppendRequest, EpochRequest, HaveBlobsRequest, PrepareRequest, RESPONSE_METHOD, SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
};
use airlock_http::JsonBody;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{NodeError, NodeService};

/// Upper bound on the body of the calls that carry a capsule's content (a blob, or a
/// prepare with its files).
pub const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

/// Upper bound on the body of every other call (epochs, journal entries, blob lists).
pub const MAX_SMALL_BODY_BYTES: usize = 1024 * 1024;

/// The calls allowed a body up to [`MAX_BODY_BYTES`]; all others get
/// [`MAX_SMALL_BODY_BYTES`].
fn carries_content(method: &axum::http::Method, path: &str) -> bool {
    (method == axum::http::Method::PUT && path.contains("/blobs/"))
        || (method == axum::http::Method::POST && path.ends_with("/prepare"))
}

impl IntoResponse for NodeError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let message = match &self {
            NodeError::Internal(e) => {
                tracing::error!(error = ?e, "node operation failed");
                "internal error".to_string()
            }
            other => other.to_string(),
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(serde_json::json!({"error": {"code": code, "message": message}}))).into_response()
    }
}

type Svc = State<Arc<NodeService>>;

fn agent(id: &str) -> Result<AgentId, NodeError> {
    AgentId::parse(id).map_err(|e| NodeError::Validation(e.to_string()))
}

/// The node router, with authentication.
pub fn router(svc: Arc<NodeService>) -> Router {
    Router::new()
        .route("/node/v1/agents/{id}", get(status))
        .route("/node/v1/agents/{id}/freeze", post(freeze))
        .route("/node/v1/agents/{id}/propose", post(propose))
        .route("/node/v1/agents/{id}/have-blobs", post(have_blobs))
        .route("/node/v1/agents/{id}/blobs/{sha}", put(put_blob))
        .route("/node/v1/agents/{id}/prepare", post(prepare))
        .route("/node/v1/agents/{id}/activate", post(activate))
        .route("/node/v1/agents/{id}/abort", post(abort))
        .route("/node/v1/agents/{id}/retire", post(retire))
        .route("/node/v1/agents/{id}/resume", post(resume))
        .route("/node/v1/agents/{id}/journal", post(append))
        .route("/node/v1/agents/{id}/checkpoint", post(checkpoint))
        .layer(middleware::from_fn_with_state(svc.clone(), authenticate))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route("/healthz", get(|| async { Json(serde_json::json!({"status": "ok"})) }))
        .with_state(svc)
}

/// Serves the node protocol on `listener` until `shutdown` fires.
pub async fn serve(
    svc: Arc<NodeService>,
    listener: tokio::net::TcpListener,
    limits: airlock_http::ServeLimits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    airlock_http::serve(listener, router(svc), limits, shutdown).await
}

/// Checks a call's signature. The headers (present, well formed, a fresh timestamp) are
/// checked before a byte of the body is read, and the body is read only up to its call's
/// limit (small for all but the content calls), so an unsigned caller can make the node
/// neither wait for nor hold a large body.
async fn authenticate(State(svc): Svc, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
    let header = |n: &str| parts.headers.get(n).and_then(|v| v.to_str().ok());
    let refuse = |e: protocol::AuthError| {
        tracing::warn!(path = %parts.uri.path(), error = %e, "node request refused");
        // Not signed: an unauthenticated caller gets nothing it could replay.
        NodeError::Unauthenticated(e.to_string()).into_response()
    };
    let now = chrono::Utc::now().timestamp();
    let signed = match protocol::check_headers(
        header(TIMESTAMP_HEADER),
        header(SIGNATURE_HEADER),
        now,
        svc.max_skew_seconds(),
    ) {
        Ok(signed) => signed,
        Err(e) => return refuse(e),
    };
    let limit = if carries_content(&parts.method, parts.uri.path()) { MAX_BODY_BYTES } else { MAX_SMALL_BODY_BYTES };
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return NodeError::TooLarge(format!("request body over {limit} bytes")).into_response();
    }
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return NodeError::TooLarge(format!("request body over {limit} bytes")).into_response();
    };
    if let Err(e) = signed.verify(svc.secret(), parts.method.as_str(), &pq, &bytes) {
        return refuse(e);
    }
    let resp = next.run(Request::from_parts(parts, Body::from(bytes))).await;
    sign_response(&svc, &pq, resp).await
}

async fn sign_response(svc: &NodeService, pq: &str, resp: Response) -> Response {
    let (mut parts, body) = resp.into_parts();
    let bytes: Bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let ts = chrono::Utc::now().timestamp();
    let sig = protocol::sign(svc.secret(), RESPONSE_METHOD, pq, ts, &bytes);
    if let (Ok(t), Ok(s)) = (HeaderValue::from_str(&ts.to_string()), HeaderValue::from_str(&sig)) {
        parts.headers.insert(TIMESTAMP_HEADER, t);
        parts.headers.insert(SIGNATURE_HEADER, s);
    }
    Response::from_parts(parts, Body::from(bytes))
}

type Reply<T> = Result<Json<T>, NodeError>;

fn json_body<T>(b: Result<JsonBody<T>, airlock_http::ApiError>) -> Result<T, NodeError> {
    b.map(|JsonBody(v)| v).map_err(|e| NodeError::Validation(e.to_string()))
}

async fn status(State(svc): Svc, Path(id): Path<String>) -> Reply<protocol::NodeStatus> {
    Ok(Json(svc.status(&agent(&id)?).await?))
}

async fn freeze(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::FreezeReply> {
    let b = json_body(body)?;
    Ok(Json(svc.freeze(&agent(&id)?, b.epoch).await?))
}

async fn propose(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.propose(&agent(&id)?, b.epoch).await?))
}

async fn have_blobs(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<HaveBlobsRequest>, airlock_http::ApiError>,
) -> Reply<protocol::HaveBlobsReply> {
    let b = json_body(body)?;
    Ok(Json(svc.have_blobs(&agent(&id)?, b.epoch, &b.hashes).await?))
}

#[derive(Deserialize)]
struct EpochQuery {
    epoch: i64,
}

async fn put_blob(
    State(svc): Svc,
    Path((id, sha)): Path<(String, String)>,
    Query(q): Query<EpochQuery>,
    body: Bytes,
) -> Reply<()> {
    svc.put_blob(&agent(&id)?, q.epoch, &sha, &body).await?;
    Ok(Json(()))
}

async fn prepare(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<PrepareRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.prepare(&agent(&id)?, b).await?))
}

async fn activate(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.activate(&agent(&id)?, b.epoch).await?))
}

async fn abort(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.abort(&agent(&id)?, b.epoch).await?))
}

async fn retire(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.retire(&agent(&id)?, b.epoch).await?))
}

async fn resume(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<EpochRequest>, airlock_http::ApiError>,
) -> Reply<protocol::NodeStatus> {
    let b = json_body(body)?;
    Ok(Json(svc.resume(&agent(&id)?, b.epoch).await?))
}

async fn append(
    State(svc): Svc,
    Path(id): Path<String>,
    body: Result<JsonBody<AppendRequest>, airlock_http::ApiError>,
) -> Reply<serde_json::Value> {
    let b = json_body(body)?;
    Ok(Json(svc.append(&agent(&id)?, b.kind, b.data).await?))
}

async fn checkpoint(State(svc): Svc, Path(id): Path<String>) -> Reply<serde_json::Value> {
    Ok(Json(svc.checkpoint(&agent(&id)?).await?))
}
