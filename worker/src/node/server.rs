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

/// Upper bound on one request body (a blob, or a prepare with its files).
pub const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

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
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    airlock_http::serve(listener, router(svc), shutdown).await
}

async fn authenticate(State(svc): Svc, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return NodeError::Validation("request body too large".into()).into_response();
    };
    let header = |n: &str| parts.headers.get(n).and_then(|v| v.to_str().ok());
    let now = chrono::Utc::now().timestamp();
    if let Err(e) = protocol::check(
        svc.secret(),
        parts.method.as_str(),
        &pq,
        header(TIMESTAMP_HEADER),
        header(SIGNATURE_HEADER),
        &bytes,
        now,
        svc.max_skew_seconds(),
    ) {
        tracing::warn!(path = %parts.uri.path(), error = %e, "node request refused");
        // Not signed: an unauthenticated caller gets nothing it could replay.
        return NodeError::Unauthenticated(e.to_string()).into_response();
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
