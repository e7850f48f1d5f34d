//! Typed, layered configuration.
//!
//! Layers, lowest first: built-in defaults, the TOML file named by `AIRLOCK_CONFIG`, then
//! environment variables `AIRLOCK__SECTION__KEY` (lists comma-separated). `DATABASE_URL`
//! is an alias of `AIRLOCK__DATABASE__URL` (the latter wins when both are set).
//! Unknown keys and invalid values are refused at start with a message naming the key.
//! Secrets are never configuration values: the configuration names the environment
//! variables that hold them.

pub mod agent;
pub mod limits;
pub mod models;
pub mod sandbox;

use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use crate::secret::Secret;

/// Keys whose environment values are comma-separated lists.
const LIST_KEYS: &[&str] = &[
    "worker.queues",
    "delivery.senders",
    "delivery.webhook_origins",
    "delivery.known_domains",
    "capsules.trusted_keys",
];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("configuration key `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
}

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, message: message.into() }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub database: DatabaseConfig,
    #[serde(default)]
    pub api: ListenConfig<ApiDefault>,
    #[serde(default)]
    pub admin: ListenConfig<AdminDefault>,
    /// How every listener of the process serves slow or idle clients (`http.*`).
    #[serde(default)]
    pub http: HttpServeConfig,
    #[serde(default)]
    pub smtp: SmtpConfig,
    #[serde(default)]
    pub delivery: DeliveryConfig,
    #[serde(default)]
    pub scoring: ScoringConfig,
    #[serde(default)]
    pub review: ReviewConfig,
    #[serde(default)]
    pub worker: WorkerConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Durable runs: the budget ceilings an operator sets (see [`RunsConfig`]).
    #[serde(default)]
    pub runs: RunsConfig,
    /// Local models airlock talks to, by name (`models.<name>.*`, see [`models`]).
    #[serde(default)]
    pub models: std::collections::BTreeMap<String, models::ModelConfig>,
    /// Agent turns' ceilings (`agent.*`).
    #[serde(default)]
    pub agent: agent::AgentConfig,
    /// HTTP tools declared for agent turns, by id (`tools.<id>.*`).
    #[serde(default)]
    pub tools: std::collections::BTreeMap<String, agent::ToolConfig>,
    #[serde(default)]
    pub capsules: CapsulesConfig,
    /// Rate limits an agent cannot lift (`limits.*`, see [`limits`]).
    #[serde(default)]
    pub limits: limits::LimitsConfig,
    /// Peers that host agents, by node id (`nodes.<id>.url`).
    #[serde(default)]
    pub nodes: std::collections::BTreeMap<String, NodePeerConfig>,
    /// Sandbox tiers, per-agent scopes and selection rules; resolved and checked while
    /// parsing (see [`sandbox`]).
    #[serde(default)]
    pub sandbox: sandbox::SandboxConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Postgres URL. Required; it may carry a password, so it is held as a secret.
    #[serde(deserialize_with = "de_secret")]
    pub url: Secret,
    pub max_connections: u32,
    pub acquire_timeout_seconds: u64,
    /// A connection idle in the pool this long is checked (one round trip) before it is
    /// used again; 0 checks it before every use.
    pub check_after_idle_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self { url: Secret::new(""), max_connections: 16, acquire_timeout_seconds: 10, check_after_idle_ms: 1000 }
    }
}

fn de_secret<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
    String::deserialize(d).map(Secret::new)
}

/// Supplies the default listen address of one service.
pub trait DefaultListen {
    const ADDR: &'static str;
}
#[derive(Debug, Clone)]
pub struct ApiDefault;
impl DefaultListen for ApiDefault {
    const ADDR: &'static str = "127.0.0.1:7070";
}
#[derive(Debug, Clone)]
pub struct AdminDefault;
impl DefaultListen for AdminDefault {
    const ADDR: &'static str = "127.0.0.1:7071";
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenConfig<D: DefaultListen> {
    pub listen: SocketAddr,
    #[serde(skip)]
    _d: std::marker::PhantomData<D>,
}

impl<D: DefaultListen> Default for ListenConfig<D> {
    fn default() -> Self {
        Self { listen: D::ADDR.parse().expect("built-in listen address parses"), _d: std::marker::PhantomData }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SmtpTls {
    /// STARTTLS, and refuse a server that does not offer it.
    Required,
    /// Implicit TLS from the first byte (port 465).
    Wrapper,
    /// Plaintext: only to a loopback host with `allow_plaintext_loopback`.
    None,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SmtpConfig {
    pub host: String,
    pub port: u16,
    pub tls: SmtpTls,
    pub allow_plaintext_loopback: bool,
    /// Extra trusted CA certificate (PEM), beside the system roots.
    pub ca_file: Option<String>,
    /// Name of the environment variable holding the SMTP user name, if the relay wants AUTH.
    pub username_env: Option<String>,
    /// Name of the environment variable holding the SMTP password.
    pub password_env: Option<String>,
    pub timeout_seconds: u64,
    /// The name this client gives in EHLO.
    pub helo_name: Option<String>,
    /// Connections a worker keeps open between messages, to save a TCP and TLS handshake
    /// per message; 0 opens a connection for every message.
    pub max_idle_connections: usize,
    /// How long an open connection may wait for the next message before it is closed.
    pub idle_timeout_seconds: u64,
}

impl Default for SmtpConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 587,
            tls: SmtpTls::Required,
            allow_plaintext_loopback: false,
            ca_file: None,
            username_env: None,
            password_env: None,
            timeout_seconds: 30,
            helo_name: None,
            max_idle_connections: 4,
            idle_timeout_seconds: 10,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Verified From addresses (`agent@example.com`) or whole domains (`@example.com`).
    pub senders: Vec<String>,
    /// Allowed webhook origins, `https://host[:port]`.
    pub webhook_origins: Vec<String>,
    pub webhook_allow_plaintext_loopback: bool,
    /// Name of the environment variable holding the webhook signing secret.
    pub webhook_secret_env: String,
    pub webhook_timeout_seconds: u64,
    /// Domains the scorer treats as known recipients.
    pub known_domains: Vec<String>,
    /// Upper bound on an artifact's serialized size.
    pub max_artifact_bytes: usize,
    pub max_recipients: usize,
    /// Attempts of a send job before the delivery fails.
    pub max_send_attempts: i32,
    /// Webhook receivers by name (`delivery.webhook_endpoints.<name>.*`): each origin's
    /// own signing secret and the addresses it may resolve to. An endpoint's origin is an
    /// allowed origin.
    pub webhook_endpoints: std::collections::BTreeMap<String, WebhookEndpoint>,
}

/// One webhook receiver: its origin, the variable holding its Standard Webhooks secret
/// (`whsec_<base64 key>`), and whether its name may resolve to this machine or a private
/// network (refused by default, so a DNS answer cannot point a webhook inward).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookEndpoint {
    /// `https://host[:port]` (or loopback `http://` with
    /// `delivery.webhook_allow_plaintext_loopback`).
    pub origin: String,
    /// Name of the environment variable holding this receiver's `whsec_` secret.
    pub secret_env: String,
    /// The origin may resolve to (or be) a loopback address (127.0.0.0/8, ::1).
    #[serde(default)]
    pub allow_loopback: bool,
    /// The origin may resolve to (or be) a private address (10/8, 172.16/12,
    /// 192.168/16, 100.64/10, fc00::/7). Link-local and metadata addresses stay refused.
    #[serde(default)]
    pub allow_private: bool,
}

impl DeliveryConfig {
    /// Every allowed webhook origin: `webhook_origins` and the endpoints' origins.
    pub fn allowed_webhook_origins(&self) -> Vec<String> {
        let mut all = self.webhook_origins.clone();
        all.extend(self.webhook_endpoints.values().map(|e| e.origin.clone()));
        all
    }
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        Self {
            senders: Vec::new(),
            webhook_origins: Vec::new(),
            webhook_allow_plaintext_loopback: false,
            webhook_secret_env: "AIRLOCK_WEBHOOK_SECRET".into(),
            webhook_timeout_seconds: 15,
            known_domains: Vec::new(),
            max_artifact_bytes: 256 * 1024,
            max_recipients: 50,
            max_send_attempts: 8,
            webhook_endpoints: Default::default(),
        }
    }
}

/// How a listener serves its connections (`http.*`): the same for the api, the admin
/// service, a worker's metrics and the node protocol, so no slow client can hold one.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpServeConfig {
    /// A request's head (line and headers) must arrive within this, counted from when the
    /// connection waits for it (so it is also how long a kept-alive connection may idle
    /// between requests).
    pub header_read_timeout_seconds: u64,
    /// A request must be answered within this (its body read included), else 408.
    pub request_timeout_seconds: u64,
    /// A connection on which nothing is read or written for this long is closed (a client
    /// that stops reading its answer, or stops sending its body).
    pub idle_timeout_seconds: u64,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// `/metrics` samples the database's gauges (queue depth, deliveries and runs by
    /// state) at most this often; scrapes in between get the last sample. 0: every scrape.
    pub metrics_sample_seconds: u64,
}

impl Default for HttpServeConfig {
    fn default() -> Self {
        Self {
            header_read_timeout_seconds: 10,
            request_timeout_seconds: 30,
            idle_timeout_seconds: 60,
            max_connections: 1024,
            metrics_sample_seconds: 5,
        }
    }
}

impl HttpServeConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=3600).contains(&self.header_read_timeout_seconds) {
            return Err(invalid("http.header_read_timeout_seconds", "must be between 1 and 3600"));
        }
        if !(1..=86_400).contains(&self.request_timeout_seconds) {
            return Err(invalid("http.request_timeout_seconds", "must be between 1 and 86400"));
        }
        if self.idle_timeout_seconds < self.request_timeout_seconds || self.idle_timeout_seconds > 86_400 {
            return Err(invalid(
                "http.idle_timeout_seconds",
                "must be at least http.request_timeout_seconds and at most 86400",
            ));
        }
        if !(1..=100_000).contains(&self.max_connections) {
            return Err(invalid("http.max_connections", "must be between 1 and 100000"));
        }
        if self.metrics_sample_seconds > 3600 {
            return Err(invalid("http.metrics_sample_seconds", "must be at most 3600"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringConfig {
    pub review_threshold: f64,
    /// A configured model (`models.<name>`) that scores too; the lower score counts, and
    /// a judge that is down or off-protocol sends the delivery to review.
    pub model: Option<String>,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        Self { review_threshold: 0.7, model: None }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReviewConfig {
    /// Whoever edited an artifact version cannot approve that version.
    pub four_eyes: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    pub concurrency: usize,
    /// Most jobs one claim takes (0: as many as `concurrency`); more than `concurrency`
    /// prefetches into a local buffer.
    pub claim_batch: usize,
    /// Most completions recorded by one statement (1: each on its own).
    pub complete_batch: usize,
    pub lease_seconds: u64,
    /// Queues to claim from; empty means all.
    pub queues: Vec<String>,
    /// Fallback poll when no notification arrives.
    pub poll_interval_ms: u64,
    /// How long in-flight jobs may run on after SIGTERM before they are abandoned.
    pub shutdown_grace_seconds: u64,
    pub rescue_interval_seconds: u64,
    /// Seconds between worker-row heartbeats.
    pub heartbeat_seconds: u64,
    /// A table never analyzed is analyzed by a worker once this many of its rows have been
    /// written, rather than when autovacuum first gets to it; 0 leaves it to autovacuum.
    pub first_analyze_rows: i64,
    /// How often a worker looks for such tables (a read of the table statistics).
    pub first_analyze_interval_ms: u64,
    /// How long a slot of the queue's ring stays the one new jobs go to. The versions that
    /// claims and completions leave in a slot are reclaimed when it is truncated, once it is
    /// no longer current and none of its jobs is live: at a pinned xmin horizon, the queue's
    /// dead rows stay below about twice this long's worth of its traffic.
    pub ring_slot_seconds: u64,
    /// The longest a truncation of a slot waits for the slot's lock, during which the
    /// queue's other statements wait behind it; past it, it is tried again a moment later.
    pub ring_lock_timeout_ms: u64,
    /// Jobs moved per statement when a slot must be emptied of live jobs that outlived it
    /// (every slot still holds some when the current one is due to change).
    pub ring_move_batch: i32,
    /// Registers the `diag.*` job kinds used to check a fleet end to end.
    pub diagnostic_jobs: bool,
    /// Where the worker serves `/healthz`, `/readyz` and `/metrics`; unset serves nothing.
    pub metrics_listen: Option<SocketAddr>,
    /// When set, this worker also hosts agents as this node (see `capsules`).
    pub node_id: Option<String>,
    /// Where the node protocol listens (only with `node_id`).
    pub node_listen: SocketAddr,
    /// Where a node keeps its holder records and agents' working copies.
    pub data_dir: String,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            concurrency: 8,
            claim_batch: 0,
            complete_batch: 100,
            lease_seconds: 30,
            queues: Vec::new(),
            poll_interval_ms: 1000,
            shutdown_grace_seconds: 20,
            rescue_interval_seconds: 5,
            heartbeat_seconds: 5,
            first_analyze_rows: 1000,
            first_analyze_interval_ms: 2000,
            ring_slot_seconds: 10,
            ring_lock_timeout_ms: 100,
            ring_move_batch: 1000,
            diagnostic_jobs: false,
            metrics_listen: None,
            node_id: None,
            node_listen: "127.0.0.1:7072".parse().expect("built-in listen address parses"),
            data_dir: "data/node".into(),
        }
    }
}

/// Durable runs (`runs.*`): the most an agent may ask for, and the size of what a step
/// records. A ceiling of 0 means "no ceiling".
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunsConfig {
    /// Steps a run may record (steps, effects and deliveries each spend one).
    pub max_steps: i64,
    /// Tokens a run may spend (0: no ceiling).
    pub max_tokens: i64,
    /// Cost a run may spend, in millionths of the operator's unit (0: no ceiling).
    pub max_cost_micros: i64,
    /// The largest `data` of a step, and the largest `inputs` or `result` of a run.
    pub max_data_bytes: usize,
    /// Ceilings of one agent, replacing the ones above for its runs
    /// (`runs.agents.<agent>.max_steps`, `.max_tokens`, `.max_cost_micros`).
    pub agents: std::collections::BTreeMap<String, RunCeilings>,
}

/// One agent's run ceilings; an unset one is the default ceiling.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunCeilings {
    pub max_steps: Option<i64>,
    pub max_tokens: Option<i64>,
    pub max_cost_micros: Option<i64>,
}

impl Default for RunsConfig {
    fn default() -> Self {
        Self {
            max_steps: 10_000,
            max_tokens: 0,
            max_cost_micros: 0,
            max_data_bytes: 256 * 1024,
            agents: Default::default(),
        }
    }
}

impl RunsConfig {
    /// The ceilings of `agent`'s runs: `(max_steps, max_tokens, max_cost_micros)`, 0 none.
    pub fn ceilings(&self, agent: &str) -> (i64, i64, i64) {
        let own = self.agents.get(agent).or_else(|| self.agents.get(&agent.to_ascii_lowercase()));
        let pick = |own: Option<i64>, default: i64| own.unwrap_or(default);
        (
            pick(own.and_then(|c| c.max_steps), self.max_steps),
            pick(own.and_then(|c| c.max_tokens), self.max_tokens),
            pick(own.and_then(|c| c.max_cost_micros), self.max_cost_micros),
        )
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_steps < 0 || self.max_tokens < 0 || self.max_cost_micros < 0 {
            return Err(invalid("runs", "runs.max_steps, .max_tokens and .max_cost_micros must be 0 or positive"));
        }
        if self.max_data_bytes < 1024 || self.max_data_bytes > 16 * 1024 * 1024 {
            return Err(invalid("runs.max_data_bytes", "must be between 1024 and 16777216"));
        }
        for (agent, c) in &self.agents {
            for v in [c.max_steps, c.max_tokens, c.max_cost_micros].into_iter().flatten() {
                if v < 0 {
                    return Err(invalid(
                        "runs.agents",
                        format!("`runs.agents.{agent}`: ceilings must be 0 or positive"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Completed and cancelled jobs older than this are deleted; 0 keeps them forever.
    pub completed_jobs_hours: u64,
    /// A job's completion deletes its row at once instead of keeping it `completed` for
    /// `completed_jobs_hours` (failed, parked and cancelled jobs are kept either way).
    pub delete_completed_jobs: bool,
    pub interval_seconds: u64,
    pub batch_size: i64,
    /// The period of one partition of `delivery_events` (the deliveries created in it).
    pub event_partition_seconds: u64,
    /// How many periods past now the partitions are made ahead of the writers.
    pub event_partitions_ahead: u32,
    /// A period's partition moves to the archive once the period ended this long ago and
    /// every delivery of it is finished; 0 keeps every event in the hot log.
    pub archive_events_after_seconds: u64,
    /// The longest a partition change waits for the hot log's lock before it is left for
    /// the next pass.
    pub lock_timeout_ms: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            completed_jobs_hours: 24,
            delete_completed_jobs: false,
            interval_seconds: 60,
            batch_size: 5000,
            event_partition_seconds: 7 * 86_400,
            event_partitions_ahead: 4,
            archive_events_after_seconds: 90 * 86_400,
            lock_timeout_ms: 2000,
        }
    }
}

impl RetentionConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_size < 1 {
            return Err(invalid("retention.batch_size", "must be at least 1"));
        }
        if self.event_partition_seconds < 1 || self.event_partition_seconds > 366 * 86_400 {
            return Err(invalid("retention.event_partition_seconds", "must be between 1 and 31622400 (a year)"));
        }
        if !(1..=1000).contains(&self.event_partitions_ahead) {
            return Err(invalid("retention.event_partitions_ahead", "must be between 1 and 1000"));
        }
        if self.event_partition_seconds.saturating_mul(self.event_partitions_ahead as u64) > 10 * 366 * 86_400 {
            return Err(invalid("retention.event_partitions_ahead", "reaches more than ten years ahead"));
        }
        if !(1..=60_000).contains(&self.lock_timeout_ms) {
            return Err(invalid("retention.lock_timeout_ms", "must be between 1 and 60000"));
        }
        Ok(())
    }
}

impl Config {
    /// Loads the configuration from `AIRLOCK_CONFIG` and the environment.
    pub fn load() -> Result<Self, ConfigError> {
        let file = std::env::var("AIRLOCK_CONFIG").ok().filter(|f| !f.is_empty());
        let vars: Vec<(String, String)> = std::env::vars().collect();
        Self::from_sources(file.as_deref(), &vars)
    }

    /// Loads from an optional TOML file and a list of environment variables (tests pass
    /// their own list rather than mutate the process environment).
    pub fn from_sources(file: Option<&str>, vars: &[(String, String)]) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            builder = builder.add_source(config::File::new(path, config::FileFormat::Toml).required(true));
        }
        let env: std::collections::HashMap<String, String> = vars.iter().cloned().collect();
        if let Some(url) = env.get("DATABASE_URL").filter(|u| !u.is_empty()) {
            builder = builder.set_override("database.url", url.clone())?;
        }
        let mut source = config::Environment::with_prefix("AIRLOCK")
            .prefix_separator("__")
            .separator("__")
            .list_separator(",")
            .try_parsing(true)
            .source(Some(env.clone()));
        for key in LIST_KEYS {
            source = source.with_list_parse_key(key);
        }
        builder = builder.add_source(source);
        if let Some(url) = env.get("AIRLOCK__DATABASE__URL").filter(|u| !u.is_empty()) {
            builder = builder.set_override("database.url", url.clone())?;
        }
        let cfg: Config = builder.build()?.try_deserialize()?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.database.url.expose().is_empty() {
            return Err(invalid("database.url", "is required (or set DATABASE_URL)"));
        }
        if !self.database.url.expose().starts_with("postgres://")
            && !self.database.url.expose().starts_with("postgresql://")
        {
            return Err(invalid("database.url", "must be a postgres:// URL"));
        }
        if self.database.max_connections < 2 {
            return Err(invalid("database.max_connections", "must be at least 2"));
        }
        if self.worker.concurrency == 0 || self.worker.concurrency > 1000 {
            return Err(invalid("worker.concurrency", "must be between 1 and 1000"));
        }
        if self.worker.claim_batch > 10_000 {
            return Err(invalid("worker.claim_batch", "must be at most 10000"));
        }
        if self.worker.complete_batch > 10_000 {
            return Err(invalid("worker.complete_batch", "must be at most 10000"));
        }
        if self.worker.lease_seconds < 3 {
            return Err(invalid("worker.lease_seconds", "must be at least 3"));
        }
        if self.worker.poll_interval_ms == 0 {
            return Err(invalid("worker.poll_interval_ms", "must be positive"));
        }
        if self.worker.first_analyze_rows < 0 {
            return Err(invalid("worker.first_analyze_rows", "must be 0 (autovacuum only) or positive"));
        }
        if self.worker.first_analyze_interval_ms < 100 {
            return Err(invalid("worker.first_analyze_interval_ms", "must be at least 100"));
        }
        if !(1..=3600).contains(&self.worker.ring_slot_seconds) {
            return Err(invalid("worker.ring_slot_seconds", "must be between 1 and 3600"));
        }
        if !(1..=10_000).contains(&self.worker.ring_lock_timeout_ms) {
            return Err(invalid("worker.ring_lock_timeout_ms", "must be between 1 and 10000"));
        }
        if !(1..=100_000).contains(&self.worker.ring_move_batch) {
            return Err(invalid("worker.ring_move_batch", "must be between 1 and 100000"));
        }
        if !(0.0..=1.0).contains(&self.scoring.review_threshold) {
            return Err(invalid("scoring.review_threshold", "must be between 0 and 1"));
        }
        if self.smtp.tls == SmtpTls::None {
            if !self.smtp.allow_plaintext_loopback {
                return Err(invalid(
                    "smtp.tls",
                    "`none` requires smtp.allow_plaintext_loopback = true and a loopback host",
                ));
            }
            if !is_loopback_host(&self.smtp.host) {
                return Err(invalid("smtp.tls", "`none` is only allowed to a loopback host"));
            }
        }
        for s in &self.delivery.senders {
            let ok = match s.strip_prefix('@') {
                Some(domain) => !domain.is_empty() && !domain.contains('@'),
                None => s.split_once('@').is_some_and(|(l, d)| !l.is_empty() && !d.is_empty()),
            };
            if !ok {
                return Err(invalid("delivery.senders", format!("`{s}` is neither an address nor an @domain")));
            }
        }
        if self.delivery.max_send_attempts < 1 {
            return Err(invalid("delivery.max_send_attempts", "must be at least 1"));
        }
        for (name, e) in &self.delivery.webhook_endpoints {
            let rest = e.origin.trim().strip_prefix("https://").or_else(|| e.origin.trim().strip_prefix("http://"));
            if rest.is_none_or(|r| {
                r.trim_end_matches('/').is_empty() || r.trim_end_matches('/').contains(['/', '?', '#', '@'])
            }) {
                return Err(invalid(
                    "delivery.webhook_endpoints",
                    format!("`delivery.webhook_endpoints.{name}.origin`: expected https://host[:port]"),
                ));
            }
            if e.secret_env.trim().is_empty() {
                return Err(invalid(
                    "delivery.webhook_endpoints",
                    format!("`delivery.webhook_endpoints.{name}.secret_env`: must name an environment variable"),
                ));
            }
        }
        self.http.validate()?;
        self.validate_capsules()?;
        self.runs.validate()?;
        self.validate_models()?;
        self.retention.validate()?;
        Ok(())
    }
}

impl Config {
    fn validate_models(&self) -> Result<(), ConfigError> {
        for (name, m) in &self.models {
            if let Err(why) = models::Endpoint::parse(&m.endpoint) {
                return Err(invalid("models", format!("`models.{name}.endpoint`: {why}")));
            }
            if m.model.trim().is_empty() || m.model.len() > 200 {
                return Err(invalid("models", format!("`models.{name}.model`: 1 to 200 characters")));
            }
            if m.timeout_seconds == 0 || m.timeout_seconds > 3600 {
                return Err(invalid("models", format!("`models.{name}.timeout_seconds`: between 1 and 3600")));
            }
            if m.context_tokens < 256 {
                return Err(invalid("models", format!("`models.{name}.context_tokens`: at least 256")));
            }
        }
        self.agent.validate().map_err(|m| invalid("agent", m))?;
        for (id, t) in &self.tools {
            agent::check_tool_id(id).map_err(|m| invalid("tools", m))?;
            agent::check_closed_schema(id, &t.schema).map_err(|m| invalid("tools", m))?;
            if t.description.trim().is_empty() || t.description.len() > 2000 {
                return Err(invalid("tools", format!("`tools.{id}.description`: 1 to 2000 characters")));
            }
            if !t.url.starts_with("https://") && !t.url.starts_with("http://") {
                return Err(invalid("tools", format!("`tools.{id}.url`: an http(s) URL of an allowed webhook origin")));
            }
        }
        if let Some(m) = &self.scoring.model
            && !self.models.contains_key(m)
        {
            return Err(invalid("scoring.model", format!("`{m}` is not a configured model (models.{m}.*)")));
        }
        Ok(())
    }
}

/// Capsules and live migration (`capsules.*`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CapsulesConfig {
    /// The capsule store: each agent's latest checkpoint and the blobs (shared by nodes).
    pub store_dir: String,
    /// Name of the environment variable holding the fleet secret that authenticates node
    /// requests (HMAC).
    pub fleet_secret_env: String,
    /// Name of the environment variable holding the ed25519 seed for `capsule export --sign`.
    pub signing_key_env: String,
    /// Timeout of one node call.
    pub node_timeout_ms: u64,
    /// Node requests whose timestamp is further than this from the node's clock are refused.
    pub node_max_skew_seconds: i64,
    /// How long a migration waits before asking again when a node does not answer after
    /// the point of no return.
    pub migrate_retry_ms: u64,
    /// How often a node retries reconciling agents whose holder record it lost.
    pub reconcile_interval_seconds: u64,
    /// A file of `NAME=value` secrets a node lends to runs; without it, the environment
    /// variables `keyring_env_prefix` + NAME.
    pub keyring_file: Option<String>,
    pub keyring_env_prefix: String,
    /// ed25519 public keys (hex) whose signatures `capsule import` trusts: an import needs
    /// a signature by one of them (or `--allow-unsigned`, audited, for a new agent only).
    pub trusted_keys: Vec<String>,
    /// The largest file a capsule tar may hold; a bigger entry is refused from its header,
    /// before anything is read or allocated.
    pub max_tar_entry_bytes: u64,
    /// The most a capsule tar's files may hold together.
    pub max_tar_total_bytes: u64,
}

impl Default for CapsulesConfig {
    fn default() -> Self {
        Self {
            store_dir: "data/capsules".into(),
            fleet_secret_env: "AIRLOCK_FLEET_SECRET".into(),
            signing_key_env: "AIRLOCK_CAPSULE_SIGNING_KEY".into(),
            node_timeout_ms: 5000,
            node_max_skew_seconds: 30,
            migrate_retry_ms: 2000,
            reconcile_interval_seconds: 5,
            keyring_file: None,
            keyring_env_prefix: "AIRLOCK_SECRET_".into(),
            trusted_keys: Vec::new(),
            max_tar_entry_bytes: 64 * 1024 * 1024,
            max_tar_total_bytes: 1024 * 1024 * 1024,
        }
    }
}

/// One peer node (`nodes.<id>`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodePeerConfig {
    /// Base URL of the peer's node protocol, `http://host:port` or `https://…`.
    pub url: String,
}

impl Config {
    fn validate_capsules(&self) -> Result<(), ConfigError> {
        use crate::ids::NodeId;
        if let Some(id) = &self.worker.node_id {
            NodeId::parse(id).map_err(|_| {
                invalid(
                    "worker.node_id",
                    format!("`{id}`: 1 to 64 of a-z, 0-9, `_`, `-`, starting with a letter or digit"),
                )
            })?;
            if self.worker.data_dir.trim().is_empty() {
                return Err(invalid("worker.data_dir", "is required when worker.node_id is set"));
            }
        }
        for (id, peer) in &self.nodes {
            if NodeId::parse(id).is_err() {
                return Err(invalid("nodes", format!("`nodes.{id}`: node ids are 1 to 64 of a-z, 0-9, `_`, `-`")));
            }
            let url = peer.url.trim();
            let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.contains(['?', '#', '@'])) {
                return Err(invalid("nodes", format!("`nodes.{id}.url`: expected http(s)://host:port")));
            }
        }
        let c = &self.capsules;
        if c.store_dir.trim().is_empty() {
            return Err(invalid("capsules.store_dir", "must not be empty"));
        }
        if c.fleet_secret_env.trim().is_empty() {
            return Err(invalid("capsules.fleet_secret_env", "must name an environment variable"));
        }
        if c.node_timeout_ms == 0 {
            return Err(invalid("capsules.node_timeout_ms", "must be positive"));
        }
        if c.node_max_skew_seconds < 1 {
            return Err(invalid("capsules.node_max_skew_seconds", "must be at least 1"));
        }
        if c.migrate_retry_ms == 0 {
            return Err(invalid("capsules.migrate_retry_ms", "must be positive"));
        }
        for k in &c.trusted_keys {
            if k.len() != 64 || !k.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid(
                    "capsules.trusted_keys",
                    format!("`{k}` is not an ed25519 public key (64 hex digits)"),
                ));
            }
        }
        if c.reconcile_interval_seconds == 0 {
            return Err(invalid("capsules.reconcile_interval_seconds", "must be positive"));
        }
        if c.max_tar_entry_bytes == 0 || c.max_tar_total_bytes < c.max_tar_entry_bytes {
            return Err(invalid(
                "capsules.max_tar_total_bytes",
                "capsules.max_tar_entry_bytes must be positive and at most capsules.max_tar_total_bytes",
            ));
        }
        Ok(())
    }
}

/// Whether `host` names this machine: `localhost` or a loopback IP literal.
pub fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost") || h.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_and_alias() {
        let c = Config::from_sources(None, &vars(&[("DATABASE_URL", "postgres://x/y")])).unwrap();
        assert_eq!(c.database.url.expose(), "postgres://x/y");
        assert_eq!(c.api.listen.to_string(), "127.0.0.1:7070");
        assert_eq!(c.admin.listen.to_string(), "127.0.0.1:7071");
        assert_eq!(c.smtp.tls, SmtpTls::Required);
        assert_eq!(c.smtp.port, 587);
        assert_eq!(c.worker.concurrency, 8);
        assert_eq!(c.worker.lease_seconds, 30);
        assert_eq!(c.scoring.review_threshold, 0.7);
        assert_eq!(c.delivery.webhook_secret_env, "AIRLOCK_WEBHOOK_SECRET");
        assert!(c.delivery.senders.is_empty());
    }

    #[test]
    fn env_overrides_with_lists() {
        let c = Config::from_sources(
            None,
            &vars(&[
                ("DATABASE_URL", "postgres://alias/db"),
                ("AIRLOCK__DATABASE__URL", "postgres://real/db"),
                ("AIRLOCK__WORKER__CONCURRENCY", "3"),
                ("AIRLOCK__WORKER__QUEUES", "default,send"),
                ("AIRLOCK__DELIVERY__SENDERS", "a@example.com,@example.org"),
                ("AIRLOCK__SMTP__ALLOW_PLAINTEXT_LOOPBACK", "true"),
                ("AIRLOCK__SMTP__TLS", "none"),
            ]),
        )
        .unwrap();
        assert_eq!(c.database.url.expose(), "postgres://real/db");
        assert_eq!(c.worker.concurrency, 3);
        assert_eq!(c.worker.queues, vec!["default", "send"]);
        assert_eq!(c.delivery.senders, vec!["a@example.com", "@example.org"]);
        assert_eq!(c.smtp.tls, SmtpTls::None);
    }

    #[test]
    fn invalid_values_name_the_key() {
        let base = ("DATABASE_URL", "postgres://x/y");
        let err = |extra: (&str, &str)| Config::from_sources(None, &vars(&[base, extra])).unwrap_err().to_string();
        assert!(err(("AIRLOCK__WORKER__CONCURRENCY", "0")).contains("worker.concurrency"));
        assert!(err(("AIRLOCK__WORKER__CONCURRENCY", "many")).contains("concurrency"));
        assert!(err(("AIRLOCK__SMTP__TLS", "none")).contains("smtp.tls"));
        assert!(err(("AIRLOCK__SMTP__TLS", "maybe")).contains("tls"));
        assert!(err(("AIRLOCK__SCORING__REVIEW_THRESHOLD", "2")).contains("scoring.review_threshold"));
        assert!(err(("AIRLOCK__DELIVERY__SENDERS", "nobody")).contains("delivery.senders"));
        assert!(err(("AIRLOCK__WORKER__FIRST_ANALYZE_ROWS", "-1")).contains("worker.first_analyze_rows"));
        assert!(err(("AIRLOCK__WORKER__FIRST_ANALYZE_INTERVAL_MS", "10")).contains("worker.first_analyze_interval_ms"));
        assert!(
            err(("AIRLOCK__RETENTION__EVENT_PARTITION_SECONDS", "0")).contains("retention.event_partition_seconds")
        );
        assert!(err(("AIRLOCK__RETENTION__EVENT_PARTITIONS_AHEAD", "0")).contains("retention.event_partitions_ahead"));
        assert!(err(("AIRLOCK__RETENTION__LOCK_TIMEOUT_MS", "0")).contains("retention.lock_timeout_ms"));
        assert!(
            err(("AIRLOCK__RETENTION__ARCHIVE_EVENTS_AFTER_SECONDS", "-1")).contains("archive_events_after_seconds")
        );
        let missing = Config::from_sources(None, &[]).unwrap_err().to_string();
        assert!(missing.contains("database.url"), "{missing}");
    }

    #[test]
    fn plaintext_refused_to_remote_host() {
        let e = Config::from_sources(
            None,
            &vars(&[
                ("DATABASE_URL", "postgres://x/y"),
                ("AIRLOCK__SMTP__TLS", "none"),
                ("AIRLOCK__SMTP__ALLOW_PLAINTEXT_LOOPBACK", "true"),
                ("AIRLOCK__SMTP__HOST", "smtp.example.com"),
            ]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("loopback"));
    }

    #[test]
    fn capsule_and_node_settings() {
        let base = ("DATABASE_URL", "postgres://x/y");
        let c = Config::from_sources(
            None,
            &vars(&[
                base,
                ("AIRLOCK__WORKER__NODE_ID", "node_a"),
                ("AIRLOCK__NODES__NODE_B__URL", "http://127.0.0.1:7100"),
                ("AIRLOCK__CAPSULES__STORE_DIR", "/tmp/store"),
            ]),
        )
        .unwrap();
        assert_eq!(c.worker.node_id.as_deref(), Some("node_a"));
        assert_eq!(c.worker.node_listen.to_string(), "127.0.0.1:7072");
        assert_eq!(c.nodes["node_b"].url, "http://127.0.0.1:7100");
        assert_eq!(c.capsules.store_dir, "/tmp/store");
        assert_eq!(c.capsules.fleet_secret_env, "AIRLOCK_FLEET_SECRET");
        let err = |extra: (&str, &str)| Config::from_sources(None, &vars(&[base, extra])).unwrap_err().to_string();
        assert!(err(("AIRLOCK__WORKER__NODE_ID", "a/b")).contains("worker.node_id"));
        assert!(err(("AIRLOCK__NODES__NODE_B__URL", "ftp://x")).contains("nodes.node_b.url"));
        assert!(err(("AIRLOCK__CAPSULES__NODE_TIMEOUT_MS", "0")).contains("capsules.node_timeout_ms"));
        assert!(err(("AIRLOCK__CAPSULES__STORE_DIRR", "x")).contains("store_dirr"));
    }

    #[test]
    fn loopback_hosts() {
        assert!(is_loopback_host("localhost"));
        assert!(is_loopback_host("127.0.0.1"));
        assert!(is_loopback_host("[::1]"));
        assert!(!is_loopback_host("10.0.0.1"));
        assert!(!is_loopback_host("example.com"));
    }

    #[test]
    fn unknown_key_in_file_refused() {
        let dir = std::env::temp_dir().join(format!("airlock-cfg-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(&path, "[worker]\nconcurency = 4\n").unwrap();
        let e = Config::from_sources(Some(path.to_str().unwrap()), &vars(&[("DATABASE_URL", "postgres://x/y")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("concurency"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
