//! Webhook calls: an HTTPS POST of the artifact's JSON body to an allow-listed origin, with
//! an `Idempotency-Key` that is the same on every retry, an `Airlock-Signature` HMAC, and
//! the Standard Webhooks headers (`webhook-id`, `webhook-timestamp`, `webhook-signature`)
//! keyed with the secret of the request's origin, so one receiver cannot forge requests to
//! another. A name is resolved when the request is made and the connection goes only to an
//! address the origin may reach (see [`crate::address`]); answers are read up to a cap; no
//! error text carries the URL (its query may hold a token).
//!
//! 2xx is delivered. 408, 429, 5xx, timeouts and connection errors are retried with the
//! same key (the receiver deduplicates); any other status is permanent. Redirects are not
//! followed (a redirect could leave the allow-list) and no ambient proxy is used.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::EffectOutcome;
use crate::address::{self, Allowance, GuardedResolver, Lookup};
use airlock_core::config::DeliveryConfig;
use airlock_core::secret::Secret;
use airlock_delivery::artifact::WebhookArtifact;
use airlock_delivery::policy;

/// Most bytes of a webhook receiver's answer that are read (the receipt keeps its head).
pub const MAX_REPLY_BYTES: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WebhookSetupError {
    #[error("delivery.webhook_secret_env: the variable {0} holding the webhook signing secret is not set")]
    MissingSecret(String),
    #[error(
        "delivery.webhook_endpoints.{name}.secret_env: the variable {var} must hold a Standard Webhooks secret (whsec_<base64 key>)"
    )]
    EndpointSecret { name: String, var: String },
    #[error("delivery.webhook_endpoints.{0}.origin: not a bare origin (https://host[:port]), or another endpoint's")]
    EndpointOrigin(String),
    #[error("webhook client: {0}")]
    Client(String),
}

/// How requests to one origin are signed and where they may connect.
struct Route {
    /// The Standard Webhooks key of the origin.
    key: Vec<u8>,
    /// A client whose resolver answers only the addresses this origin may reach.
    client: reqwest::Client,
    allow: Allowance,
}

/// Signs and posts webhook requests (deliveries and agent turns' declared tools): each
/// origin with its own key and its own address allowance, every other allowed origin with
/// the default ones.
#[derive(Clone)]
pub struct WebhookSender {
    /// Keys `Airlock-Signature` (`delivery.webhook_secret_env`) for every origin.
    legacy: Secret,
    /// Origins with an endpoint entry, by normalised origin.
    routes: Arc<HashMap<String, Route>>,
    /// Origins without one: the default key and no private address.
    default: Arc<Route>,
}

impl std::fmt::Debug for WebhookSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSender")
    }
}

fn client(timeout: Duration, lookup: Arc<dyn Lookup>, allow: Allowance) -> Result<reqwest::Client, WebhookSetupError> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(Arc::new(GuardedResolver { lookup, allow }))
        .user_agent(concat!("airlock/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| WebhookSetupError::Client(e.without_url().to_string()))
}

impl WebhookSender {
    /// A sender for `delivery`'s endpoints. `secret_of` gives the value of a named
    /// environment variable (the process environment in production); `lookup` resolves
    /// names ([`address::SystemLookup`] in production).
    pub fn from_config(
        delivery: &DeliveryConfig,
        timeout: Duration,
        secret_of: &dyn Fn(&str) -> Option<Secret>,
        lookup: Arc<dyn Lookup>,
    ) -> Result<Self, WebhookSetupError> {
        let legacy = secret_of(&delivery.webhook_secret_env)
            .ok_or_else(|| WebhookSetupError::MissingSecret(delivery.webhook_secret_env.clone()))?;
        let default_key = policy::standard_webhook_key(legacy.expose())
            .ok_or_else(|| WebhookSetupError::MissingSecret(delivery.webhook_secret_env.clone()))?;
        let mut routes = HashMap::new();
        for (name, e) in &delivery.webhook_endpoints {
            let origin = policy::normalize_origin(&e.origin)
                .filter(|o| !routes.contains_key(o))
                .ok_or_else(|| WebhookSetupError::EndpointOrigin(name.clone()))?;
            let bad_secret = || WebhookSetupError::EndpointSecret { name: name.clone(), var: e.secret_env.clone() };
            let secret = secret_of(&e.secret_env).ok_or_else(bad_secret)?;
            if !secret.expose().trim().starts_with("whsec_") {
                return Err(bad_secret());
            }
            let key = policy::standard_webhook_key(secret.expose()).ok_or_else(bad_secret)?;
            let allow = Allowance { loopback: e.allow_loopback, private: e.allow_private };
            routes.insert(origin, Route { key, client: client(timeout, lookup.clone(), allow)?, allow });
        }
        let default = Route {
            key: default_key,
            client: client(timeout, lookup, Allowance::default())?,
            allow: Allowance::default(),
        };
        Ok(Self { legacy, routes: Arc::new(routes), default: Arc::new(default) })
    }

    /// The route of `url`'s origin, after refusing an address literal the origin may not
    /// reach (names are checked by the route's resolver when the connection is made).
    fn route(&self, url: &str) -> Result<&Route, String> {
        let origin = airlock_delivery::artifact::origin_of(url).ok_or("the URL does not parse")?;
        let route = self.routes.get(&origin).unwrap_or(&self.default);
        let parsed = reqwest::Url::parse(url).map_err(|_| "the URL does not parse".to_string())?;
        let host = parsed.host_str().unwrap_or_default();
        let literal: Option<IpAddr> = host.trim_start_matches('[').trim_end_matches(']').parse().ok();
        if let Some(ip) = literal
            && let Some(why) = address::refusal(ip, route.allow)
        {
            return Err(format!("not sent: {ip} is {why}, which this endpoint may not reach"));
        }
        Ok(route)
    }

    /// A signed POST of `body` to `url`: `Idempotency-Key`, `Airlock-Signature`, and the
    /// Standard Webhooks headers keyed with the origin's secret.
    fn signed(&self, route: &Route, url: &str, idempotency_key: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
        let t = chrono::Utc::now().timestamp();
        let legacy = policy::webhook_signature(self.legacy.expose().as_bytes(), t, &body);
        let standard = policy::standard_webhook_signature(&route.key, idempotency_key, t, &body);
        route
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("idempotency-key", idempotency_key)
            .header("airlock-signature", legacy)
            .header("webhook-id", idempotency_key)
            .header("webhook-timestamp", t.to_string())
            .header("webhook-signature", standard)
            .body(body)
    }

    /// Posts the call once.
    pub async fn send(&self, hook: &WebhookArtifact, idempotency_key: &str) -> EffectOutcome {
        let body = match serde_json::to_vec(&hook.body) {
            Ok(b) => b,
            Err(e) => return EffectOutcome::Permanent { detail: format!("body: {e}") },
        };
        let route = match self.route(&hook.url) {
            Ok(r) => r,
            Err(detail) => return EffectOutcome::Permanent { detail },
        };
        let mut req = self.signed(route, &hook.url, idempotency_key, body);
        for (k, v) in &hook.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        match req.send().await {
            Ok(mut resp) => {
                let status = resp.status();
                let retry_after = resp
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(|s| Duration::from_secs(s.min(3600)));
                // The answer is read up to a cap: a receiver cannot make the worker hold an
                // endless body. What it said is kept, whatever happens after the cap.
                let (bytes, _) = read_capped(&mut resp, MAX_REPLY_BYTES).await;
                let text: String = String::from_utf8_lossy(&bytes).chars().take(500).collect();
                let detail = format!("{} {}", status.as_u16(), text.trim());
                if status.is_success() {
                    EffectOutcome::Sent { message_id: None, response: detail }
                } else if status.as_u16() == 408 || status.as_u16() == 429 || status.is_server_error() {
                    EffectOutcome::NotDelivered { detail, retry_after }
                } else {
                    EffectOutcome::Permanent { detail }
                }
            }
            Err(e) => match address::refused_in(&e) {
                // Nothing was sent: the name led to an address this endpoint may not reach.
                Some(refused) => EffectOutcome::Permanent { detail: format!("not sent: {refused}") },
                // Timeouts and lost connections: the receiver may or may not have it, but
                // the key makes a retry safe. The URL (whose query may carry a token) is
                // left out of the text.
                None => EffectOutcome::NotDelivered {
                    detail: format!("request failed: {}", e.without_url()),
                    retry_after: None,
                },
            },
        }
    }
}

/// Reads at most `cap` bytes of an answer; `true` when it was longer (or broke off).
async fn read_capped(resp: &mut reqwest::Response, cap: usize) -> (Vec<u8>, bool) {
    let mut bytes = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = cap - bytes.len();
                if chunk.len() > room {
                    bytes.extend_from_slice(&chunk[..room]);
                    return (bytes, true);
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => return (bytes, false),
            Err(_) => return (bytes, true),
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
        let route = self.route(url)?;
        let resp =
            self.signed(route, url, idempotency_key, raw).send().await.map_err(|e| match address::refused_in(&e) {
                Some(refused) => format!("not called: {refused}"),
                None => format!("the tool did not answer: {}", e.without_url()),
            })?;
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
