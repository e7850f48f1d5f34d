//! The capsule archive: the durable copy of each agent's latest checkpoint and its blobs.
//!
//! Nodes run an agent from a working copy and checkpoint it back here; `capsule export`
//! reads from here; a migration sends the target the blobs it lacks from here. The store is
//! a trait so an object store can replace the default [`DirArchive`] (a directory, which
//! nodes on several machines must share).
//!
//! Invariants: blobs are content-addressed and checked on the way in; a checkpoint is one
//! file replaced atomically, written only after every blob it names; a checkpoint is
//! refused when the store already holds a newer epoch, or the same epoch from another
//! holder (a stale holder can never overwrite its successor).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::files::{BlobSource, CapsuleError, CapsuleFiles};
use super::manifest::Manifest;
use super::{AgentId, fsio, is_sha256_hex, sha256_hex};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("blob {0} is not in the store")]
    MissingBlob(String),
    #[error("blob body does not match its hash {0}")]
    HashMismatch(String),
    #[error(
        "checkpoint of {agent} at epoch {epoch} by `{holder}` refused: the store holds epoch {held} by `{held_by}`"
    )]
    Stale { agent: String, epoch: i64, holder: String, held: i64, held_by: String },
    #[error(transparent)]
    Capsule(#[from] CapsuleError),
    #[error("store: {0}")]
    Io(#[from] std::io::Error),
}

/// Where checkpoints and blobs are kept.
pub trait Archive: Send + Sync + 'static {
    fn has_blob(&self, sha: &str) -> Result<bool, StoreError>;
    /// Stores a blob after checking its hash.
    fn put_blob(&self, sha: &str, bytes: &[u8]) -> Result<(), StoreError>;
    fn get_blob(&self, sha: &str) -> Result<Vec<u8>, StoreError>;
    /// Replaces the agent's checkpoint (see the module's fencing rule).
    fn put_checkpoint(&self, cap: &CapsuleFiles) -> Result<(), StoreError>;
    fn get_checkpoint(&self, agent: &AgentId) -> Result<Option<CapsuleFiles>, StoreError>;
}

/// Reads blobs of a store as a [`BlobSource`].
pub struct StoreBlobs<'a>(pub &'a dyn Archive);

impl BlobSource for StoreBlobs<'_> {
    fn blob(&self, sha: &str) -> std::io::Result<Vec<u8>> {
        self.0.get_blob(sha).map_err(|e| std::io::Error::new(std::io::ErrorKind::NotFound, e.to_string()))
    }
}

/// A checkpoint as stored: the manifest and the non-blob files, base64.
#[derive(Serialize, Deserialize)]
struct Stored {
    manifest: Manifest,
    files: BTreeMap<String, String>,
}

/// The default store: `<root>/blobs/<sha256>` and `<root>/agents/<id>/checkpoint.json`.
#[derive(Debug, Clone)]
pub struct DirArchive {
    root: PathBuf,
}

impl DirArchive {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    fn blob_file(&self, sha: &str) -> Result<PathBuf, StoreError> {
        if !is_sha256_hex(sha) {
            return Err(StoreError::HashMismatch(sha.to_string()));
        }
        Ok(self.root.join("blobs").join(sha))
    }

    fn checkpoint_file(&self, agent: &AgentId) -> PathBuf {
        self.root.join("agents").join(agent.as_str()).join("checkpoint.json")
    }
}

impl Archive for DirArchive {
    fn has_blob(&self, sha: &str) -> Result<bool, StoreError> {
        Ok(self.blob_file(sha)?.is_file())
    }

    fn put_blob(&self, sha: &str, bytes: &[u8]) -> Result<(), StoreError> {
        if sha256_hex(bytes) != sha {
            return Err(StoreError::HashMismatch(sha.to_string()));
        }
        let path = self.blob_file(sha)?;
        if !path.is_file() {
            fsio::write_atomic(&path, bytes)?;
        }
        Ok(())
    }

    fn get_blob(&self, sha: &str) -> Result<Vec<u8>, StoreError> {
        match std::fs::read(self.blob_file(sha)?) {
            Ok(b) if sha256_hex(&b) == sha => Ok(b),
            Ok(_) => Err(StoreError::HashMismatch(sha.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(StoreError::MissingBlob(sha.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    fn put_checkpoint(&self, cap: &CapsuleFiles) -> Result<(), StoreError> {
        cap.check()?;
        for sha in cap.blob_hashes() {
            if !self.has_blob(&sha)? {
                return Err(StoreError::MissingBlob(sha));
            }
        }
        if let Some(held) = self.get_checkpoint(cap.agent_id())? {
            let (e, h) = (cap.manifest.epoch, &cap.manifest.holder);
            if held.manifest.epoch > e || (held.manifest.epoch == e && held.manifest.holder != *h) {
                return Err(StoreError::Stale {
                    agent: cap.agent_id().to_string(),
                    epoch: e,
                    holder: h.clone(),
                    held: held.manifest.epoch,
                    held_by: held.manifest.holder,
                });
            }
        }
        let stored = Stored { manifest: cap.manifest.clone(), files: cap.files_base64() };
        let bytes = serde_json::to_vec(&stored).map_err(std::io::Error::other)?;
        fsio::write_atomic(&self.checkpoint_file(cap.agent_id()), &bytes)?;
        Ok(())
    }

    fn get_checkpoint(&self, agent: &AgentId) -> Result<Option<CapsuleFiles>, StoreError> {
        let bytes = match std::fs::read(self.checkpoint_file(agent)) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let stored: Stored = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
        Ok(Some(CapsuleFiles::from_base64(stored.manifest, &stored.files)?))
    }
}

/// Puts every blob of `cap` from `blobs` into the store, then the checkpoint.
pub fn put_capsule(store: &dyn Archive, cap: &CapsuleFiles, blobs: &dyn BlobSource) -> Result<(), StoreError> {
    for sha in cap.blob_hashes() {
        if !store.has_blob(&sha)? {
            let body = blobs.blob(&sha)?;
            store.put_blob(&sha, &body)?;
        }
    }
    store.put_checkpoint(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_are_fenced_by_epoch() {
        let root = std::env::temp_dir().join(format!("airlock-store-{}", uuid::Uuid::new_v4()));
        let store = DirArchive::new(&root);
        let (mut cap, blobs) = crate::files::tests::sample();
        assert!(matches!(store.put_checkpoint(&cap), Err(StoreError::MissingBlob(_))));
        put_capsule(&store, &cap, &blobs).unwrap();
        assert_eq!(store.get_checkpoint(cap.agent_id()).unwrap().unwrap(), cap);
        cap.rehold("node-b", 2);
        store.put_checkpoint(&cap).unwrap();
        let mut stale = cap.clone();
        stale.rehold("node-a", 1);
        assert!(matches!(store.put_checkpoint(&stale), Err(StoreError::Stale { .. })));
        stale.rehold("node-c", 2);
        assert!(matches!(store.put_checkpoint(&stale), Err(StoreError::Stale { .. })));
        assert!(matches!(store.put_blob(&"0".repeat(64), b"x"), Err(StoreError::HashMismatch(_))));
        std::fs::remove_dir_all(root).unwrap();
    }
}
