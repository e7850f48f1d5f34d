//! The `sandbox` configuration section, parsed into resolved settings.
//!
//! Keys (all optional; the built-in tiers apply when nothing is set):
//! - `sandbox.tiers.<name>.cpus`, `.memory_mb`, `.disk_mb`, `.timeout_seconds`,
//!   `.cost_per_minute`: a tier. The built-in `light`, `standard` and `heavy` always exist;
//!   setting one of their keys overrides that key only. A new tier must set every key but
//!   `disk_mb`.
//! - `sandbox.default_tier`: the tier an agent gets when it names none (`standard`).
//! - `sandbox.allowed_tiers`: tiers an agent may be given without an entry of its own
//!   (`light,standard`).
//! - `sandbox.approval_tiers`: tiers that only a human can grant (`heavy`).
//! - `sandbox.agents.<agent>.allowed_tiers`, `.default_tier`, `.quota_minutes_per_day`,
//!   `.context`, `.secrets`: one agent's scope. `context` lists the other agents whose
//!   durable context it may mount (its own is always allowed; `*` allows every agent);
//!   `secrets` lists the keyring names its tasks may receive.
//! - `sandbox.platform.kinds.<kind>`: the tier the platform gives a task kind;
//!   `sandbox.platform.history_min_samples` (3) and `.history_days` (30) bound the history
//!   rule.
//! - `sandbox.tiers.<name>.network` (`false`: no network at all) and `.max_processes`
//!   (light 64, standard 256, heavy 1024; 256 for a new tier): what a run may reach and
//!   how many processes and threads it may have at once.
//! - `sandbox.work_dir`: where run directories are made (`<temp dir>/airlock-sandbox`);
//!   local to one host (a starting worker removes what dead workers of this host left);
//!   `sandbox.max_output_bytes`: how much of each output stream is kept (65536).
//! - Isolation: `sandbox.isolation` (`bubblewrap`, or `none`, which needs
//!   `sandbox.allow_unisolated = true`), `sandbox.bwrap_path` (`/usr/bin/bwrap`),
//!   `sandbox.uid` and `sandbox.uid_count` (the host uids runs get, one per run in
//!   progress: 900000 and 64), `sandbox.read_only_paths` (more host directories a run may
//!   read), `sandbox.slirp4netns_path` (`/usr/bin/slirp4netns`, for tiers with a network)
//!   and `sandbox.protected_endpoints` (`host:port` a run with a network must not reach,
//!   besides those the worker's own configuration names).
//!
//! Secret values come from the host keyring that capsules use too (`capsules.keyring_file`
//! or the variables `capsules.keyring_env_prefix` + NAME).
//!
//! Environment variables reach keys lowercased (`AIRLOCK__SANDBOX__AGENTS__BOT-7__…`
//! names agent `bot-7`), so agents with upper-case ids are configured in the TOML file.
//! List values may be TOML arrays or comma-separated strings.
//!
//! Parsing resolves everything once (tiers merged with the built-ins, every tier name
//! checked), so a [`SandboxConfig`] that exists is valid: errors name the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

/// One tier: the limits a run gets and what a minute of it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tier {
    pub name: String,
    /// CPU cores; without cgroups it bounds CPU time (`cpus × timeout_seconds`).
    pub cpus: f64,
    /// Resident memory of the whole run; more is killed (`killed_for: "memory"`).
    pub memory_mb: u64,
    /// Largest file a run may write (RLIMIT_FSIZE).
    pub disk_mb: u64,
    /// Wall clock; past it the run is killed (`timed_out: true`).
    pub timeout_seconds: u64,
    /// Price of one minute, in the operator's accounting unit.
    pub cost_per_minute: f64,
    /// Whether a run has a network. Without one it has only a loopback of its own; with
    /// one it still never reaches the worker's database, relay, node protocol or APIs.
    /// (Snapshots of decisions made before the key existed read as `false`.)
    #[serde(default)]
    pub network: bool,
    /// Processes and threads a run may have at once; one more stops it
    /// (`killed_for: "processes"`).
    #[serde(default = "default_max_processes")]
    pub max_processes: u32,
}

/// `max_processes` of a tier that does not set it, and of decisions snapshotted before
/// the key existed.
pub const DEFAULT_MAX_PROCESSES: u32 = 256;

fn default_max_processes() -> u32 {
    DEFAULT_MAX_PROCESSES
}

impl Tier {
    pub fn memory_kib(&self) -> u64 {
        self.memory_mb.saturating_mul(1024)
    }
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_seconds.saturating_mul(1000)
    }
    /// Cost of a run of `duration_ms` in this tier.
    pub fn cost_of(&self, duration_ms: u64) -> f64 {
        self.cost_per_minute * duration_ms as f64 / 60_000.0
    }
}

/// The configured tiers, smallest first (by memory, then timeout, cpus and name).
#[derive(Debug, Clone, PartialEq)]
pub struct Tiers(Vec<Tier>);

impl Tiers {
    pub fn get(&self, name: &str) -> Option<&Tier> {
        self.0.iter().find(|t| t.name == name)
    }
    /// Smallest first.
    pub fn iter(&self) -> impl Iterator<Item = &Tier> {
        self.0.iter()
    }
    pub fn names(&self) -> Vec<&str> {
        self.0.iter().map(|t| t.name.as_str()).collect()
    }
    pub fn smallest(&self) -> &Tier {
        &self.0[0]
    }
    pub fn largest(&self) -> &Tier {
        &self.0[self.0.len() - 1]
    }
    fn new(mut tiers: Vec<Tier>) -> Self {
        tiers.sort_by(|a, b| {
            (a.memory_mb, a.timeout_seconds)
                .cmp(&(b.memory_mb, b.timeout_seconds))
                .then(a.cpus.total_cmp(&b.cpus))
                .then(a.name.cmp(&b.name))
        });
        Self(tiers)
    }
}

/// What one agent may get.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentPolicy {
    pub allowed_tiers: Vec<String>,
    pub default_tier: String,
    /// Sandbox minutes per rolling 24 hours (each decision reserves its tier's timeout
    /// until its outcome replaces that with the real duration); 0 is unlimited.
    pub quota_minutes_per_day: u64,
    /// Other agents whose context it may mount; `*` is every agent.
    pub context: Vec<String>,
    /// Keyring names its tasks may receive.
    pub secrets: Vec<String>,
}

impl AgentPolicy {
    pub fn allows_tier(&self, tier: &str) -> bool {
        self.allowed_tiers.iter().any(|t| t == tier)
    }
    pub fn may_read_context_of(&self, own: &str, other: &str) -> bool {
        other == own || self.context.iter().any(|c| c == "*" || c == other)
    }
    pub fn may_use_secret(&self, name: &str) -> bool {
        self.secrets.iter().any(|s| s == name)
    }
}

/// The platform's central rules.
#[derive(Debug, Clone, PartialEq)]
pub struct PlatformRules {
    /// Task kind → tier.
    pub kinds: BTreeMap<String, String>,
    /// Finished similar tasks needed before history decides.
    pub history_min_samples: usize,
    pub history_days: u32,
}

/// How runs are kept apart from the worker that runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Every run in its own user, PID, mount, IPC, UTS and network namespaces, as a uid
    /// of its own (Debian's `bubblewrap`).
    Bubblewrap,
    /// The run shares the worker's user, files and network: development only, and only
    /// with `sandbox.allow_unisolated = true`.
    None,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Bubblewrap => "bubblewrap",
            Isolation::None => "none",
        }
    }
}

/// A `host:port` a run with a network must not reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// A name or an address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// `host:port` or `[v6]:port`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let (host, port) = match s.strip_prefix('[') {
            Some(rest) => {
                let (h, p) = rest.split_once("]:")?;
                (h, p)
            }
            None => s.rsplit_once(':')?,
        };
        let port: u16 = port.parse().ok()?;
        let valid_host = !host.is_empty()
            && host.len() <= 253
            && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'));
        (valid_host && port > 0).then(|| Endpoint { host: host.to_string(), port })
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// The resolved `sandbox` section.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawSandbox")]
pub struct SandboxConfig {
    pub tiers: Tiers,
    pub default_tier: String,
    pub allowed_tiers: Vec<String>,
    pub approval_tiers: Vec<String>,
    agents: BTreeMap<String, AgentPolicy>,
    /// The policy of an agent with no entry.
    fallback: AgentPolicy,
    pub platform: PlatformRules,
    pub work_dir: PathBuf,
    pub max_output_bytes: usize,
    /// How runs are isolated; `None` only with `allow_unisolated`.
    pub isolation: Isolation,
    pub allow_unisolated: bool,
    /// The bubblewrap binary (absolute: never looked up on a PATH).
    pub bwrap_path: PathBuf,
    /// The user-mode network stack that gives a tier with `network` its network.
    pub slirp4netns_path: PathBuf,
    /// The first host uid runs get; each run in progress on a host takes one of
    /// `uid .. uid + uid_count` for itself (its gid is the same number).
    pub uid: u32,
    pub uid_count: u32,
    /// Host directories a run may read, besides the system's own (`/usr`, parts of `/etc`).
    pub read_only_paths: Vec<PathBuf>,
    /// Endpoints a run with a network must not reach, besides those the worker's own
    /// configuration names (database, relay, nodes, APIs).
    pub protected_endpoints: Vec<Endpoint>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig::try_from(RawSandbox::default()).expect("the built-in sandbox configuration is valid")
    }
}

impl SandboxConfig {
    /// The scope of `agent`: its own entry, matched exactly (agent ids are case-sensitive:
    /// `Bot-7` never gets `bot-7`'s secrets), or the defaults, which hold no context and no
    /// secrets. Environment keys arrive lowercased, so an id with capitals is configured in
    /// the file; until it is, that agent gets the defaults.
    pub fn policy(&self, agent: &str) -> &AgentPolicy {
        self.agents.get(agent).unwrap_or(&self.fallback)
    }

    /// Whether a machine may grant `tier` on its own.
    pub fn needs_approval(&self, tier: &str) -> bool {
        self.approval_tiers.iter().any(|t| t == tier)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTier {
    cpus: Option<f64>,
    memory_mb: Option<u64>,
    disk_mb: Option<u64>,
    timeout_seconds: Option<u64>,
    cost_per_minute: Option<f64>,
    network: Option<bool>,
    max_processes: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    #[serde(default, deserialize_with = "de_opt_list")]
    allowed_tiers: Option<Vec<String>>,
    default_tier: Option<String>,
    quota_minutes_per_day: Option<u64>,
    #[serde(default, deserialize_with = "de_opt_list")]
    context: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de_opt_list")]
    secrets: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawPlatform {
    kinds: BTreeMap<String, String>,
    history_min_samples: usize,
    history_days: u32,
}

impl Default for RawPlatform {
    fn default() -> Self {
        Self { kinds: BTreeMap::new(), history_min_samples: 3, history_days: 30 }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSandbox {
    tiers: BTreeMap<String, RawTier>,
    default_tier: String,
    #[serde(deserialize_with = "de_list")]
    allowed_tiers: Vec<String>,
    #[serde(deserialize_with = "de_list")]
    approval_tiers: Vec<String>,
    agents: BTreeMap<String, RawAgent>,
    platform: RawPlatform,
    work_dir: Option<String>,
    max_output_bytes: usize,
    /// Per-agent defaults for agents without an entry.
    quota_minutes_per_day: u64,
    isolation: Isolation,
    allow_unisolated: bool,
    bwrap_path: String,
    slirp4netns_path: String,
    uid: u32,
    uid_count: u32,
    #[serde(deserialize_with = "de_list")]
    read_only_paths: Vec<String>,
    #[serde(deserialize_with = "de_list")]
    protected_endpoints: Vec<String>,
}

impl Default for RawSandbox {
    fn default() -> Self {
        Self {
            tiers: BTreeMap::new(),
            default_tier: "standard".into(),
            allowed_tiers: vec!["light".into(), "standard".into()],
            approval_tiers: vec!["heavy".into()],
            agents: BTreeMap::new(),
            platform: RawPlatform::default(),
            work_dir: None,
            max_output_bytes: 64 * 1024,
            quota_minutes_per_day: 0,
            isolation: Isolation::Bubblewrap,
            allow_unisolated: false,
            bwrap_path: "/usr/bin/bwrap".into(),
            slirp4netns_path: "/usr/bin/slirp4netns".into(),
            uid: DEFAULT_UID,
            uid_count: 64,
            read_only_paths: Vec::new(),
            protected_endpoints: Vec::new(),
        }
    }
}

/// The first uid of the range runs get by default: above the usual account and
/// sub-uid ranges (`/etc/subuid` starts at 100000 and grows by 65536 per user).
pub const DEFAULT_UID: u32 = 900_000;

/// The built-in tiers.
fn builtin_tiers() -> Vec<Tier> {
    let t = |name: &str,
             cpus: f64,
             memory_mb: u64,
             disk_mb: u64,
             timeout_seconds: u64,
             cost_per_minute: f64,
             max_processes: u32| Tier {
        name: name.into(),
        cpus,
        memory_mb,
        disk_mb,
        timeout_seconds,
        cost_per_minute,
        network: false,
        max_processes,
    };
    vec![
        t("light", 1.0, 512, 1024, 300, 0.01, 64),
        t("standard", 2.0, 2048, 10 * 1024, 1800, 0.04, 256),
        t("heavy", 4.0, 8192, 50 * 1024, 7200, 0.16, 1024),
    ]
}

fn required<T>(v: Option<T>, key: &str) -> Result<T, String> {
    v.ok_or_else(|| format!("{key}: is required for a tier that is not built in"))
}

/// A tier name: lowercase (environment keys are lowercased), short, no dots.
fn valid_tier_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

impl TryFrom<RawSandbox> for SandboxConfig {
    type Error = String;

    fn try_from(raw: RawSandbox) -> Result<Self, String> {
        let isolation = check_isolation(&raw)?;
        let mut tiers = builtin_tiers();
        for (name, o) in &raw.tiers {
            let key = |field: &str| format!("sandbox.tiers.{name}.{field}");
            if !valid_tier_name(name) {
                return Err(format!(
                    "sandbox.tiers.{name}: a tier name is 1 to 32 of a-z, 0-9, `_`, `-`, starting with a letter or digit"
                ));
            }
            let tier = match tiers.iter_mut().find(|t| &t.name == name) {
                Some(t) => t,
                None => {
                    tiers.push(Tier {
                        name: name.clone(),
                        cpus: required(o.cpus, &key("cpus"))?,
                        memory_mb: required(o.memory_mb, &key("memory_mb"))?,
                        disk_mb: 1024,
                        timeout_seconds: required(o.timeout_seconds, &key("timeout_seconds"))?,
                        cost_per_minute: required(o.cost_per_minute, &key("cost_per_minute"))?,
                        network: false,
                        max_processes: DEFAULT_MAX_PROCESSES,
                    });
                    tiers.last_mut().ok_or("unreachable")?
                }
            };
            if let Some(v) = o.cpus {
                tier.cpus = v;
            }
            if let Some(v) = o.memory_mb {
                tier.memory_mb = v;
            }
            if let Some(v) = o.disk_mb {
                tier.disk_mb = v;
            }
            if let Some(v) = o.timeout_seconds {
                tier.timeout_seconds = v;
            }
            if let Some(v) = o.cost_per_minute {
                tier.cost_per_minute = v;
            }
            if let Some(v) = o.network {
                tier.network = v;
            }
            if let Some(v) = o.max_processes {
                tier.max_processes = v;
            }
        }
        for t in &tiers {
            let key = |field: &str| format!("sandbox.tiers.{}.{field}", t.name);
            if !(t.cpus.is_finite() && t.cpus > 0.0 && t.cpus <= 1024.0) {
                return Err(format!("{}: must be more than 0 and at most 1024", key("cpus")));
            }
            if !(16..=4 * 1024 * 1024).contains(&t.memory_mb) {
                return Err(format!("{}: must be between 16 and 4194304", key("memory_mb")));
            }
            if t.disk_mb == 0 {
                return Err(format!("{}: must be positive", key("disk_mb")));
            }
            if !(1..=7 * 24 * 3600).contains(&t.timeout_seconds) {
                return Err(format!("{}: must be between 1 and 604800", key("timeout_seconds")));
            }
            if !(t.cost_per_minute.is_finite() && t.cost_per_minute >= 0.0) {
                return Err(format!("{}: must be 0 or more", key("cost_per_minute")));
            }
            if !(1..=MAX_PROCESSES_CEILING).contains(&t.max_processes) {
                return Err(format!("{}: must be between 1 and {MAX_PROCESSES_CEILING}", key("max_processes")));
            }
        }
        let tiers = Tiers::new(tiers);
        let known = |name: &str, key: &str| -> Result<(), String> {
            match tiers.get(name) {
                Some(_) => Ok(()),
                None => Err(format!("{key}: unknown tier `{name}` (tiers: {})", tiers.names().join(", "))),
            }
        };
        known(&raw.default_tier, "sandbox.default_tier")?;
        for t in &raw.allowed_tiers {
            known(t, "sandbox.allowed_tiers")?;
        }
        for t in &raw.approval_tiers {
            known(t, "sandbox.approval_tiers")?;
        }
        for (kind, t) in &raw.platform.kinds {
            known(t, &format!("sandbox.platform.kinds.{kind}"))?;
        }
        if raw.platform.history_min_samples == 0 {
            return Err("sandbox.platform.history_min_samples: must be at least 1".into());
        }
        if raw.platform.history_days == 0 {
            return Err("sandbox.platform.history_days: must be at least 1".into());
        }
        if !(1024..=16 * 1024 * 1024).contains(&raw.max_output_bytes) {
            return Err("sandbox.max_output_bytes: must be between 1024 and 16777216".into());
        }
        let fallback = AgentPolicy {
            allowed_tiers: raw.allowed_tiers.clone(),
            default_tier: raw.default_tier.clone(),
            quota_minutes_per_day: raw.quota_minutes_per_day,
            context: Vec::new(),
            secrets: Vec::new(),
        };
        let mut agents = BTreeMap::new();
        for (agent, a) in raw.agents {
            let key = |field: &str| format!("sandbox.agents.{agent}.{field}");
            let allowed = a.allowed_tiers.unwrap_or_else(|| fallback.allowed_tiers.clone());
            for t in &allowed {
                known(t, &key("allowed_tiers"))?;
            }
            let default_tier = a.default_tier.unwrap_or_else(|| raw.default_tier.clone());
            known(&default_tier, &key("default_tier"))?;
            for s in a.secrets.iter().flatten() {
                if !valid_env_name(s) {
                    return Err(format!("{}: `{s}` is not a variable name", key("secrets")));
                }
                if is_loader_variable(s) {
                    return Err(format!(
                        "{}: `{s}` steers how programs are loaded or found; a task cannot receive it",
                        key("secrets")
                    ));
                }
            }
            agents.insert(
                agent,
                AgentPolicy {
                    allowed_tiers: allowed,
                    default_tier,
                    quota_minutes_per_day: a.quota_minutes_per_day.unwrap_or(raw.quota_minutes_per_day),
                    context: a.context.unwrap_or_default(),
                    secrets: a.secrets.unwrap_or_default(),
                },
            );
        }
        Ok(SandboxConfig {
            isolation,
            allow_unisolated: raw.allow_unisolated,
            bwrap_path: PathBuf::from(&raw.bwrap_path),
            slirp4netns_path: PathBuf::from(&raw.slirp4netns_path),
            uid: raw.uid,
            uid_count: raw.uid_count,
            read_only_paths: raw.read_only_paths.iter().map(PathBuf::from).collect(),
            protected_endpoints: raw
                .protected_endpoints
                .iter()
                .map(|e| Endpoint::parse(e))
                .collect::<Option<Vec<_>>>()
                .ok_or("sandbox.protected_endpoints: each entry is `host:port` (`[v6]:port` for an IPv6 address)")?,
            tiers,
            default_tier: raw.default_tier,
            allowed_tiers: raw.allowed_tiers,
            approval_tiers: raw.approval_tiers,
            agents,
            fallback,
            platform: PlatformRules {
                kinds: raw.platform.kinds,
                history_min_samples: raw.platform.history_min_samples,
                history_days: raw.platform.history_days,
            },
            work_dir: raw.work_dir.map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("airlock-sandbox")),
            max_output_bytes: raw.max_output_bytes,
        })
    }
}

/// The most `max_processes` a tier may allow.
pub const MAX_PROCESSES_CEILING: u32 = 100_000;

/// The isolation settings, checked: `none` only when allowed, absolute binaries, a uid
/// range clear of root, the overflow uid and the 32-bit edge, absolute read-only paths.
fn check_isolation(raw: &RawSandbox) -> Result<Isolation, String> {
    if raw.isolation == Isolation::None && !raw.allow_unisolated {
        return Err("sandbox.isolation: `none` runs tasks as the worker's own user, with its files, processes and \
                    network; it needs sandbox.allow_unisolated = true (development only)"
            .into());
    }
    for (key, path) in [("sandbox.bwrap_path", &raw.bwrap_path), ("sandbox.slirp4netns_path", &raw.slirp4netns_path)] {
        if !Path::new(path).is_absolute() {
            return Err(format!("{key}: must be an absolute path (a program is never looked up on a PATH)"));
        }
    }
    if !(1..=65_536).contains(&raw.uid_count) {
        return Err("sandbox.uid_count: must be between 1 and 65536".into());
    }
    if raw.uid < 1000 {
        return Err("sandbox.uid: must be at least 1000 (system accounts live below it)".into());
    }
    let last = u64::from(raw.uid) + u64::from(raw.uid_count) - 1;
    if last > 4_294_967_293 {
        return Err(
            "sandbox.uid: the range sandbox.uid .. sandbox.uid + sandbox.uid_count must end below 4294967294".into()
        );
    }
    if (u64::from(raw.uid)..=last).contains(&65_534) {
        return Err("sandbox.uid: the range must not contain 65534, the overflow uid (`nobody`)".into());
    }
    for p in &raw.read_only_paths {
        let path = Path::new(p);
        if !path.is_absolute()
            || path.components().any(|c| matches!(c, std::path::Component::ParentDir))
            || path == Path::new("/")
        {
            return Err(format!("sandbox.read_only_paths: `{p}` must be an absolute path below `/`, without `..`"));
        }
    }
    Ok(raw.isolation)
}

/// Variables that steer how programs are loaded, found or started: the dynamic loader's
/// (`LD_*`), the C library's (`GLIBC_TUNABLES`, `GCONV_PATH`, …), the shells' (`PATH`,
/// `BASH_ENV`, `ENV`, `IFS`, …) and language runtimes' (`PYTHON*`, `PERL*`, `RUBY*`,
/// `NODE_OPTIONS`, `JAVA_TOOL_OPTIONS`, …). A task gets a fixed `PATH` and none of the
/// others from an agent: the command is the agent's to choose, how programs load is not.
pub fn is_loader_variable(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "PATH",
        "BASH_ENV",
        "ENV",
        "IFS",
        "CDPATH",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "PROMPT_COMMAND",
        "GLOBIGNORE",
        "GLIBC_TUNABLES",
        "GCONV_PATH",
        "LOCPATH",
        "NLSPATH",
        "HOSTALIASES",
        "RESOLV_HOST_CONF",
        "TZDIR",
        "NODE_OPTIONS",
        "NODE_PATH",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "JDK_JAVA_OPTIONS",
    ];
    const PREFIXES: &[&str] = &["LD_", "BASH_FUNC_", "MALLOC_", "PYTHON", "PERL", "RUBY"];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

/// An environment variable name: `[A-Za-z_][A-Za-z0-9_]*`, at most 128 bytes.
pub fn valid_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && s.len() <= 128
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ListOrString {
    List(Vec<String>),
    String(String),
}

fn split_list(v: ListOrString) -> Vec<String> {
    match v {
        ListOrString::List(l) => l.into_iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        ListOrString::String(s) => s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect(),
    }
}

/// A list given as an array or as a comma-separated string (environment variables whose
/// keys are not known in advance arrive as strings).
fn de_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    ListOrString::deserialize(d).map(split_list)
}

fn de_opt_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    Option::<ListOrString>::deserialize(d).map(|v| v.map(split_list))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn load(extra: &[(&str, &str)]) -> Result<Config, String> {
        let mut vars = vec![("DATABASE_URL".to_string(), "postgres://x/y".to_string())];
        vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_sources(None, &vars).map_err(|e| e.to_string())
    }

    #[test]
    fn built_in_tiers_smallest_first() {
        let c = load(&[]).unwrap();
        let s = &c.sandbox;
        assert_eq!(s.tiers.names(), vec!["light", "standard", "heavy"]);
        assert_eq!(s.default_tier, "standard");
        assert_eq!(s.policy("anyone").allowed_tiers, vec!["light", "standard"]);
        assert!(s.needs_approval("heavy"));
        assert_eq!(s.tiers.smallest().name, "light");
        assert_eq!(s.tiers.largest().name, "heavy");
    }

    #[test]
    fn env_overrides_one_key_and_adds_agents() {
        let c = load(&[
            ("AIRLOCK__SANDBOX__TIERS__LIGHT__TIMEOUT_SECONDS", "2"),
            ("AIRLOCK__SANDBOX__TIERS__GPU__CPUS", "8"),
            ("AIRLOCK__SANDBOX__TIERS__GPU__MEMORY_MB", "65536"),
            ("AIRLOCK__SANDBOX__TIERS__GPU__TIMEOUT_SECONDS", "600"),
            ("AIRLOCK__SANDBOX__TIERS__GPU__COST_PER_MINUTE", "1.5"),
            ("AIRLOCK__SANDBOX__DEFAULT_TIER", "light"),
            ("AIRLOCK__SANDBOX__AGENTS__BOT-7__ALLOWED_TIERS", "light,heavy"),
            ("AIRLOCK__SANDBOX__AGENTS__BOT-7__QUOTA_MINUTES_PER_DAY", "30"),
            ("AIRLOCK__SANDBOX__AGENTS__BOT-7__SECRETS", "API_TOKEN"),
        ])
        .unwrap();
        let s = &c.sandbox;
        let light = s.tiers.get("light").unwrap();
        assert_eq!(light.timeout_seconds, 2);
        assert_eq!(light.memory_mb, 512, "other keys keep their built-in values");
        assert_eq!(s.tiers.names(), vec!["light", "standard", "heavy", "gpu"]);
        assert_eq!(s.tiers.get("gpu").unwrap().cost_per_minute, 1.5);
        // Environment keys arrive lowercased; ids are compared exactly.
        assert_eq!(s.policy("BOT-7"), &s.fallback, "another agent's id, by case, gets only the defaults");
        assert!(!s.policy("BOT-7").may_use_secret("API_TOKEN"));
        let p = s.policy("bot-7");
        assert_eq!(p.allowed_tiers, vec!["light", "heavy"]);
        assert_eq!(p.default_tier, "light");
        assert_eq!(p.quota_minutes_per_day, 30);
        assert!(p.may_use_secret("API_TOKEN"));
        assert!(p.may_read_context_of("bot-7", "bot-7"));
        assert!(!p.may_read_context_of("bot-7", "other"));
    }

    #[test]
    fn invalid_values_name_the_key() {
        let e = |k: &str, v: &str| load(&[(k, v)]).unwrap_err();
        assert!(e("AIRLOCK__SANDBOX__DEFAULT_TIER", "huge").contains("sandbox.default_tier"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__LIGHT__MEMORY_MB", "0").contains("sandbox.tiers.light.memory_mb"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__LIGHT__CPUS", "0").contains("sandbox.tiers.light.cpus"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__GPU__CPUS", "2").contains("sandbox.tiers.gpu.memory_mb"));
        assert!(e("AIRLOCK__SANDBOX__AGENTS__A__DEFAULT_TIER", "nope").contains("sandbox.agents.a.default_tier"));
        assert!(e("AIRLOCK__SANDBOX__ALLOWED_TIERS", "light,nope").contains("sandbox.allowed_tiers"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__LIGHT__MEMORY", "1").contains("memory"));
        assert!(e("AIRLOCK__SANDBOX__PLATFORM__KINDS__BUILD", "nope").contains("sandbox.platform.kinds.build"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__LIGHT__MAX_PROCESSES", "0").contains("sandbox.tiers.light.max_processes"));
        assert!(e("AIRLOCK__SANDBOX__TIERS__LIGHT__NETWORK", "maybe").contains("network"));
        assert!(e("AIRLOCK__SANDBOX__ISOLATION", "chroot").contains("isolation"));
        assert!(e("AIRLOCK__SANDBOX__BWRAP_PATH", "bwrap").contains("sandbox.bwrap_path"));
        assert!(e("AIRLOCK__SANDBOX__SLIRP4NETNS_PATH", "slirp4netns").contains("sandbox.slirp4netns_path"));
        assert!(e("AIRLOCK__SANDBOX__UID", "0").contains("sandbox.uid"));
        assert!(e("AIRLOCK__SANDBOX__UID", "65500").contains("sandbox.uid"), "the range holds 65534");
        assert!(e("AIRLOCK__SANDBOX__UID", "4294967290").contains("sandbox.uid"));
        assert!(e("AIRLOCK__SANDBOX__UID_COUNT", "0").contains("sandbox.uid_count"));
        assert!(e("AIRLOCK__SANDBOX__READ_ONLY_PATHS", "/opt,relative").contains("sandbox.read_only_paths"));
        assert!(e("AIRLOCK__SANDBOX__READ_ONLY_PATHS", "/opt/../etc").contains("sandbox.read_only_paths"));
        assert!(e("AIRLOCK__SANDBOX__PROTECTED_ENDPOINTS", "db.internal").contains("sandbox.protected_endpoints"));
        assert!(
            e("AIRLOCK__SANDBOX__AGENTS__A__SECRETS", "LD_PRELOAD").contains("sandbox.agents.a.secrets"),
            "a secret named like a loader setting would reach the task's loader"
        );
    }

    #[test]
    fn isolation_is_bubblewrap_unless_unisolated_runs_are_allowed() {
        use super::{Endpoint, Isolation};
        let c = load(&[]).unwrap();
        let s = &c.sandbox;
        assert_eq!(s.isolation, Isolation::Bubblewrap);
        assert!(!s.allow_unisolated);
        assert_eq!(s.bwrap_path.to_str(), Some("/usr/bin/bwrap"));
        assert_eq!((s.uid, s.uid_count), (900_000, 64));
        let limits: Vec<(bool, u32)> = s.tiers.iter().map(|t| (t.network, t.max_processes)).collect();
        assert_eq!(limits, vec![(false, 64), (false, 256), (false, 1024)]);

        let refused = load(&[("AIRLOCK__SANDBOX__ISOLATION", "none")]).unwrap_err();
        assert!(refused.contains("sandbox.isolation") && refused.contains("sandbox.allow_unisolated"), "{refused}");
        let c =
            load(&[("AIRLOCK__SANDBOX__ISOLATION", "none"), ("AIRLOCK__SANDBOX__ALLOW_UNISOLATED", "true")]).unwrap();
        assert_eq!(c.sandbox.isolation, Isolation::None);

        let c = load(&[
            ("AIRLOCK__SANDBOX__TIERS__LIGHT__NETWORK", "true"),
            ("AIRLOCK__SANDBOX__TIERS__LIGHT__MAX_PROCESSES", "16"),
            ("AIRLOCK__SANDBOX__PROTECTED_ENDPOINTS", "api:7070, [::1]:7071"),
            ("AIRLOCK__SANDBOX__READ_ONLY_PATHS", "/opt/toolchain"),
        ])
        .unwrap();
        let light = c.sandbox.tiers.get("light").unwrap();
        assert_eq!((light.network, light.max_processes), (true, 16));
        assert_eq!(
            c.sandbox.protected_endpoints,
            vec![Endpoint { host: "api".into(), port: 7070 }, Endpoint { host: "::1".into(), port: 7071 }]
        );
        assert_eq!(c.sandbox.protected_endpoints[1].to_string(), "[::1]:7071");
        assert_eq!(c.sandbox.read_only_paths, vec![std::path::PathBuf::from("/opt/toolchain")]);
    }

    #[test]
    fn loader_variables() {
        use super::is_loader_variable;
        for v in [
            "LD_PRELOAD",
            "LD_LIBRARY_PATH",
            "PATH",
            "BASH_ENV",
            "ENV",
            "IFS",
            "PYTHONPATH",
            "PERL5LIB",
            "GLIBC_TUNABLES",
            "NODE_OPTIONS",
        ] {
            assert!(is_loader_variable(v), "{v}");
        }
        for v in ["CI", "GREETING", "LANG", "path_hint", "MY_PATH"] {
            assert!(!is_loader_variable(v), "{v}");
        }
    }

    #[test]
    fn a_decision_snapshotted_before_the_isolation_keys_still_reads() {
        let old = serde_json::json!({"name": "light", "cpus": 1.0, "memory_mb": 512, "disk_mb": 1024,
                                     "timeout_seconds": 300, "cost_per_minute": 0.01});
        let t: super::Tier = serde_json::from_value(old).unwrap();
        assert_eq!((t.network, t.max_processes), (false, super::DEFAULT_MAX_PROCESSES));
    }
}
