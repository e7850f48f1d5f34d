//! Holder records: where this node stands with each agent, one small JSON file per agent,
//! replaced atomically.
//!
//! Layout under `worker.data_dir`:
//! ```text
//! blobs/<sha256>                 blobs this node has (content-addressed, shared by agents)
//! agents/<id>/holder.json        the holder record
//! agents/<id>/work/              the working copy (a capsule folder) while active or frozen
//! agents/<id>/staging/           the capsule being received, while staging
//! ```
//! The record is the commit point: activation writes `active` first and then moves staging
//! into place (a crash in between is rolled forward at start). A working copy found
//! without a record (the record was lost) is *unreconciled*: the node does not run it, and
//! refuses proposals for it, until it has been reconciled with Postgres.

use std::path::{Path, PathBuf};

use airlock_capsule::protocol::HolderState;
use airlock_capsule::{AgentId, fsio};
use serde::{Deserialize, Serialize};

/// One agent's record on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderRecord {
    pub agent_id: AgentId,
    pub state: HolderState,
    /// The epoch held (active, frozen), last held (retired; 0: never), or being received
    /// (staging).
    pub epoch: i64,
    /// The highest epoch ever accepted here: proposals at or below it are refused.
    pub seen_epoch: i64,
    /// Staging only: the capsule is verified and built, ready to activate.
    #[serde(default)]
    pub prepared: bool,
    /// Staging only: where this node stood before, restored by an abort.
    #[serde(default)]
    pub previous: Option<(HolderState, i64)>,
    pub updated_at: String,
}

impl HolderRecord {
    pub fn new(agent_id: AgentId, state: HolderState, epoch: i64, seen_epoch: i64) -> Self {
        Self {
            agent_id,
            state,
            epoch,
            seen_epoch: seen_epoch.max(epoch),
            prepared: false,
            previous: None,
            updated_at: airlock_capsule::files::now_rfc3339(),
        }
    }
}

/// Paths of one node's data directory.
#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn blobs(&self) -> PathBuf {
        self.root.join("blobs")
    }
    pub fn agents(&self) -> PathBuf {
        self.root.join("agents")
    }
    pub fn agent(&self, id: &AgentId) -> PathBuf {
        self.agents().join(id.as_str())
    }
    pub fn record(&self, id: &AgentId) -> PathBuf {
        self.agent(id).join("holder.json")
    }
    pub fn work(&self, id: &AgentId) -> PathBuf {
        self.agent(id).join("work")
    }
    pub fn staging(&self, id: &AgentId) -> PathBuf {
        self.agent(id).join("staging")
    }
}

/// Reads a record; `Ok(None)` when there is none (or it is unreadable, which start-up
/// treats as lost).
pub fn read(layout: &Layout, id: &AgentId) -> std::io::Result<Option<HolderRecord>> {
    match std::fs::read(layout.record(id)) {
        Ok(b) => Ok(serde_json::from_slice(&b).ok().filter(|r: &HolderRecord| r.agent_id == *id)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces a record atomically.
pub fn write(layout: &Layout, record: &HolderRecord) -> std::io::Result<()> {
    let mut r = record.clone();
    r.updated_at = airlock_capsule::files::now_rfc3339();
    let bytes = serde_json::to_vec_pretty(&r).map_err(std::io::Error::other)?;
    fsio::write_atomic(&layout.record(&record.agent_id), &bytes)
}

/// The epoch in a working copy's manifest, if it has a readable one.
pub fn work_epoch(dir: &Path) -> Option<i64> {
    let bytes = std::fs::read(dir.join("manifest.json")).ok()?;
    airlock_capsule::Manifest::parse(&bytes).ok().map(|m| m.epoch)
}
