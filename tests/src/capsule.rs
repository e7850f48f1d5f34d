//! Capsule and migration test support: sample capsules, a fleet of in-process nodes on
//! loopback sharing one store, a fault-injecting wrapper around node clients, a
//! coordinator worker, and the invariants every migration test checks.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_capsule::archive::DirArchive;
use airlock_capsule::env::EnvSpec;
use airlock_capsule::files::{CapsuleFiles, Parts};
use airlock_capsule::journal::{EventKind, Journal};
use airlock_capsule::protocol::{
    CallError, FreezeReply, HaveBlobsReply, HolderState, HttpNode, NodeApi, NodeCall, NodeDirectory, NodeFuture,
    NodeStatus, PrepareRequest,
};
use airlock_capsule::relocation::{self, Phase, Relocation};
use airlock_capsule::verify::{VerifyOptions, verify_path};
use airlock_capsule::{AgentId, NodeId};
use airlock_core::secret::MapKeyring;
use airlock_core::secret::Secret;
use airlock_worker::migrate::{MigrateHandler, MigrateHooks};
use airlock_worker::node::{NodeService, NodeSettings};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::app::TempDir;

/// The fleet secret of the test nodes, and the variable that holds it.
pub const FLEET_SECRET: &str = "test-fleet-secret";
pub const FLEET_SECRET_ENV: &str = "AIRLOCK_TEST_FLEET_SECRET";
/// The one secret sample capsules need; every test node's keyring has it.
pub const SECRET_NAME: &str = "GITHUB_TOKEN";

/// A capsule with a journal written on `machine` (a message, a reasoning, a tool call and
/// its result), three workspace files of which two share a body, and an environment that
/// names one secret.
pub fn sample_capsule(agent: &str, machine: &str, epoch: i64) -> (CapsuleFiles, BTreeMap<String, Vec<u8>>) {
    sample_capsule_variant(agent, machine, epoch, 0)
}

/// [`sample_capsule`] whose `data/big.bin` differs by `variant` (the other blobs are shared).
pub fn sample_capsule_variant(
    agent: &str,
    machine: &str,
    epoch: i64,
    variant: u8,
) -> (CapsuleFiles, BTreeMap<String, Vec<u8>>) {
    let mut journal = Journal::new();
    let at = "2026-11-29T10:00:00Z";
    journal.append(machine, EventKind::Message, json!({"role": "system", "text": "You are a careful agent."}), at);
    journal.append(machine, EventKind::Message, json!({"role": "user", "text": "Summarise the repository."}), at);
    journal.append(machine, EventKind::Reasoning, json!({"provider": "openai", "text": "Look at README first."}), at);
    journal.append(
        machine,
        EventKind::ToolCall,
        json!({"call_id": "c1", "name": "read_file", "arguments": {"path": "README.md"}}),
        at,
    );
    journal.append(machine, EventKind::ToolResult, json!({"call_id": "c1", "content": "# demo\n"}), at);
    journal.append(machine, EventKind::Message, json!({"role": "assistant", "text": "A demo repository."}), at);
    let parts = Parts {
        working_memory: b"# Working memory\n\n- the README is short\n".to_vec(),
        journal,
        vector_index: b"{\"model\": \"none\", \"dims\": 0, \"entries\": []}\n".to_vec(),
        workspace: BTreeMap::from([
            ("README.md".to_string(), b"# demo\n".to_vec()),
            ("docs/README.md".to_string(), b"# demo\n".to_vec()),
            ("src/main.rs".to_string(), b"fn main() { println!(\"demo\"); }\n".to_vec()),
            ("data/big.bin".to_string(), (0..64 * 1024).map(|i| ((i % 251) as u8).wrapping_add(variant)).collect()),
        ]),
        env: EnvSpec {
            tier: Some("standard".into()),
            packages: vec!["ripgrep".into()],
            env: BTreeMap::from([("LANG".to_string(), "C.UTF-8".to_string())]),
            secrets: vec![SECRET_NAME.into()],
            ..EnvSpec::default()
        },
    };
    CapsuleFiles::assemble(AgentId::parse(agent).expect("agent id"), machine, epoch, &parts).expect("sample capsule")
}

/// When a fault fires relative to the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// The request is lost: the node never sees it.
    Before,
    /// The node executes it, and the answer is lost.
    After,
    /// `put_blob` only: one byte of the body is flipped on the way.
    Corrupt,
}

impl When {
    pub fn as_str(self) -> &'static str {
        match self {
            When::Before => "before",
            When::After => "after",
            When::Corrupt => "corrupt",
        }
    }
}

/// One armed fault: fails the next `times` calls named `call`.
#[derive(Debug, Clone)]
pub struct Fault {
    pub call: NodeCall,
    pub when: When,
    pub times: usize,
}

/// Wraps a node client and fails named calls as planned; counts every call.
pub struct FaultyNode {
    inner: Arc<dyn NodeApi>,
    plan: Mutex<Vec<Fault>>,
    calls: Mutex<HashMap<NodeCall, usize>>,
    fired: Mutex<Vec<(NodeCall, When)>>,
}

impl FaultyNode {
    pub fn new(inner: Arc<dyn NodeApi>) -> Self {
        Self { inner, plan: Mutex::new(Vec::new()), calls: Mutex::default(), fired: Mutex::default() }
    }

    pub fn arm(&self, call: NodeCall, when: When) {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).push(Fault { call, when, times: 1 });
    }

    pub fn clear(&self) {
        self.plan.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.fired.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub fn calls(&self, call: NodeCall) -> usize {
        self.calls.lock().unwrap_or_else(|e| e.into_inner()).get(&call).copied().unwrap_or(0)
    }

    pub fn fired(&self) -> Vec<(NodeCall, When)> {
        self.fired.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn take(&self, call: NodeCall) -> Option<When> {
        *self.calls.lock().unwrap_or_else(|e| e.into_inner()).entry(call).or_default() += 1;
        let mut plan = self.plan.lock().unwrap_or_else(|e| e.into_inner());
        let i = plan.iter().position(|f| f.call == call && f.times > 0)?;
        plan[i].times -= 1;
        let when = plan[i].when;
        self.fired.lock().unwrap_or_else(|e| e.into_inner()).push((call, when));
        Some(when)
    }

    fn wrap<T: Send + 'static>(&self, call: NodeCall, run: impl FnOnce() -> NodeFuture<T>) -> NodeFuture<T> {
        let lost = |what: &str| CallError::Unreachable(format!("fault: {what} {}", call.as_str()));
        match self.take(call) {
            None | Some(When::Corrupt) => run(),
            Some(When::Before) => {
                let e = lost("request lost before");
                Box::pin(async move { Err(e) })
            }
            Some(When::After) => {
                let fut = run();
                let e = lost("response lost after");
                Box::pin(async move {
                    let _ = fut.await;
                    Err(e)
                })
            }
        }
    }
}

impl NodeApi for FaultyNode {
    fn node_id(&self) -> &str {
        self.inner.node_id()
    }
    fn status(&self, agent: &AgentId) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Status, || self.inner.status(agent))
    }
    fn freeze(&self, agent: &AgentId, epoch: i64) -> NodeFuture<FreezeReply> {
        self.wrap(NodeCall::Freeze, || self.inner.freeze(agent, epoch))
    }
    fn propose(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Propose, || self.inner.propose(agent, epoch))
    }
    fn have_blobs(&self, agent: &AgentId, epoch: i64, hashes: Vec<String>) -> NodeFuture<HaveBlobsReply> {
        self.wrap(NodeCall::HaveBlobs, || self.inner.have_blobs(agent, epoch, hashes))
    }
    fn put_blob(&self, agent: &AgentId, epoch: i64, sha: &str, mut body: Vec<u8>) -> NodeFuture<()> {
        let corrupt = self
            .plan
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|f| f.call == NodeCall::PutBlob && f.when == When::Corrupt && f.times > 0);
        if corrupt && !body.is_empty() {
            body[0] ^= 0xff;
        }
        self.wrap(NodeCall::PutBlob, || self.inner.put_blob(agent, epoch, sha, body))
    }
    fn prepare(&self, agent: &AgentId, request: PrepareRequest) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Prepare, || self.inner.prepare(agent, request))
    }
    fn activate(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Activate, || self.inner.activate(agent, epoch))
    }
    fn abort(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Abort, || self.inner.abort(agent, epoch))
    }
    fn retire(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Retire, || self.inner.retire(agent, epoch))
    }
    fn resume(&self, agent: &AgentId, epoch: i64) -> NodeFuture<NodeStatus> {
        self.wrap(NodeCall::Resume, || self.inner.resume(agent, epoch))
    }
}

/// One node served in-process on loopback.
pub struct TestNode {
    pub id: String,
    pub svc: Arc<NodeService>,
    pub url: String,
    pub data_dir: PathBuf,
    addr: std::net::SocketAddr,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn keyring() -> Arc<MapKeyring> {
    Arc::new(MapKeyring(HashMap::from([(SECRET_NAME.to_string(), Secret::new("ghp_test_value"))])))
}

impl TestNode {
    async fn open(id: &str, data_dir: &Path, store: Arc<DirArchive>, listener: tokio::net::TcpListener) -> Self {
        let settings = NodeSettings {
            node_id: NodeId::parse(id).expect("node id"),
            data_dir: data_dir.to_path_buf(),
            secret: Secret::new(FLEET_SECRET),
            max_skew_seconds: 30,
        };
        let svc = NodeService::open(settings, store, keyring()).expect("open node");
        let addr = listener.local_addr().expect("node addr");
        let stop = CancellationToken::new();
        let handle = tokio::spawn(airlock_worker::node::server::serve(
            svc.clone(),
            listener,
            airlock_http::ServeLimits::default(),
            stop.clone(),
        ));
        Self {
            id: id.to_string(),
            svc,
            url: format!("http://{addr}"),
            data_dir: data_dir.to_path_buf(),
            addr,
            stop,
            handle,
        }
    }

    pub async fn start(id: &str, data_dir: &Path, store: Arc<DirArchive>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind node");
        Self::open(id, data_dir, store, listener).await
    }

    /// Stops the server, as a crash would (the data directory stays as it is).
    pub async fn crash(&mut self) {
        self.stop.cancel();
        let _ = (&mut self.handle).await;
    }

    /// Starts the node again from its data directory, on the same address.
    pub async fn restart(&mut self, store: Arc<DirArchive>) {
        let listener = tokio::net::TcpListener::bind(self.addr).await.expect("rebind node");
        *self = Self::open(&self.id.clone(), &self.data_dir.clone(), store, listener).await;
    }

    pub fn staging_dir(&self, agent: &str) -> PathBuf {
        self.data_dir.join("agents").join(agent).join("staging")
    }

    pub fn work_dir(&self, agent: &str) -> PathBuf {
        self.data_dir.join("agents").join(agent).join("work")
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Nodes sharing one capsule store, their clients wrapped for fault injection.
pub struct Fleet {
    pub store: Arc<DirArchive>,
    pub store_dir: PathBuf,
    pub nodes: Vec<TestNode>,
    pub faults: BTreeMap<String, Arc<FaultyNode>>,
    pub root: PathBuf,
    _dir: TempDir,
}

impl Fleet {
    pub async fn start(ids: &[&str]) -> Self {
        crate::harness::init_logs();
        let root = std::env::temp_dir().join(format!("airlock-fleet-{}", uuid::Uuid::new_v4()));
        let store_dir = root.join("store");
        let store = Arc::new(DirArchive::new(&store_dir));
        let mut nodes = Vec::new();
        let mut faults = BTreeMap::new();
        for id in ids {
            let n = TestNode::start(id, &root.join(id), store.clone()).await;
            let http =
                HttpNode::new(id, &n.url, Arc::new(Secret::new(FLEET_SECRET)), Duration::from_secs(5)).expect("client");
            faults.insert(id.to_string(), Arc::new(FaultyNode::new(Arc::new(http))));
            nodes.push(n);
        }
        Self { store, store_dir, nodes, faults, root: root.clone(), _dir: TempDir(root) }
    }

    pub fn node(&self, id: &str) -> &TestNode {
        self.nodes.iter().find(|n| n.id == id).expect("node")
    }

    pub fn node_mut(&mut self, id: &str) -> &mut TestNode {
        self.nodes.iter_mut().find(|n| n.id == id).expect("node")
    }

    /// Configuration for services that must know the nodes.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self
            .nodes
            .iter()
            .map(|n| (format!("AIRLOCK__NODES__{}__URL", n.id.to_uppercase()), n.url.clone()))
            .collect();
        env.push(("AIRLOCK__CAPSULES__STORE_DIR".into(), self.store_dir.display().to_string()));
        env.push(("AIRLOCK__CAPSULES__FLEET_SECRET_ENV".into(), FLEET_SECRET_ENV.into()));
        env.push((FLEET_SECRET_ENV.into(), FLEET_SECRET.into()));
        env
    }

    /// The nodes as a coordinator sees them (through the fault wrappers).
    pub fn directory(&self) -> NodeDirectory {
        let mut d = NodeDirectory::new();
        for f in self.faults.values() {
            d.insert(f.clone());
        }
        d
    }

    pub fn clear_faults(&self) {
        for f in self.faults.values() {
            f.clear();
        }
    }

    /// A coordinator: the real `capsule.migrate` handler in a real worker, in-process.
    pub fn start_coordinator(
        &self,
        pool: &PgPool,
        config: &airlock_core::config::Config,
        id: &str,
        hooks: Arc<MigrateHooks>,
    ) -> (CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let mut settings = airlock_worker::WorkerSettings::from_config(config, id.to_string());
        settings.poll_interval = Duration::from_millis(50);
        settings.rescue_interval = Duration::from_secs(3600);
        let handler = MigrateHandler {
            nodes: self.directory(),
            store: self.store.clone(),
            worker_id: id.to_string(),
            retry: Duration::from_millis(50),
            hooks,
            trusted_keys: config.capsules.trusted_keys.clone(),
        };
        let mut registry = airlock_worker::Registry::new();
        registry.register(relocation::MIGRATE_JOB, handler);
        let worker = airlock_worker::Worker::new(pool.clone(), registry, settings);
        let stop = CancellationToken::new();
        let handle = tokio::spawn(worker.run(stop.clone()));
        (stop, handle)
    }

    /// Writes a sample capsule for `agent` and imports it (store + Postgres), as
    /// `airlock-admin capsule import` does.
    pub async fn import_sample(&self, pool: &PgPool, agent: &str) -> PathBuf {
        self.import_variant(pool, agent, 0).await
    }

    /// [`import_sample`](Self::import_sample) with [`sample_capsule_variant`].
    pub async fn import_variant(&self, pool: &PgPool, agent: &str, variant: u8) -> PathBuf {
        let (cap, blobs) = sample_capsule_variant(agent, "origin", 0, variant);
        let dir = self.root.join("exports").join(format!("{agent}-{}", uuid::Uuid::new_v4().simple()));
        cap.write_dir(&dir, &blobs, None).expect("write capsule");
        let trust = airlock_admin::capsule::Trust { trusted_keys: &[], allow_unsigned: true };
        airlock_admin::capsule::import(pool, self.store.as_ref(), &dir, "test", &trust).await.expect("import");
        dir
    }

    /// What every node says about `agent`, and the invariants of the fleet.
    pub async fn observe(&self, agent: &str, new_epoch: i64) -> Observed {
        let id = AgentId::parse(agent).expect("agent id");
        let mut holders = Vec::new();
        let mut staging_clean = true;
        let mut verify = Vec::new();
        for n in &self.nodes {
            let s = n.svc.status(&id).await.expect("status");
            let active = s.reconciled && s.state == Some(HolderState::Active);
            if active {
                let r = verify_path(&n.work_dir(agent), &VerifyOptions::default()).expect("verify work copy");
                verify.extend(r.problems.iter().map(|p| format!("{}: {p}", n.id)));
            }
            let holds_new = s.is_active_at(new_epoch);
            if !holds_new && (s.state == Some(HolderState::Staging) || n.staging_dir(agent).exists()) {
                staging_clean = false;
            }
            holders.push((n.id.clone(), s));
        }
        Observed { holders, staging_clean, verify_problems: verify }
    }
}

/// The fleet's view of one agent after (or during) a migration.
#[derive(Debug)]
pub struct Observed {
    pub holders: Vec<(String, NodeStatus)>,
    /// No node stages the agent unless it holds the new epoch.
    pub staging_clean: bool,
    /// Problems `capsule verify` finds in the active holder's working copy.
    pub verify_problems: Vec<String>,
}

impl Observed {
    pub fn active(&self) -> Vec<(String, i64)> {
        self.holders
            .iter()
            .filter(|(_, s)| s.reconciled && s.state == Some(HolderState::Active))
            .map(|(n, s)| (n.clone(), s.epoch))
            .collect()
    }

    /// `node_a@2 active, node_b retired` style summary.
    pub fn summary(&self) -> String {
        self.holders
            .iter()
            .map(|(n, s)| {
                let st = if !s.reconciled { "unreconciled" } else { s.state.map_or("none", HolderState::as_str) };
                format!("{n}@{} {st}", s.epoch)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Waits until the migration is over (completed or aborted).
pub async fn wait_migration(pool: &PgPool, id: uuid::Uuid, timeout: Duration) -> Relocation {
    crate::harness::wait_for(&format!("migration {id} to finish"), timeout, || {
        let pool = pool.clone();
        async move { relocation::get(&pool, id).await.ok().flatten().filter(|m| m.phase.is_terminal()) }
    })
    .await
}

/// Waits until the migration reaches `phase` or a later one in the same branch.
pub async fn wait_phase(pool: &PgPool, id: uuid::Uuid, phase: Phase, timeout: Duration) -> Relocation {
    crate::harness::wait_for(&format!("migration {id} to reach {}", phase.as_str()), timeout, || {
        let pool = pool.clone();
        async move { relocation::get(&pool, id).await.ok().flatten().filter(|m| m.phase == phase) }
    })
    .await
}
