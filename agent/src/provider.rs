//! The client of an OpenAI-compatible server on loopback: `POST /v1/chat/completions`.
//!
//! Only the endpoint the configuration names (checked canonical loopback at load): no
//! ambient proxy, no redirects, no cookies, no implicit authentication, a timeout per call,
//! and a capped reply. Any failure — a refused connection, a timeout, a non-2xx, a reply
//! that is not a completion — is [`ProviderError::Unavailable`]: a turn ends
//! `model_unavailable`, never silently falling back to another model.

use std::time::Duration;

use airlock_core::config::models::{Endpoint, ModelConfig, StructuredOutput};
use serde::Serialize;
use serde_json::{Value, json};

/// The largest reply read from a model server.
pub const MAX_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// What a completion spent, as the server reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenUsage {
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub total_tokens: i64,
}

/// One completion: the assistant's text, what it spent, and the server's reply as it came.
#[derive(Debug, Clone)]
pub struct Completion {
    pub content: String,
    pub usage: TokenUsage,
    pub raw: Value,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    #[error("the model is unavailable: {0}")]
    Unavailable(String),
}

/// A model's client.
#[derive(Clone)]
pub struct Provider {
    http: reqwest::Client,
    endpoint: Endpoint,
    model: String,
    structured: StructuredOutput,
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider").field("endpoint", &self.endpoint).field("model", &self.model).finish()
    }
}

impl Provider {
    /// The client of a configured model.
    pub fn new(cfg: &ModelConfig) -> Result<Self, ProviderError> {
        let endpoint = Endpoint::parse(&cfg.endpoint).map_err(ProviderError::Unavailable)?;
        Self::with(endpoint, &cfg.model, Duration::from_secs(cfg.timeout_seconds), cfg.structured_output)
    }

    /// The client of `model` at `endpoint` (already checked).
    pub fn with(
        endpoint: Endpoint,
        model: &str,
        timeout: Duration,
        structured: StructuredOutput,
    ) -> Result<Self, ProviderError> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| ProviderError::Unavailable(format!("client: {}", e.without_url())))?;
        Ok(Self { http, endpoint, model: model.into(), structured })
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    /// The request body of a completion: the messages, and the action's JSON schema in the
    /// server's dialect when the model is configured to constrain its decoding.
    pub fn request(&self, messages: &[Message], schema: Option<&Value>) -> Value {
        let mut body = json!({"model": self.model, "messages": messages, "temperature": 0, "stream": false});
        if let Some(schema) = schema {
            match self.structured {
                StructuredOutput::None => {}
                StructuredOutput::JsonSchema => {
                    body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "action", "strict": true, "schema": schema}});
                }
                StructuredOutput::JsonObject => {
                    body["response_format"] = json!({"type": "json_object", "schema": schema});
                }
            }
        }
        body
    }

    /// Sends a request body (as [`Provider::request`] makes it) and reads the completion.
    pub async fn complete(&self, body: &Value) -> Result<Completion, ProviderError> {
        let unavailable = |what: String| ProviderError::Unavailable(what);
        let mut resp = self
            .http
            .post(self.endpoint.completions_url())
            .json(body)
            .send()
            .await
            .map_err(|e| unavailable(describe(e)))?;
        let status = resp.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| unavailable(describe(e)))? {
            if bytes.len() + chunk.len() > MAX_REPLY_BYTES {
                return Err(unavailable(format!("the reply is larger than {MAX_REPLY_BYTES} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            return Err(unavailable(format!("the server answered {}", status.as_u16())));
        }
        let raw: Value = serde_json::from_slice(&bytes).map_err(|_| unavailable("the reply is not JSON".into()))?;
        let content = raw["choices"][0]["message"]["content"]
            .as_str()
            .ok_or_else(|| unavailable("the reply has no choices[0].message.content".into()))?
            .to_string();
        let n = |k: &str| raw["usage"][k].as_i64().unwrap_or(0).max(0);
        let usage = TokenUsage {
            prompt_tokens: n("prompt_tokens"),
            completion_tokens: n("completion_tokens"),
            total_tokens: match n("total_tokens") {
                0 => n("prompt_tokens") + n("completion_tokens"),
                t => t,
            },
        };
        Ok(Completion { content, usage, raw })
    }
}

/// A transport error, without the URL (no query could leak) and with what kind it was.
fn describe(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection refused or failed"
    } else if e.is_redirect() {
        "redirected (redirects are not followed)"
    } else {
        "request failed"
    };
    format!("{kind}: {}", e.without_url())
}
