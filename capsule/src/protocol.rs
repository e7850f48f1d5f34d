//! The node protocol: what a migration coordinator asks the nodes that host agents.
//!
//! Calls (all under `/node/v1/agents/{agent_id}`): `GET` (status), `POST freeze`,
//! `POST propose`, `POST have-blobs`, `PUT blobs/{sha256}?epoch=N` (the raw body; the node
//! checks the hash on receipt), `POST prepare`, `POST activate`, `POST abort`,
//! `POST retire`, `POST resume`; and, for the agent's own run, `POST journal` and
//! `POST checkpoint`. Every call but status names an epoch, and a node refuses a proposal
//! whose epoch is not newer than any it has seen for that agent.
//!
//! Authentication: each request carries `Airlock-Node-Timestamp` (unix seconds) and
//! `Airlock-Node-Signature: v1=<hex HMAC-SHA256>` over `METHOD\nPATH?QUERY\nTIMESTAMP\n`
//! followed by the body, keyed with the fleet secret; a timestamp further than the allowed
//! skew from the node's clock is refused. Responses are signed the same way with the
//! method `RESPONSE`, so a forged answer cannot make a coordinator retire a source. This
//! authenticates; it does not encrypt: nodes talk over a private network or TLS.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use super::AgentId;
use super::manifest::Manifest;
use airlock_core::secret::Secret;

pub const TIMESTAMP_HEADER: &str = "airlock-node-timestamp";
pub const SIGNATURE_HEADER: &str = "airlock-node-signature";
/// The method name responses are signed under.
pub const RESPONSE_METHOD: &str = "RESPONSE";

/// Where a node stands with one agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HolderState {
    /// Runs the agent at `epoch`.
    Active,
    /// Holds it at `epoch` but does not run it (a migration is under way).
    Frozen,
    /// Gave it up; `epoch` is the last one it held.
    Retired,
    /// Receives it for `epoch` (proposed; `prepared` once verified and built).
    Staging,
}

impl HolderState {
    pub fn as_str(self) -> &'static str {
        match self {
            HolderState::Active => "active",
            HolderState::Frozen => "frozen",
            HolderState::Retired => "retired",
            HolderState::Staging => "staging",
        }
    }
}

/// A node's answer to `status` (and to most calls).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub agent_id: AgentId,
    pub node_id: String,
    /// `None`: no record of this agent here.
    pub state: Option<HolderState>,
    pub epoch: i64,
    /// The highest epoch ever accepted here for this agent.
    pub seen_epoch: i64,
    pub prepared: bool,
    /// False when a working copy was found without its holder record (after a crash): the
    /// node does not run the agent until it has been reconciled with Postgres.
    pub reconciled: bool,
}

impl NodeStatus {
    pub fn is_active_at(&self, epoch: i64) -> bool {
        self.reconciled && self.state == Some(HolderState::Active) && self.epoch == epoch
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpochRequest {
    pub epoch: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeReply {
    pub epoch: i64,
    /// The sha256 of the manifest of the checkpoint written to the store on freezing.
    pub manifest_sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaveBlobsRequest {
    pub epoch: i64,
    pub hashes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaveBlobsReply {
    /// The hashes this node lacks.
    pub missing: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareRequest {
    pub epoch: i64,
    pub manifest: Manifest,
    /// Every non-blob file, base64.
    pub files: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppendRequest {
    pub kind: super::journal::EventKind,
    pub data: serde_json::Value,
}

/// The calls of the protocol, by name (fault injection names them too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeCall {
    Status,
    Freeze,
    Propose,
    HaveBlobs,
    PutBlob,
    Prepare,
    Activate,
    Abort,
    Retire,
    Resume,
}

impl NodeCall {
    pub const ALL: [NodeCall; 10] = [
        NodeCall::Status,
        NodeCall::Freeze,
        NodeCall::Propose,
        NodeCall::HaveBlobs,
        NodeCall::PutBlob,
        NodeCall::Prepare,
        NodeCall::Activate,
        NodeCall::Abort,
        NodeCall::Retire,
        NodeCall::Resume,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodeCall::Status => "status",
            NodeCall::Freeze => "freeze",
            NodeCall::Propose => "propose",
            NodeCall::HaveBlobs => "have_blobs",
            NodeCall::PutBlob => "put_blob",
            NodeCall::Prepare => "prepare",
            NodeCall::Activate => "activate",
            NodeCall::Abort => "abort",
            NodeCall::Retire => "retire",
            NodeCall::Resume => "resume",
        }
    }
}

/// Why a call did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// No trustworthy answer (connection refused or cut, timeout, 5xx, bad response
    /// signature): the call may or may not have taken effect.
    #[error("node unreachable: {0}")]
    Unreachable(String),
    /// The node answered with a refusal: nothing changed there.
    #[error("node refused ({status} {code}): {message}")]
    Refused { status: u16, code: String, message: String },
}

impl CallError {
    pub fn code(&self) -> Option<&str> {
        match self {
            CallError::Refused { code, .. } => Some(code),
            CallError::Unreachable(_) => None,
        }
    }
}

pub type NodeFuture<T> = Pin<Box<dyn Future<Output = Result<T, CallError>> + Send + 'static>>;

/// A node, as a coordinator sees it. [`HttpNode`] is the real one; tests wrap it.
pub trait NodeApi: Send + Sync + 'static {
    fn node_id(&self) -> &str;
    fn status(&self, agent: &AgentId) -> NodeFuture<NodeStatus>;
    fn freeze(&self, agent: &AgentId, epoch: i64) -> NodeFuture<FreezeReply>;
    fn propose(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus>;
    fn have_blobs(&self, agent: &AgentId, epoch: i64, hashes: Vec<String>) -> NodeFuture<HaveBlobsReply>;
    fn put_blob(&self, agent: &AgentId, epoch: i64, sha: &str, body: Vec<u8>) -> NodeFuture<()>;
    fn prepare(&self, agent: &AgentId, request: PrepareRequest) -> NodeFuture<NodeStatus>;
    fn activate(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus>;
    fn abort(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus>;
    fn retire(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus>;
    fn resume(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus>;
}

/// The nodes a coordinator may talk to, by id.
#[derive(Clone, Default)]
pub struct NodeDirectory {
    nodes: BTreeMap<String, Arc<dyn NodeApi>>,
}

impl NodeDirectory {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, node: Arc<dyn NodeApi>) -> &mut Self {
        self.nodes.insert(node.node_id().to_string(), node);
        self
    }

    pub fn get(&self, id: &str) -> Option<Arc<dyn NodeApi>> {
        self.nodes.get(id).cloned()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.nodes.contains_key(id)
    }

    /// HTTP clients for every `nodes.<id>.url` of the configuration.
    pub fn from_config(cfg: &airlock_core::config::Config, secret: Secret) -> Result<Self, reqwest::Error> {
        let mut d = Self::new();
        let secret = Arc::new(secret);
        let timeout = Duration::from_millis(cfg.capsules.node_timeout_ms);
        for (id, peer) in &cfg.nodes {
            d.insert(Arc::new(HttpNode::new(id, &peer.url, secret.clone(), timeout)?));
        }
        Ok(d)
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], method: &str, path: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("HMAC takes any key"));
    m.update(method.as_bytes());
    m.update(b"\n");
    m.update(path.as_bytes());
    m.update(b"\n");
    m.update(timestamp.to_string().as_bytes());
    m.update(b"\n");
    m.update(body);
    m
}

/// The `Airlock-Node-Signature` value for a request (or, with [`RESPONSE_METHOD`], a response).
pub fn sign(secret: &Secret, method: &str, path_and_query: &str, timestamp: i64, body: &[u8]) -> String {
    format!(
        "v1={}",
        hex::encode(mac(secret.expose().as_bytes(), method, path_and_query, timestamp, body).finalize().into_bytes())
    )
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing or malformed node signature headers")]
    Malformed,
    #[error("timestamp is {0} s away from this node's clock")]
    Stale(i64),
    #[error("bad node signature")]
    BadSignature,
}

/// Checks a request's (or response's) headers against the fleet secret.
#[allow(clippy::too_many_arguments)]
pub fn check(
    secret: &Secret,
    method: &str,
    path_and_query: &str,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now: i64,
    max_skew_seconds: i64,
) -> Result<(), AuthError> {
    check_headers(timestamp, signature, now, max_skew_seconds)?.verify(secret, method, path_and_query, body)
}

/// The signature headers of a call, well formed and fresh, not yet checked against its body.
#[derive(Debug)]
pub struct SignedHeaders {
    timestamp: i64,
    signature: Vec<u8>,
}

/// The part of [`check`] that needs no body: both headers present and well formed, the
/// timestamp within `max_skew_seconds` of `now`. A server calls it before reading a body.
pub fn check_headers(
    timestamp: Option<&str>,
    signature: Option<&str>,
    now: i64,
    max_skew_seconds: i64,
) -> Result<SignedHeaders, AuthError> {
    let ts: i64 = timestamp.and_then(|t| t.trim().parse().ok()).ok_or(AuthError::Malformed)?;
    let sig = signature.and_then(|s| s.trim().strip_prefix("v1=")).ok_or(AuthError::Malformed)?;
    // An HMAC-SHA256 is 32 bytes: anything else cannot match, whatever the body.
    let sig = hex::decode(sig).ok().filter(|s| s.len() == 32).ok_or(AuthError::Malformed)?;
    if now.checked_sub(ts).is_none_or(|d| d.abs() > max_skew_seconds) {
        return Err(AuthError::Stale(now.saturating_sub(ts)));
    }
    Ok(SignedHeaders { timestamp: ts, signature: sig })
}

impl SignedHeaders {
    /// Checks the signature over the call and its body.
    pub fn verify(&self, secret: &Secret, method: &str, path_and_query: &str, body: &[u8]) -> Result<(), AuthError> {
        mac(secret.expose().as_bytes(), method, path_and_query, self.timestamp, body)
            .verify_slice(&self.signature)
            .map_err(|_| AuthError::BadSignature)
    }
}

/// The path of a call for `agent`.
pub fn path(agent: &AgentId, op: &str) -> String {
    if op.is_empty() { format!("/node/v1/agents/{agent}") } else { format!("/node/v1/agents/{agent}/{op}") }
}

/// A node over HTTP.
#[derive(Clone)]
pub struct HttpNode {
    id: String,
    base: String,
    secret: Arc<Secret>,
    client: reqwest::Client,
    /// How far a response's timestamp may be from this clock.
    max_skew_seconds: i64,
}

impl HttpNode {
    pub fn new(id: &str, base_url: &str, secret: Arc<Secret>, timeout: Duration) -> Result<Self, reqwest::Error> {
        airlock_core::telemetry::install_crypto_provider();
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self {
            id: id.to_string(),
            base: base_url.trim_end_matches('/').to_string(),
            secret,
            client,
            max_skew_seconds: 300,
        })
    }

    fn call<T: DeserializeOwned + Send + 'static>(
        &self,
        method: &'static str,
        path_and_query: String,
        body: Vec<u8>,
        json: bool,
    ) -> NodeFuture<T> {
        let this = self.clone();
        Box::pin(async move {
            let ts = chrono::Utc::now().timestamp();
            let sig = sign(&this.secret, method, &path_and_query, ts, &body);
            let m =
                reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| CallError::Unreachable(e.to_string()))?;
            let mut req = this
                .client
                .request(m, format!("{}{}", this.base, path_and_query))
                .header(TIMESTAMP_HEADER, ts.to_string())
                .header(SIGNATURE_HEADER, sig);
            if !body.is_empty() || method != "GET" {
                req = req.header(
                    reqwest::header::CONTENT_TYPE,
                    if json { "application/json" } else { "application/octet-stream" },
                );
                req = req.body(body);
            }
            let resp = req.send().await.map_err(|e| CallError::Unreachable(e.to_string()))?;
            let status = resp.status();
            let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
            let (rts, rsig) = (header(TIMESTAMP_HEADER), header(SIGNATURE_HEADER));
            let bytes = resp.bytes().await.map_err(|e| CallError::Unreachable(e.to_string()))?;
            if status.is_server_error() {
                return Err(CallError::Unreachable(format!("node answered {status}")));
            }
            let now = chrono::Utc::now().timestamp();
            check(
                &this.secret,
                RESPONSE_METHOD,
                &path_and_query,
                rts.as_deref(),
                rsig.as_deref(),
                &bytes,
                now,
                this.max_skew_seconds,
            )
            .map_err(|e| CallError::Unreachable(format!("untrusted answer: {e}")))?;
            if !status.is_success() {
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                return Err(CallError::Refused {
                    status: status.as_u16(),
                    code: v["error"]["code"].as_str().unwrap_or("UNKNOWN").to_string(),
                    message: v["error"]["message"].as_str().unwrap_or("").to_string(),
                });
            }
            let body = if bytes.is_empty() { b"null".as_slice() } else { &bytes[..] };
            serde_json::from_slice(body).map_err(|e| CallError::Unreachable(format!("unreadable answer: {e}")))
        })
    }

    fn post<T: DeserializeOwned + Send + 'static, B: Serialize>(
        &self,
        agent: &AgentId,
        op: &str,
        body: &B,
    ) -> NodeFuture<T> {
        match serde_json::to_vec(body) {
            Ok(b) => self.call("POST", path(agent, op), b, true),
            Err(e) => Box::pin(async move { Err(CallError::Unreachable(e.to_string())) }),
        }
    }

    /// Appends an event to the agent's journal on this node (only while it runs there).
    pub fn append(&self, agent: &AgentId, request: &AppendRequest) -> NodeFuture<serde_json::Value> {
        self.post(agent, "journal", request)
    }

    /// Asks the node to checkpoint the agent to the store now.
    pub fn checkpoint(&self, agent: &AgentId) -> NodeFuture<serde_json::Value> {
        self.post(agent, "checkpoint", &serde_json::json!({}))
    }
}

impl NodeApi for HttpNode {
    fn node_id(&self) -> &str {
        &self.id
    }
    fn status(&self, agent: &AgentId) -> NodeFuture<NodeStatus> {
        self.call("GET", path(agent, ""), Vec::new(), false)
    }
    fn freeze(&self, agent: &AgentId, epoch: i64) -> NodeFuture<FreezeReply> {
        self.post(agent, "freeze", &EpochRequest { epoch })
    }
    fn propose(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.post(agent, "propose", &EpochRequest { epoch })
    }
    fn have_blobs(&self, agent: &AgentId, epoch: i64, hashes: Vec<String>) -> NodeFuture<HaveBlobsReply> {
        self.post(agent, "have-blobs", &HaveBlobsRequest { epoch, hashes })
    }
    fn put_blob(&self, agent: &AgentId, epoch: i64, sha: &str, body: Vec<u8>) -> NodeFuture<()> {
        self.call("PUT", format!("{}?epoch={epoch}", path(agent, &format!("blobs/{sha}"))), body, false)
    }
    fn prepare(&self, agent: &AgentId, request: PrepareRequest) -> NodeFuture<NodeStatus> {
        self.post(agent, "prepare", &request)
    }
    fn activate(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.post(agent, "activate", &EpochRequest { epoch })
    }
    fn abort(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.post(agent, "abort", &EpochRequest { epoch })
    }
    fn retire(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.post(agent, "retire", &EpochRequest { epoch })
    }
    fn resume(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.post(agent, "resume", &EpochRequest { epoch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_cover_method_path_time_and_body() {
        let s = Secret::new("fleet");
        let sig = sign(&s, "POST", "/node/v1/agents/a/freeze", 1000, b"{\"epoch\":1}");
        let ok = |m: &str, p: &str, t: &str, b: &[u8], now: i64| check(&s, m, p, Some(t), Some(&sig), b, now, 30);
        assert_eq!(ok("POST", "/node/v1/agents/a/freeze", "1000", b"{\"epoch\":1}", 1010), Ok(()));
        assert_eq!(ok("PUT", "/node/v1/agents/a/freeze", "1000", b"{\"epoch\":1}", 1010), Err(AuthError::BadSignature));
        assert_eq!(
            ok("POST", "/node/v1/agents/b/freeze", "1000", b"{\"epoch\":1}", 1010),
            Err(AuthError::BadSignature)
        );
        assert_eq!(
            ok("POST", "/node/v1/agents/a/freeze", "1001", b"{\"epoch\":1}", 1010),
            Err(AuthError::BadSignature)
        );
        assert_eq!(
            ok("POST", "/node/v1/agents/a/freeze", "1000", b"{\"epoch\":2}", 1010),
            Err(AuthError::BadSignature)
        );
        assert_eq!(ok("POST", "/node/v1/agents/a/freeze", "1000", b"{\"epoch\":1}", 1100), Err(AuthError::Stale(100)));
        assert_eq!(
            check(
                &Secret::new("other"),
                "POST",
                "/node/v1/agents/a/freeze",
                Some("1000"),
                Some(&sig),
                b"{\"epoch\":1}",
                1000,
                30
            ),
            Err(AuthError::BadSignature)
        );
    }
}
