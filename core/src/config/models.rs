//! Models (`models.<name>.*`): the OpenAI-compatible servers airlock itself talks to, for
//! agent turns and the model judge. Only a local model on loopback may be configured: the
//! endpoint is checked here, when the configuration loads, and any other form stops the
//! process with a message naming the key.

use std::net::{Ipv4Addr, Ipv6Addr};

use serde::Deserialize;

/// How a request asks the server to constrain its answer to the action's JSON schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutput {
    /// Nothing asked: airlock validates the answer itself (it always does).
    #[default]
    None,
    /// OpenAI's `response_format: {"type": "json_schema", "json_schema": {…}}` (llama.cpp's
    /// server, vLLM).
    JsonSchema,
    /// `response_format: {"type": "json_object", "schema": {…}}` (llama-cpp-python's server).
    JsonObject,
}

/// One model (`models.<name>`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `http://127.0.0.1:<port>` or `http://[::1]:<port>`, nothing else; airlock posts to
    /// `/v1/chat/completions` there.
    pub endpoint: String,
    /// The model id sent in each request.
    pub model: String,
    /// How long one completion may take.
    #[serde(default = "default_timeout")]
    pub timeout_seconds: u64,
    /// The model's context window, in tokens (a turn's context is fitted to it).
    #[serde(default = "default_context")]
    pub context_tokens: u64,
    #[serde(default)]
    pub structured_output: StructuredOutput,
}

fn default_timeout() -> u64 {
    60
}

fn default_context() -> u64 {
    4096
}

/// A checked endpoint: a canonical loopback address and port, as `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint(String);

impl Endpoint {
    /// `http://127.0.0.1:<port>` or `http://[::1]:<port>` (an optional trailing `/`),
    /// exactly: no DNS name (`localhost` included), no other address (LAN, `0.0.0.0`),
    /// no HTTPS, no credentials, path, query or fragment, a port without leading zeros.
    pub fn parse(s: &str) -> Result<Self, String> {
        let refuse = |why: &str| Err(format!("`{s}` {why}; only http://127.0.0.1:<port> or http://[::1]:<port>"));
        let Some(rest) = s.strip_prefix("http://") else {
            return refuse("is not a plain http:// loopback endpoint");
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#', '@', '%', ' ']) || rest.chars().any(|c| c.is_control()) {
            return refuse("has credentials, a path, a query or a fragment");
        }
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let Some((h, p)) = v6.split_once("]:") else { return refuse("has no port") };
            if h.parse::<Ipv6Addr>().ok() != Some(Ipv6Addr::LOCALHOST) || h != "::1" {
                return refuse("is not the loopback address [::1]");
            }
            ("[::1]", p)
        } else {
            let Some((h, p)) = rest.rsplit_once(':') else { return refuse("has no port") };
            if h != "127.0.0.1" || h.parse::<Ipv4Addr>().ok() != Some(Ipv4Addr::LOCALHOST) {
                return refuse("is not the loopback address 127.0.0.1 (no names, not even localhost)");
            }
            ("127.0.0.1", p)
        };
        let canonical = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !port.starts_with('0');
        match port.parse::<u16>() {
            Ok(p) if canonical && p > 0 => Ok(Self(format!("http://{host}:{p}"))),
            _ => refuse("has no valid port"),
        }
    }

    /// `http://host:port`, without a trailing slash.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The URL of the chat completions route.
    pub fn completions_url(&self) -> String {
        format!("{}/v1/chat/completions", self.0)
    }
}

impl ModelConfig {
    /// The checked endpoint (checked at load already: this cannot fail on a loaded config).
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::parse(&self.endpoint).unwrap_or_else(|_| Endpoint(String::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_canonical_loopback_endpoints() {
        for ok in ["http://127.0.0.1:8080", "http://127.0.0.1:8080/", "http://[::1]:9", "http://127.0.0.1:65535"] {
            assert!(Endpoint::parse(ok).is_ok(), "{ok}");
        }
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:8080/").unwrap().completions_url(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        for bad in [
            "http://localhost:8080",
            "http://example.com:8080",
            "http://10.0.0.5:8080",
            "http://192.168.1.2:8080",
            "http://0.0.0.0:8080",
            "https://127.0.0.1:8080",
            "http://user:pw@127.0.0.1:8080",
            "http://127.0.0.1:8080/v1",
            "http://127.0.0.1:8080?x=1",
            "http://127.0.0.1:8080#f",
            "http://127.0.0.1",
            "http://127.0.0.1:",
            "http://127.0.0.1:08080",
            "http://127.0.0.1:0",
            "http://127.0.0.1:70000",
            "http://127.1:8080",
            "http://[::ffff:127.0.0.1]:8080",
            "http://[0:0:0:0:0:0:0:1]:8080",
            "http://[::1]",
            "ftp://127.0.0.1:21",
            "127.0.0.1:8080",
            "http://127.0.0.1:8080 ",
            "http://%31%32%37.0.0.1:8080",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
