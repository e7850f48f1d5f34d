//! The Model Context Protocol at `/mcp` (streamable HTTP): the agent API as tools.
//!
//! `POST /mcp` is an agent route like the others: the authorization table admits only an
//! agent's bearer token (401 without one), and the request passes the same hardening
//! (timeout, headers) and a body limit. Each tool call is then the wrapped route's own
//! request, made in process to the agent routes with the principal the token named, so
//! the answer is the route's JSON and an agent sees only its own runs, deliveries and
//! tasks, exactly as over HTTP.
//!
//! The server is stateless: every POST is answered on its own with a JSON body (no session
//! to keep, no stream held open past the request timeout), so any instance of the service
//! can answer any request.

use std::convert::Infallible;
use std::sync::Arc;

use airlock_http::Auth;
use airlock_mcp::server::error_body;
use airlock_mcp::{AgentApi, AgentTools, Answer, Method, RouteCall};
use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use rmcp::model::Extensions;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::Value;
use tower::ServiceExt;

/// The MCP service behind `/mcp`.
pub type McpService = StreamableHttpService<AgentTools<InProcess>, NeverSessionManager>;

/// The agent routes called in process, as the principal of the `/mcp` request.
pub struct InProcess {
    /// The documented agent routes with their state, without the authorization layer:
    /// the principal comes from the `/mcp` request, already authenticated as an agent.
    routes: Router,
    /// The largest answer read back (an answer is at most a delivery's view).
    answer_limit: usize,
}

impl AgentApi for InProcess {
    async fn call(&self, extensions: &Extensions, call: RouteCall) -> Result<Answer, String> {
        // The authorization layer put the principal on the HTTP request; without one, no
        // route is called.
        let Some(auth) = extensions.get::<Parts>().and_then(|p| p.extensions.get::<Auth>()).cloned() else {
            return Ok(Answer { status: 401, body: error_body("UNAUTHENTICATED", "a valid bearer token is required") });
        };
        let method = match call.method {
            Method::Get => axum::http::Method::GET,
            Method::Post => axum::http::Method::POST,
        };
        let mut req = Request::builder().method(method).uri(&call.path);
        let body = match &call.body {
            Some(v) => {
                req = req.header(CONTENT_TYPE, "application/json");
                Body::from(serde_json::to_vec(v).map_err(|e| e.to_string())?)
            }
            None => Body::empty(),
        };
        let mut req = req.body(body).map_err(|e| format!("route request: {e}"))?;
        req.extensions_mut().insert(auth);
        let resp = match self.routes.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), self.answer_limit)
            .await
            .map_err(|e| format!("route answer: {e}"))?;
        Ok(Answer { status, body: serde_json::from_slice(&bytes).unwrap_or(Value::Null) })
    }
}

/// The MCP service over `routes` (the agent routes with their state). `body_limit` bounds
/// a JSON-RPC message as the routes bound their bodies (larger is 413).
pub fn service(routes: Router, body_limit: usize) -> McpService {
    let tools = AgentTools::new(Arc::new(InProcess { routes, answer_limit: 16 * 1024 * 1024 }));
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_max_request_body_bytes(body_limit)
        // The Host check guards servers that trust whoever reaches them; this one trusts
        // only a bearer token (a page a browser was lured to cannot hold one), and it
        // listens where `api.listen` says, under any name.
        .disable_allowed_hosts();
    StreamableHttpService::new(move || Ok(tools.clone()), Arc::new(NeverSessionManager::default()), config)
}

/// The Model Context Protocol over streamable HTTP: one JSON-RPC message per POST, answered
/// with JSON. The tools are the agent API's (`tools/list` names them); an agent's token.
#[utoipa::path(post, path = "/mcp",
    request_body(content = Object, description = "one JSON-RPC 2.0 message of the Model Context Protocol \
        (`Accept: application/json, text/event-stream`)"),
    responses((status = 200, description = "the JSON-RPC answer"), (status = 202, description = "a notification, accepted"),
        (status = 400, description = "not a JSON-RPC message"), (status = 401, description = "no valid token"),
        (status = 403, description = "not an agent token"), (status = 406, description = "the Accept header does not allow JSON and SSE"),
        (status = 413, description = "too large"), (status = 415, description = "not JSON")))]
pub async fn mcp(axum::Extension(service): axum::Extension<McpService>, req: Request) -> Response {
    let resp: Result<_, Infallible> = service.oneshot(req).await;
    match resp {
        Ok(r) => r.map(Body::new).into_response(),
        Err(never) => match never {},
    }
}

/// No standing event stream: every answer is the POST's own (405, as MCP says of a server
/// that offers none).
#[utoipa::path(get, path = "/mcp",
    responses((status = 405, description = "no standing event stream: POST each message"),
        (status = 401, description = "no valid token"), (status = 403, description = "not an agent token")))]
pub async fn mcp_stream() -> Response {
    method_not_allowed()
}

/// No session to end: the server keeps none (405, as MCP says of a server that does not
/// let clients end sessions).
#[utoipa::path(delete, path = "/mcp",
    responses((status = 405, description = "no session to end"),
        (status = 401, description = "no valid token"), (status = 403, description = "not an agent token")))]
pub async fn mcp_end() -> Response {
    method_not_allowed()
}

fn method_not_allowed() -> Response {
    (axum::http::StatusCode::METHOD_NOT_ALLOWED, [(axum::http::header::ALLOW, "POST")]).into_response()
}
