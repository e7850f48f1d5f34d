//! The agent API over HTTP, for the stdio server: every tool call is the route's request,
//! with the agent's bearer token, to `AIRLOCK_API_URL`.
//!
//! The token never travels in clear to another machine: the base URL must be `https://`,
//! or `http://` to a loopback host (`localhost`, `127.0.0.0/8`, `::1`).

use std::net::IpAddr;
use std::time::Duration;

use rmcp::model::Extensions;
use serde_json::Value;

use crate::server::{AgentApi, Answer};
use crate::tools::{Method, RouteCall};

/// How long one route call may take, as the service's own request timeout.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The agent API at a base URL, called with one agent's token.
pub struct RemoteApi {
    http: reqwest::Client,
    /// The base URL without a trailing `/`.
    base: String,
    token: String,
}

impl std::fmt::Debug for RemoteApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteApi").field("base", &self.base).finish_non_exhaustive()
    }
}

/// Refuses a base URL the token must not be sent to; answers it without a trailing `/`.
pub fn check_base_url(url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("AIRLOCK_API_URL: not a URL ({e})"))?;
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err("AIRLOCK_API_URL: no query or fragment".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("AIRLOCK_API_URL: no credentials in the URL (the token is AIRLOCK_TOKEN)".into());
    }
    match parsed.scheme() {
        "https" => {}
        "http" if is_loopback(&parsed) => {}
        "http" => {
            return Err(format!(
                "AIRLOCK_API_URL: plain http:// is refused to a host that is not loopback ({}); use https://",
                parsed.host_str().unwrap_or("")
            ));
        }
        other => return Err(format!("AIRLOCK_API_URL: scheme {other}:// is not http(s)")),
    }
    Ok(parsed.as_str().trim_end_matches('/').to_string())
}

fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else { return false };
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

impl RemoteApi {
    /// The API at `base_url` (checked with [`check_base_url`]) with `token`.
    pub fn new(base_url: &str, token: &str) -> Result<Self, String> {
        let base = check_base_url(base_url)?;
        let token = token.trim();
        if token.is_empty() || token.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err("AIRLOCK_TOKEN: must be the agent's bearer token, one word".into());
        }
        // The process's one TLS backend (ring), unless one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(TIMEOUT)
            .connect_timeout(Duration::from_secs(10))
            // A redirect would carry the token elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("airlock-mcp/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(Self { http, base, token: token.to_string() })
    }
}

impl AgentApi for RemoteApi {
    async fn call(&self, _extensions: &Extensions, call: RouteCall) -> Result<Answer, String> {
        let url = format!("{}{}", self.base, call.path);
        let mut req = match call.method {
            Method::Get => self.http.get(&url),
            Method::Post => self.http.post(&url),
        }
        .bearer_auth(&self.token);
        if let Some(body) = &call.body {
            req = req.json(body);
        }
        let resp = req.send().await.map_err(|e| format!("airlock did not answer: {}", without_url(&e)))?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| format!("airlock's answer was cut: {}", without_url(&e)))?;
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Answer { status, body })
    }
}

/// An HTTP error in words, without the URL (ids of the call are the caller's own, but the
/// base URL is configuration).
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "request failed"
    };
    kind.to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn plain_http_only_to_loopback() {
        for ok in [
            "https://airlock.example.com",
            "https://airlock.example.com/base/",
            "http://127.0.0.1:7070",
            "http://localhost:7070/",
            "http://[::1]:7070",
            "http://127.8.9.1",
        ] {
            assert!(check_base_url(ok).is_ok(), "{ok}");
        }
        assert_eq!(check_base_url("http://127.0.0.1:7070/").unwrap(), "http://127.0.0.1:7070");
        for bad in [
            "http://airlock.example.com",
            "http://10.0.0.1:7070",
            "http://localhost.example.com",
            "http://[::ffff:10.0.0.1]",
            "ftp://127.0.0.1",
            "https://user:pw@airlock.example.com",
            "https://airlock.example.com/?x=1",
            "not a url",
        ] {
            assert!(check_base_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_token_is_one_word() {
        assert!(RemoteApi::new("http://127.0.0.1:1", "").is_err());
        assert!(RemoteApi::new("http://127.0.0.1:1", "a b").is_err());
        assert!(RemoteApi::new("http://127.0.0.1:1", "tok\n").is_ok());
    }
}
