//! A webhook receiver for tests: records every request it gets (even those it answers with
//! an error), and answers from a queue of scripted answers, then 200. An answer's body is
//! JSON (the scripted one, or `{"accepted": true, "path", "n"}`), so the receiver also
//! serves as an agent turn's declared HTTP tool.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio_util::sync::CancellationToken;

/// One request as received.
#[derive(Debug, Clone)]
pub struct Hit {
    pub path: String,
    pub idempotency_key: Option<String>,
    pub signature: Option<String>,
    /// The Standard Webhooks headers, as received.
    pub webhook_id: Option<String>,
    pub webhook_timestamp: Option<String>,
    pub webhook_signature: Option<String>,
    pub body: Vec<u8>,
    pub answered: u16,
}

#[derive(Default)]
struct Shared {
    hits: Vec<Hit>,
    script: VecDeque<(u16, Option<serde_json::Value>)>,
}

/// A running receiver on 127.0.0.1; stops when dropped.
pub struct WebhookReceiver {
    addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    stop: CancellationToken,
}

impl WebhookReceiver {
    pub async fn start() -> anyhow::Result<Self> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let app = Router::new().route("/{*path}", post(receive)).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(async move { s.cancelled().await }).await;
        });
        Ok(Self { addr, shared, stop })
    }

    /// `http://127.0.0.1:PORT`
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Statuses to answer the next requests with, in order.
    pub fn push_statuses(&self, statuses: impl IntoIterator<Item = u16>) {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).script.extend(statuses.into_iter().map(|s| (s, None)));
    }

    /// An answer with this status and JSON body for the next request.
    pub fn push_json(&self, status: u16, body: serde_json::Value) {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).script.push_back((status, Some(body)));
    }

    pub fn hits(&self) -> Vec<Hit> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).hits.clone()
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn receive(
    State(shared): State<Arc<Mutex<Shared>>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
    let (status, reply) = s.script.pop_front().unwrap_or((200, None));
    let n = s.hits.len() + 1;
    let reply = reply.unwrap_or_else(|| serde_json::json!({"accepted": true, "path": uri.path(), "n": n}));
    s.hits.push(Hit {
        path: uri.path().to_string(),
        idempotency_key: header("idempotency-key"),
        signature: header("airlock-signature"),
        webhook_id: header("webhook-id"),
        webhook_timestamp: header("webhook-timestamp"),
        webhook_signature: header("webhook-signature"),
        body: body.to_vec(),
        answered: status,
    });
    (StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), axum::Json(reply))
}
