//! A scripted OpenAI-compatible server on loopback, for the suites that drive a model:
//! `POST /v1/chat/completions` answers from a queue of scripted replies (a completion's
//! text, a status, a hang), then from a responder function, and records every request.
//! A test double of a model's answers, not of airlock: everything between is real HTTP.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A completion whose assistant message is this text, with this usage.
    Content { text: String, prompt_tokens: i64, completion_tokens: i64 },
    /// A completion whose message also carries the model's private reasoning
    /// (`reasoning_content`, as llama.cpp's server sends it).
    Reasoned { text: String, reasoning: String },
    /// An HTTP status with no completion.
    Status(u16),
    /// No answer for this long, then a completion of `{"type":"final","text":"late"}`.
    Hang(Duration),
}

impl Reply {
    /// A completion of `text` spending 10 prompt and 5 completion tokens.
    pub fn text(text: impl Into<String>) -> Self {
        Reply::Content { text: text.into(), prompt_tokens: 10, completion_tokens: 5 }
    }

    /// A completion whose text is `action` as JSON.
    pub fn action(action: Value) -> Self {
        Reply::text(action.to_string())
    }
}

type Responder = Arc<dyn Fn(&Value) -> Reply + Send + Sync>;

#[derive(Default)]
struct Shared {
    script: VecDeque<Reply>,
    responder: Option<Responder>,
    requests: Vec<Value>,
}

/// A running server on 127.0.0.1; stops when dropped.
pub struct ModelServer {
    addr: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    stop: CancellationToken,
}

impl ModelServer {
    pub async fn start() -> anyhow::Result<Self> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let app = Router::new().route("/v1/chat/completions", post(complete)).with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(async move { s.cancelled().await }).await;
        });
        Ok(Self { addr, shared, stop })
    }

    /// `http://127.0.0.1:PORT`, as a model's endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replies to the next requests, in order.
    pub fn push(&self, replies: impl IntoIterator<Item = Reply>) {
        self.lock().script.extend(replies);
    }

    /// How to answer once the scripted replies are used up.
    pub fn respond_with(&self, f: impl Fn(&Value) -> Reply + Send + Sync + 'static) {
        self.lock().responder = Some(Arc::new(f));
    }

    /// Every request received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.lock().requests.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn complete(State(shared): State<Arc<Mutex<Shared>>>, Json(req): Json<Value>) -> Response {
    let reply = {
        let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
        s.requests.push(req.clone());
        match s.script.pop_front() {
            Some(r) => r,
            None => match &s.responder {
                Some(f) => f(&req),
                None => Reply::Status(503),
            },
        }
    };
    match reply {
        Reply::Status(code) => StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR).into_response(),
        Reply::Hang(d) => {
            tokio::time::sleep(d).await;
            Json(completion(&req, r#"{"type":"final","text":"late"}"#, 1, 1)).into_response()
        }
        Reply::Content { text, prompt_tokens, completion_tokens } => {
            Json(completion(&req, &text, prompt_tokens, completion_tokens)).into_response()
        }
        Reply::Reasoned { text, reasoning } => {
            let mut c = completion(&req, &text, 10, 5);
            c["choices"][0]["message"]["reasoning_content"] = Value::String(reasoning);
            Json(c).into_response()
        }
    }
}

fn completion(req: &Value, text: &str, prompt: i64, completion: i64) -> Value {
    json!({
        "id": "chatcmpl-test", "object": "chat.completion", "model": req["model"],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    })
}
