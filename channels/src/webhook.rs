//! Webhook calls: an HTTPS POST of the artifact's JSON body to an allow-listed origin, with
//! an `Idempotency-Key` that is the same on every retry and an `Airlock-Signature` HMAC.
//!
//! 2xx is delivered. 408, 429, 5xx, timeouts and connection errors are retried with the
//! same key (the receiver deduplicates); any other status is permanent. Redirects are not
//! followed (a redirect could leave the allow-list) and no ambient proxy is used.

use std::time::Duration;

use crate::EffectOutcome;
use airlock_core::secret::Secret;
use airlock_delivery::artifact::WebhookArtifact;
use airlock_delivery::policy;

#[derive(Debug, thiserror::Error)]
pub enum WebhookSetupError {
    #[error("delivery.webhook_secret_env: the variable {0} holding the webhook signing secret is not set")]
    MissingSecret(String),
    #[error("webhook client: {0}")]
    Client(String),
}

#[derive(Clone)]
pub struct WebhookSender {
    client: reqwest::Client,
    secret: Secret,
}

impl std::fmt::Debug for WebhookSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSender")
    }
}

impl WebhookSender {
    pub fn new(secret: Secret, timeout: Duration) -> Result<Self, WebhookSetupError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent(concat!("airlock/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| WebhookSetupError::Client(e.to_string()))?;
        Ok(Self { client, secret })
    }

    /// Posts the call once.
    pub async fn send(&self, hook: &WebhookArtifact, idempotency_key: &str) -> EffectOutcome {
        let body = match serde_json::to_vec(&hook.body) {
            Ok(b) => b,
            Err(e) => return EffectOutcome::Permanent { detail: format!("body: {e}") },
        };
        let t = chrono::Utc::now().timestamp();
        let signature = policy::webhook_signature(self.secret.expose().as_bytes(), t, &body);
        let mut req = self
            .client
            .post(&hook.url)
            .header("content-type", "application/json")
            .header("idempotency-key", idempotency_key)
            .header("airlock-signature", signature);
        for (k, v) in &hook.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        match req.body(body).send().await {
            Ok(resp) => {
                let status = resp.status();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(|s| Duration::from_secs(s.min(3600)));
                let text = resp.text().await.unwrap_or_default();
                let text: String = text.chars().take(500).collect();
                let detail = format!("{} {}", status.as_u16(), text.trim());
                if status.is_success() {
                    EffectOutcome::Sent { message_id: None, response: detail }
                } else if status.as_u16() == 408 || status.as_u16() == 429 || status.is_server_error() {
                    EffectOutcome::NotDelivered { detail, retry_after }
                } else {
                    EffectOutcome::Permanent { detail }
                }
            }
            // Timeouts and lost connections: the receiver may or may not have it, but the
            // key makes a retry safe.
            Err(e) => EffectOutcome::NotDelivered { detail: format!("request failed: {e}"), retry_after: None },
        }
    }
}

/// Most bytes of a declared tool's answer that are read.
pub const MAX_TOOL_REPLY_BYTES: usize = 1024 * 1024;

impl WebhookSender {
    /// Calls an agent turn's declared tool: a POST of `body` signed as a webhook, with the
    /// call's `Idempotency-Key`. A 2xx JSON answer is the result; anything else is an
    /// error saying what came back (never the URL).
    pub async fn call_json(
        &self,
        url: &str,
        body: &serde_json::Value,
        idempotency_key: &str,
    ) -> Result<serde_json::Value, String> {
        let raw = serde_json::to_vec(body).map_err(|e| format!("arguments: {e}"))?;
        let t = chrono::Utc::now().timestamp();
        let signature = policy::webhook_signature(self.secret.expose().as_bytes(), t, &raw);
        let resp = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("idempotency-key", idempotency_key)
            .header("airlock-signature", signature)
            .body(raw)
            .send()
            .await
            .map_err(|e| format!("the tool did not answer: {}", e.without_url()))?;
        let status = resp.status();
        let mut resp = resp;
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("the answer broke off: {}", e.without_url()))? {
            if bytes.len() + chunk.len() > MAX_TOOL_REPLY_BYTES {
                return Err(format!("the answer is larger than {MAX_TOOL_REPLY_BYTES} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            let text: String = String::from_utf8_lossy(&bytes).chars().take(300).collect();
            return Err(format!("the tool answered {}: {}", status.as_u16(), text.trim()));
        }
        serde_json::from_slice(&bytes).map_err(|_| "the tool's answer is not JSON".to_string())
    }
}
