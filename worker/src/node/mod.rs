//! The node service: a worker that hosts agents (`worker.node_id`).
//!
//! It keeps a holder record per agent ([`holder`]), runs agents from working copies, and
//! answers the node protocol ([`server`]) that a `capsule.migrate` job drives:
//! freeze → propose(epoch) → have_blobs/put_blob → prepare → activate(epoch) → retire, or
//! abort/resume when the move does not happen.
//!
//! Invariants:
//! - At most one operation per agent at a time (a lock per agent).
//! - A proposal is refused unless its epoch is newer than every epoch this node has seen
//!   for the agent; `seen_epoch` survives aborts and retirements.
//! - Blobs are checked against their hash on receipt; a prepared capsule is verified as a
//!   whole (the same offline check as `capsule verify`), its journal rendered and its
//!   environment resolved before it can be activated.
//! - An agent whose record was lost is not run, and not given away, until reconciled.

pub mod holder;
pub mod server;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use airlock_capsule::archive::{self, Archive};
use airlock_capsule::env;
use airlock_capsule::files::{CapsuleFiles, DirBlobs};
use airlock_capsule::journal::EventKind;
use airlock_capsule::protocol::{FreezeReply, HaveBlobsReply, HolderState, NodeStatus, PrepareRequest};
use airlock_capsule::render::{self, Provider};
use airlock_capsule::verify::{self, VerifyOptions};
use airlock_capsule::{AgentId, NodeId, agents, fsio, is_sha256_hex, sha256_hex};
use airlock_core::secret::Keyring;
use airlock_core::secret::Secret;
use airlock_core::sync::lock;

use holder::{HolderRecord, Layout};

/// A refusal or failure of a node operation; the HTTP layer maps it to a status and code.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    StaleEpoch(String),
    #[error("{0}")]
    InvalidTransition(String),
    #[error("{0}")]
    Unreconciled(String),
    #[error("{0}")]
    HashMismatch(String),
    #[error("{0}")]
    MissingBlobs(String),
    #[error("{0}")]
    Validation(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    TooLarge(String),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl NodeError {
    pub fn status_and_code(&self) -> (u16, &'static str) {
        match self {
            NodeError::StaleEpoch(_) => (409, "STALE_EPOCH"),
            NodeError::InvalidTransition(_) => (409, "INVALID_TRANSITION"),
            NodeError::Unreconciled(_) => (409, "UNRECONCILED"),
            NodeError::HashMismatch(_) => (400, "HASH_MISMATCH"),
            NodeError::MissingBlobs(_) => (409, "MISSING_BLOBS"),
            NodeError::Validation(_) => (400, "VALIDATION"),
            NodeError::Unauthenticated(_) => (401, "UNAUTHENTICATED"),
            NodeError::TooLarge(_) => (413, "PAYLOAD_TOO_LARGE"),
            NodeError::Internal(_) => (500, "INTERNAL"),
        }
    }
}

fn internal(e: impl Into<anyhow::Error>) -> NodeError {
    NodeError::Internal(e.into())
}

/// What a node needs to know about itself.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub node_id: NodeId,
    pub data_dir: PathBuf,
    /// Authenticates every request and response (HMAC).
    pub secret: Secret,
    pub max_skew_seconds: i64,
}

/// Counts from one reconciliation pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReconcileCounts {
    /// Records restored: Postgres names this node as the active holder at that epoch.
    pub restored: usize,
    /// Working copies discarded: someone else holds the agent.
    pub discarded: usize,
    /// Left for later: a migration of the agent is under way.
    pub waiting: usize,
}

pub struct NodeService {
    id: NodeId,
    layout: Layout,
    store: Arc<dyn Archive>,
    keyring: Arc<dyn Keyring>,
    secret: Secret,
    max_skew_seconds: i64,
    locks: std::sync::Mutex<HashMap<AgentId, Arc<tokio::sync::Mutex<()>>>>,
    /// Agents with a working copy but no record, with the epoch of that copy (0: unknown).
    unreconciled: std::sync::Mutex<BTreeMap<AgentId, i64>>,
}

impl NodeService {
    /// Opens the data directory: rolls interrupted activations forward, drops staging left
    /// without a record, and marks working copies without a record as unreconciled.
    pub fn open(
        settings: NodeSettings,
        store: Arc<dyn Archive>,
        keyring: Arc<dyn Keyring>,
    ) -> std::io::Result<Arc<Self>> {
        let layout = Layout { root: settings.data_dir.clone() };
        fsio::create_dir_all_synced(&layout.blobs())?;
        fsio::create_dir_all_synced(&layout.agents())?;
        let mut unreconciled = BTreeMap::new();
        for entry in std::fs::read_dir(layout.agents())? {
            let entry = entry?;
            let Ok(id) = AgentId::parse(&entry.file_name().to_string_lossy()) else { continue };
            let (work, staging) = (layout.work(&id), layout.staging(&id));
            match holder::read(&layout, &id)? {
                None => {
                    fsio::remove_dir_all_synced(&staging)?;
                    if work.is_dir() {
                        let epoch = holder::work_epoch(&work).unwrap_or(0);
                        tracing::warn!(agent.id = %id, epoch, "working copy without a holder record: not run until reconciled");
                        unreconciled.insert(id, epoch);
                    }
                }
                Some(rec) => match rec.state {
                    HolderState::Active | HolderState::Frozen => {
                        if !work.is_dir() && staging.is_dir() {
                            fsio::rename_dir(&staging, &work)?;
                        }
                    }
                    HolderState::Staging => {
                        if rec.prepared && !staging.is_dir() {
                            holder::write(&layout, &HolderRecord { prepared: false, ..rec })?;
                        }
                    }
                    HolderState::Retired => {
                        fsio::remove_dir_all_synced(&staging)?;
                        fsio::remove_dir_all_synced(&work)?;
                    }
                },
            }
        }
        Ok(Arc::new(Self {
            id: settings.node_id,
            layout,
            store,
            keyring,
            secret: settings.secret,
            max_skew_seconds: settings.max_skew_seconds,
            locks: std::sync::Mutex::new(HashMap::new()),
            unreconciled: std::sync::Mutex::new(unreconciled),
        }))
    }

    pub fn node_id(&self) -> &NodeId {
        &self.id
    }

    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    pub fn max_skew_seconds(&self) -> i64 {
        self.max_skew_seconds
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    async fn lock_agent(&self, id: &AgentId) -> tokio::sync::OwnedMutexGuard<()> {
        let m = lock(&self.locks).entry(id.clone()).or_default().clone();
        m.lock_owned().await
    }

    fn unreconciled_epoch(&self, id: &AgentId) -> Option<i64> {
        lock(&self.unreconciled).get(id).copied()
    }

    /// Agents waiting to be reconciled.
    pub fn unreconciled(&self) -> Vec<AgentId> {
        lock(&self.unreconciled).keys().cloned().collect()
    }

    fn record(&self, id: &AgentId) -> Result<Option<HolderRecord>, NodeError> {
        holder::read(&self.layout, id).map_err(internal)
    }

    fn save(&self, rec: &HolderRecord) -> Result<(), NodeError> {
        holder::write(&self.layout, rec).map_err(internal)
    }

    fn status_of(&self, id: &AgentId, rec: Option<&HolderRecord>) -> NodeStatus {
        if let Some(epoch) = self.unreconciled_epoch(id) {
            return NodeStatus {
                agent_id: id.clone(),
                node_id: self.id.to_string(),
                state: None,
                epoch,
                seen_epoch: epoch,
                prepared: false,
                reconciled: false,
            };
        }
        NodeStatus {
            agent_id: id.clone(),
            node_id: self.id.to_string(),
            state: rec.map(|r| r.state),
            epoch: rec.map_or(0, |r| r.epoch),
            seen_epoch: rec.map_or(0, |r| r.seen_epoch),
            prepared: rec.is_some_and(|r| r.prepared),
            reconciled: true,
        }
    }

    fn refuse_unreconciled(&self, id: &AgentId) -> Result<(), NodeError> {
        match self.unreconciled_epoch(id) {
            Some(e) => Err(NodeError::Unreconciled(format!(
                "{} lost its holder record for {id} (working copy at epoch {e}); it waits to be reconciled",
                self.id
            ))),
            None => Ok(()),
        }
    }

    pub async fn status(&self, id: &AgentId) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.record(id)?;
        Ok(self.status_of(id, rec.as_ref()))
    }

    fn held_at(&self, id: &AgentId, epoch: i64, states: &[HolderState]) -> Result<HolderRecord, NodeError> {
        self.refuse_unreconciled(id)?;
        match self.record(id)? {
            Some(r) if r.epoch == epoch && states.contains(&r.state) => Ok(r),
            Some(r) if r.epoch > epoch || r.seen_epoch > epoch => Err(NodeError::StaleEpoch(format!(
                "{} holds {id} as {} at epoch {} (seen {}); epoch {epoch} is stale",
                self.id,
                r.state.as_str(),
                r.epoch,
                r.seen_epoch
            ))),
            Some(r) => Err(NodeError::InvalidTransition(format!(
                "{} holds {id} as {} at epoch {}, not {} at epoch {epoch}",
                self.id,
                r.state.as_str(),
                r.epoch,
                states.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("|")
            ))),
            None => Err(NodeError::InvalidTransition(format!("{} has no record of {id}", self.id))),
        }
    }

    /// Writes the working copy to the store; returns the manifest's sha256.
    fn checkpoint_work(&self, id: &AgentId) -> Result<String, NodeError> {
        let (cap, blobs) = CapsuleFiles::read_dir(&self.layout.work(id)).map_err(internal)?;
        archive::put_capsule(self.store.as_ref(), &cap, &blobs).map_err(internal)?;
        Ok(cap.manifest_sha256())
    }

    /// Stops running the agent (`active` → `frozen`) and checkpoints it to the store.
    pub async fn freeze(&self, id: &AgentId, epoch: i64) -> Result<FreezeReply, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.held_at(id, epoch, &[HolderState::Active, HolderState::Frozen])?;
        if rec.state == HolderState::Active {
            self.save(&HolderRecord { state: HolderState::Frozen, ..rec })?;
        }
        let manifest_sha256 = self.checkpoint_work(id)?;
        tracing::info!(agent.id = %id, epoch, "frozen");
        Ok(FreezeReply { epoch, manifest_sha256 })
    }

    /// Starts receiving the agent at `epoch`, which must be newer than any seen here.
    pub async fn propose(&self, id: &AgentId, epoch: i64) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        self.refuse_unreconciled(id)?;
        let rec = self.record(id)?;
        if let Some(r) = &rec {
            if r.state == HolderState::Staging && r.epoch == epoch {
                return Ok(self.status_of(id, rec.as_ref()));
            }
            if epoch <= r.seen_epoch.max(r.epoch) {
                return Err(NodeError::StaleEpoch(format!(
                    "epoch {epoch} is not newer than {} already seen here for {id}",
                    r.seen_epoch.max(r.epoch)
                )));
            }
            if matches!(r.state, HolderState::Active | HolderState::Frozen) {
                return Err(NodeError::InvalidTransition(format!(
                    "{} holds {id} ({} at epoch {}): it cannot receive it",
                    self.id,
                    r.state.as_str(),
                    r.epoch
                )));
            }
        }
        if epoch < 1 {
            return Err(NodeError::StaleEpoch("epochs start at 1".into()));
        }
        fsio::remove_dir_all_synced(&self.layout.staging(id)).map_err(internal)?;
        let mut new = HolderRecord::new(id.clone(), HolderState::Staging, epoch, epoch);
        new.previous = match &rec {
            Some(r) if r.state == HolderState::Staging => r.previous,
            Some(r) => Some((r.state, r.epoch)),
            None => None,
        };
        self.save(&new)?;
        Ok(self.status_of(id, Some(&new)))
    }

    /// The hashes among `hashes` that this node lacks.
    pub async fn have_blobs(&self, id: &AgentId, epoch: i64, hashes: &[String]) -> Result<HaveBlobsReply, NodeError> {
        let _g = self.lock_agent(id).await;
        self.held_at(id, epoch, &[HolderState::Staging])?;
        let mut missing: Vec<String> = Vec::new();
        for h in hashes {
            if !is_sha256_hex(h) {
                return Err(NodeError::Validation(format!("`{h}` is not a sha256")));
            }
            if !self.layout.blobs().join(h).is_file() && !missing.contains(h) {
                missing.push(h.clone());
            }
        }
        Ok(HaveBlobsReply { missing })
    }

    /// Receives one blob; refused unless its body hashes to its name.
    pub async fn put_blob(&self, id: &AgentId, epoch: i64, sha: &str, body: &[u8]) -> Result<(), NodeError> {
        let _g = self.lock_agent(id).await;
        self.held_at(id, epoch, &[HolderState::Staging])?;
        if !is_sha256_hex(sha) {
            return Err(NodeError::Validation(format!("`{sha}` is not a sha256")));
        }
        if sha256_hex(body) != sha {
            return Err(NodeError::HashMismatch(format!("blob body does not hash to {sha}")));
        }
        let path = self.layout.blobs().join(sha);
        if !path.is_file() {
            fsio::write_atomic(&path, body).map_err(internal)?;
        }
        Ok(())
    }

    /// Stages the capsule: checks it names this agent, lays it out with the blobs this
    /// node has, verifies the whole folder, renders the journal, and resolves the
    /// environment against this host's keyring (and forgets the values).
    pub async fn prepare(&self, id: &AgentId, req: PrepareRequest) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.held_at(id, req.epoch, &[HolderState::Staging])?;
        if req.manifest.agent_id != *id {
            return Err(NodeError::Validation(format!(
                "the capsule names agent {}, the request {id}: one agent has one id",
                req.manifest.agent_id
            )));
        }
        let cap =
            CapsuleFiles::from_base64(req.manifest, &req.files).map_err(|e| NodeError::Validation(e.to_string()))?;
        cap.check().map_err(|e| NodeError::Validation(e.to_string()))?;
        let missing: Vec<String> =
            cap.blob_hashes().into_iter().filter(|h| !self.layout.blobs().join(h).is_file()).collect();
        if !missing.is_empty() {
            return Err(NodeError::MissingBlobs(format!("{} blobs missing, e.g. {}", missing.len(), missing[0])));
        }
        let mut staged = cap;
        staged.rehold(self.id.as_str(), req.epoch);
        let staging = self.layout.staging(id);
        fsio::remove_dir_all_synced(&staging).map_err(internal)?;
        staged
            .write_dir(&staging, &DirBlobs(self.layout.blobs()), None)
            .map_err(|e| NodeError::Validation(e.to_string()))?;
        let report = verify::verify_path(&staging, &VerifyOptions::default()).map_err(internal)?;
        if !report.is_ok() {
            let problems: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
            fsio::remove_dir_all_synced(&staging).map_err(internal)?;
            return Err(NodeError::Validation(format!("staged capsule does not verify: {}", problems.join("; "))));
        }
        let journal = staged.journal().map_err(|e| NodeError::Validation(e.to_string()))?;
        let events: Vec<_> = journal.events().cloned().collect();
        for p in [Provider::OpenAi, Provider::Anthropic] {
            let _ = render::render(&events, p, None);
        }
        let spec = staged.env().map_err(|e| NodeError::Validation(e.to_string()))?;
        drop(env::resolve(&spec, self.keyring.as_ref()).map_err(|e| NodeError::Validation(e.to_string()))?);
        let new = HolderRecord { prepared: true, ..rec };
        self.save(&new)?;
        Ok(self.status_of(id, Some(&new)))
    }

    /// Takes the agent over at `epoch`: the record goes `active` first (the commit), then
    /// staging becomes the working copy, then it is checkpointed to the store.
    pub async fn activate(&self, id: &AgentId, epoch: i64) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.held_at(id, epoch, &[HolderState::Staging, HolderState::Active])?;
        if rec.state == HolderState::Active {
            return Ok(self.status_of(id, Some(&rec)));
        }
        if !rec.prepared {
            return Err(NodeError::InvalidTransition(format!("{id} at epoch {epoch} is not prepared")));
        }
        let new = HolderRecord { state: HolderState::Active, prepared: false, previous: None, ..rec };
        self.save(&new)?;
        let (work, staging) = (self.layout.work(id), self.layout.staging(id));
        fsio::remove_dir_all_synced(&work).map_err(internal)?;
        fsio::rename_dir(&staging, &work).map_err(internal)?;
        if let Err(e) = self.checkpoint_work(id) {
            tracing::warn!(agent.id = %id, epoch, error = %e, "activated, but the checkpoint to the store failed");
        }
        tracing::info!(agent.id = %id, epoch, "activated");
        Ok(self.status_of(id, Some(&new)))
    }

    /// Discards what was staged for `epoch` and restores the previous record. Remembers
    /// `epoch` as seen, so neither a late proposal nor a late activation for it can succeed.
    pub async fn abort(&self, id: &AgentId, epoch: i64) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        if let Some(work_epoch) = self.unreconciled_epoch(id) {
            // The coordinator says epoch `epoch` was not taken: a copy at that epoch is void.
            if work_epoch != epoch {
                return Err(NodeError::Unreconciled(format!(
                    "{} lost its holder record for {id} (working copy at epoch {work_epoch}); it waits to be reconciled",
                    self.id
                )));
            }
            fsio::remove_dir_all_synced(&self.layout.work(id)).map_err(internal)?;
            let new = HolderRecord::new(id.clone(), HolderState::Retired, 0, epoch);
            self.save(&new)?;
            lock(&self.unreconciled).remove(id);
            return Ok(self.status_of(id, Some(&new)));
        }
        let rec = self.record(id)?;
        let new = match rec {
            Some(r) if r.state == HolderState::Staging && r.epoch == epoch => {
                fsio::remove_dir_all_synced(&self.layout.staging(id)).map_err(internal)?;
                let (state, e) = r.previous.unwrap_or((HolderState::Retired, 0));
                HolderRecord::new(id.clone(), state, e, r.seen_epoch.max(epoch))
            }
            Some(r) if r.state == HolderState::Active && r.epoch == epoch => {
                return Err(NodeError::InvalidTransition(format!(
                    "{} runs {id} at epoch {epoch}: too late to abort",
                    self.id
                )));
            }
            Some(r) if r.seen_epoch >= epoch => return Ok(self.status_of(id, Some(&r))),
            Some(r) => HolderRecord { seen_epoch: epoch, ..r },
            None => HolderRecord::new(id.clone(), HolderState::Retired, 0, epoch),
        };
        self.save(&new)?;
        Ok(self.status_of(id, Some(&new)))
    }

    /// Gives the agent up for good (`frozen` → `retired`) and deletes the working copy.
    pub async fn retire(&self, id: &AgentId, epoch: i64) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.held_at(id, epoch, &[HolderState::Frozen, HolderState::Retired])?;
        let new = if rec.state == HolderState::Frozen {
            let new = HolderRecord { state: HolderState::Retired, ..rec };
            self.save(&new)?;
            new
        } else {
            rec
        };
        fsio::remove_dir_all_synced(&self.layout.work(id)).map_err(internal)?;
        Ok(self.status_of(id, Some(&new)))
    }

    /// Runs the agent again at its old epoch (`frozen` → `active`).
    pub async fn resume(&self, id: &AgentId, epoch: i64) -> Result<NodeStatus, NodeError> {
        let _g = self.lock_agent(id).await;
        let rec = self.held_at(id, epoch, &[HolderState::Frozen, HolderState::Active])?;
        let new = if rec.state == HolderState::Frozen {
            let new = HolderRecord { state: HolderState::Active, ..rec };
            self.save(&new)?;
            new
        } else {
            rec
        };
        Ok(self.status_of(id, Some(&new)))
    }

    /// Appends an event to the running agent's journal (this node is the machine).
    pub async fn append(
        &self,
        id: &AgentId,
        kind: EventKind,
        data: serde_json::Value,
    ) -> Result<serde_json::Value, NodeError> {
        let _g = self.lock_agent(id).await;
        self.refuse_unreconciled(id)?;
        match self.record(id)? {
            Some(r) if r.state == HolderState::Active => {}
            _ => return Err(NodeError::InvalidTransition(format!("{} does not run {id}", self.id))),
        }
        let work = self.layout.work(id);
        let (mut cap, _) = CapsuleFiles::read_dir(&work).map_err(internal)?;
        let mut journal = cap.journal().map_err(internal)?;
        let event = journal.append(self.id.as_str(), kind, data, &airlock_capsule::files::now_rfc3339()).clone();
        cap.set_journal(&journal);
        let path = airlock_capsule::journal::PATH;
        fsio::write_atomic(&work.join(path), &cap.files[path]).map_err(internal)?;
        fsio::write_atomic(&work.join("manifest.json"), &cap.manifest.to_bytes()).map_err(internal)?;
        serde_json::to_value(event).map_err(internal)
    }

    /// Checkpoints the agent to the store now.
    pub async fn checkpoint(&self, id: &AgentId) -> Result<serde_json::Value, NodeError> {
        let _g = self.lock_agent(id).await;
        self.refuse_unreconciled(id)?;
        match self.record(id)? {
            Some(r) if matches!(r.state, HolderState::Active | HolderState::Frozen) => {}
            _ => return Err(NodeError::InvalidTransition(format!("{} does not hold {id}", self.id))),
        }
        let sha = self.checkpoint_work(id)?;
        Ok(serde_json::json!({"manifest_sha256": sha}))
    }

    /// Reconciles agents whose record was lost, against Postgres: restores the record when
    /// Postgres names this node as the active holder at the working copy's epoch; waits
    /// while a migration of the agent is under way; otherwise discards the working copy.
    pub async fn reconcile_once(&self, pool: &sqlx::PgPool) -> Result<ReconcileCounts, NodeError> {
        let mut counts = ReconcileCounts::default();
        for id in self.unreconciled() {
            let _g = self.lock_agent(&id).await;
            let Some(work_epoch) = self.unreconciled_epoch(&id) else { continue };
            let row = agents::get(pool, &id).await.map_err(internal)?;
            match row {
                Some(a) if a.state == agents::AgentState::Migrating => {
                    counts.waiting += 1;
                    continue;
                }
                Some(a)
                    if a.state == agents::AgentState::Active
                        && a.holder.as_deref() == Some(self.id.as_str())
                        && a.epoch == work_epoch =>
                {
                    self.save(&HolderRecord::new(id.clone(), HolderState::Active, work_epoch, a.max_epoch))?;
                    counts.restored += 1;
                    tracing::info!(agent.id = %id, epoch = work_epoch, "holder record restored from Postgres");
                }
                other => {
                    fsio::remove_dir_all_synced(&self.layout.work(&id)).map_err(internal)?;
                    let seen = other.map_or(work_epoch, |a| a.max_epoch.max(work_epoch));
                    self.save(&HolderRecord::new(id.clone(), HolderState::Retired, 0, seen))?;
                    counts.discarded += 1;
                    tracing::warn!(agent.id = %id, epoch = work_epoch, "stale working copy discarded");
                }
            }
            lock(&self.unreconciled).remove(&id);
        }
        Ok(counts)
    }
}

/// Starts the node service when `worker.node_id` is set: opens the data directory, serves
/// the protocol on `worker.node_listen`, and reconciles lost records periodically. The
/// returned task ends after `shutdown` fires.
pub async fn start_from_config(
    cfg: &airlock_core::config::Config,
    pool: &sqlx::PgPool,
    shutdown: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(id) = &cfg.worker.node_id else { return Ok(None) };
    let secret = airlock_core::secret::from_env(&cfg.capsules.fleet_secret_env).ok_or_else(|| {
        anyhow::anyhow!("worker.node_id is set but the fleet secret `{}` is not", cfg.capsules.fleet_secret_env)
    })?;
    let keyring = airlock_core::secret::host_keyring(&cfg.capsules);
    let settings = NodeSettings {
        node_id: NodeId::parse(id)?,
        data_dir: cfg.worker.data_dir.clone().into(),
        secret,
        max_skew_seconds: cfg.capsules.node_max_skew_seconds,
    };
    let store: Arc<dyn Archive> = Arc::new(archive::DirArchive::new(&cfg.capsules.store_dir));
    let svc = NodeService::open(settings, store, keyring)?;
    let listener = tokio::net::TcpListener::bind(cfg.worker.node_listen).await?;
    tracing::info!(node.id = %id, listen = %listener.local_addr()?, "node service listening");
    let interval = std::time::Duration::from_secs(cfg.capsules.reconcile_interval_seconds);
    let limits = airlock_http::ServeLimits::from(&cfg.http);
    Ok(Some(tokio::spawn(run(svc, listener, limits, pool.clone(), interval, shutdown.clone()))))
}

/// Serves the protocol and reconciles lost records until `shutdown` fires.
pub async fn run(
    svc: Arc<NodeService>,
    listener: tokio::net::TcpListener,
    limits: airlock_http::ServeLimits,
    pool: sqlx::PgPool,
    reconcile_every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let reconciler = {
        let (svc, shutdown) = (svc.clone(), shutdown.clone());
        async move {
            loop {
                if !svc.unreconciled().is_empty() {
                    match svc.reconcile_once(&pool).await {
                        Ok(c) => tracing::info!(?c, "reconciled holder records"),
                        Err(e) => tracing::warn!(error = %e, "reconciliation failed; will retry"),
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(reconcile_every) => {}
                }
            }
        }
    };
    let server = server::serve(svc, listener, limits, shutdown);
    let (served, ()) = tokio::join!(server, reconciler);
    if let Err(e) = served {
        tracing::error!(error = %e, "node service stopped");
    }
}
