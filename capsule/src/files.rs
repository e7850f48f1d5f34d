//! A capsule in memory, and its folder and tar forms.
//!
//! [`CapsuleFiles`] holds the manifest and every file but the blobs, which are read through
//! a [`BlobSource`] (a folder, a store, a map) so that a capsule's bodies need not all sit
//! in memory. A folder is written file by file, each atomically, blobs before the
//! manifest and the manifest last, so a crash mid-export leaves no manifest and the
//! folder is plainly incomplete. A tar is built in a temporary file and renamed into place;
//! it holds exactly the capsule's paths at its root (no directory entries).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::env::{EnvError, EnvSpec};
use super::journal::{self, Journal, JournalError};
use super::manifest::{self, FORMAT_V1, FileEntry, Manifest, ManifestError, Signer};
use super::{AgentId, blob_path, fsio, is_sha256_hex, sha256_hex};

/// `memory/working_memory.md`
pub const WORKING_MEMORY: &str = "memory/working_memory.md";
/// `memory/vector_index/index.json`
pub const VECTOR_INDEX: &str = "memory/vector_index/index.json";
/// `artifacts/snapshot.json`
pub const SNAPSHOT: &str = "artifacts/snapshot.json";
/// Prefix of every blob path.
pub const BLOBS_DIR: &str = "artifacts/blobs/";

/// The workspace: path → sha256 of its content.
pub type Snapshot = BTreeMap<String, String>;

#[derive(Debug, thiserror::Error)]
pub enum CapsuleError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("journal: {0}")]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("capsule: {0}")]
    Invalid(String),
}

fn invalid(m: impl Into<String>) -> CapsuleError {
    CapsuleError::Invalid(m.into())
}

/// Reads blob bodies by hash.
pub trait BlobSource {
    fn blob(&self, sha: &str) -> io::Result<Vec<u8>>;
}

impl BlobSource for BTreeMap<String, Vec<u8>> {
    fn blob(&self, sha: &str) -> io::Result<Vec<u8>> {
        self.get(sha).cloned().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("blob {sha}")))
    }
}

/// Blobs in a directory, one file per hash.
#[derive(Debug, Clone)]
pub struct DirBlobs(pub PathBuf);

impl BlobSource for DirBlobs {
    fn blob(&self, sha: &str) -> io::Result<Vec<u8>> {
        if !is_sha256_hex(sha) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a sha256"));
        }
        std::fs::read(self.0.join(sha))
    }
}

/// The parts an agent's state is made of, before they are laid out as files.
#[derive(Debug, Clone, Default)]
pub struct Parts {
    pub working_memory: Vec<u8>,
    pub journal: Journal,
    pub vector_index: Vec<u8>,
    /// Workspace path → content.
    pub workspace: BTreeMap<String, Vec<u8>>,
    pub env: EnvSpec,
}

/// A capsule: its manifest and every file but the blobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapsuleFiles {
    pub manifest: Manifest,
    /// Every listed file outside `artifacts/blobs/`, by path.
    pub files: BTreeMap<String, Vec<u8>>,
}

/// Now, as RFC 3339 UTC to the second.
pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

impl CapsuleFiles {
    /// Lays out `parts` as a capsule; returns it with its blobs (content-addressed, each
    /// body stored once however many workspace paths share it).
    pub fn assemble(
        agent_id: AgentId,
        holder: &str,
        epoch: i64,
        parts: &Parts,
    ) -> Result<(Self, BTreeMap<String, Vec<u8>>), CapsuleError> {
        let mut blobs = BTreeMap::new();
        let mut snapshot = Snapshot::new();
        for (path, body) in &parts.workspace {
            let sha = sha256_hex(body);
            snapshot.insert(path.clone(), sha.clone());
            blobs.insert(sha, body.clone());
        }
        let mut cap = Self {
            manifest: Manifest {
                format: FORMAT_V1.into(),
                agent_id,
                holder: holder.to_string(),
                epoch,
                exported_at: now_rfc3339(),
                files: BTreeMap::new(),
            },
            files: BTreeMap::new(),
        };
        cap.set_file(WORKING_MEMORY, parts.working_memory.clone());
        cap.set_file(journal::PATH, parts.journal.to_bytes());
        cap.set_file(VECTOR_INDEX, parts.vector_index.clone());
        cap.set_file(SNAPSHOT, json_bytes(&snapshot));
        cap.set_file(super::env::PATH, parts.env.to_bytes()?);
        for (sha, body) in &blobs {
            cap.manifest.files.insert(blob_path(sha), FileEntry { sha256: sha.clone(), size: body.len() as u64 });
        }
        Ok((cap, blobs))
    }

    /// Replaces (or adds) one non-blob file and its manifest entry.
    pub fn set_file(&mut self, path: &str, bytes: Vec<u8>) {
        self.manifest
            .files
            .insert(path.to_string(), FileEntry { sha256: sha256_hex(&bytes), size: bytes.len() as u64 });
        self.files.insert(path.to_string(), bytes);
    }

    pub fn agent_id(&self) -> &AgentId {
        &self.manifest.agent_id
    }

    pub fn journal(&self) -> Result<Journal, CapsuleError> {
        Ok(Journal::parse(self.file(journal::PATH)?)?)
    }

    pub fn set_journal(&mut self, j: &Journal) {
        self.set_file(journal::PATH, j.to_bytes());
    }

    pub fn snapshot(&self) -> Result<Snapshot, CapsuleError> {
        serde_json::from_slice(self.file(SNAPSHOT)?).map_err(|e| invalid(format!("{SNAPSHOT}: {e}")))
    }

    pub fn env(&self) -> Result<EnvSpec, CapsuleError> {
        Ok(EnvSpec::parse(self.file(super::env::PATH)?)?)
    }

    fn file(&self, path: &str) -> Result<&[u8], CapsuleError> {
        self.files.get(path).map(Vec::as_slice).ok_or_else(|| invalid(format!("`{path}` is missing")))
    }

    /// The hashes of the blobs the manifest lists.
    pub fn blob_hashes(&self) -> Vec<String> {
        self.manifest.files.keys().filter_map(|p| p.strip_prefix(BLOBS_DIR)).map(str::to_string).collect()
    }

    /// The sha256 of the manifest's bytes: names this exact state.
    pub fn manifest_sha256(&self) -> String {
        sha256_hex(&self.manifest.to_bytes())
    }

    /// Sets the holder and epoch (a new holder takes the agent over).
    pub fn rehold(&mut self, holder: &str, epoch: i64) {
        self.manifest.holder = holder.to_string();
        self.manifest.epoch = epoch;
    }

    /// Checks that the files agree with the manifest and with each other: every listed
    /// non-blob file present with its hash and size, nothing unlisted, blobs named by
    /// their hash, every snapshot entry backed by a listed blob, a valid environment spec
    /// (no literal credential) and journal.
    pub fn check(&self) -> Result<(), CapsuleError> {
        if self.manifest.format != FORMAT_V1 {
            return Err(ManifestError::UnknownFormat(self.manifest.format.clone()).into());
        }
        for (path, entry) in &self.manifest.files {
            manifest::check_rel_path(path).map_err(|m| invalid(format!("`{path}`: {m}")))?;
            if let Some(sha) = path.strip_prefix(BLOBS_DIR) {
                if sha != entry.sha256 {
                    return Err(invalid(format!("`{path}` is not named by its sha256")));
                }
                continue;
            }
            let body = self.files.get(path).ok_or_else(|| invalid(format!("`{path}` is missing")))?;
            if body.len() as u64 != entry.size || sha256_hex(body) != entry.sha256 {
                return Err(invalid(format!("`{path}` does not match the manifest")));
            }
        }
        if let Some(extra) = self.files.keys().find(|p| !self.manifest.files.contains_key(*p)) {
            return Err(invalid(format!("`{extra}` is not in the manifest")));
        }
        for required in [WORKING_MEMORY, journal::PATH, VECTOR_INDEX, SNAPSHOT, super::env::PATH] {
            self.file(required)?;
        }
        for (path, sha) in self.snapshot()? {
            if !self.manifest.files.contains_key(&blob_path(&sha)) {
                return Err(invalid(format!("snapshot entry `{path}` names a blob the capsule lacks")));
            }
        }
        self.env()?;
        self.journal()?;
        Ok(())
    }

    /// Writes the capsule as a folder. `dir` must not exist or be empty. Each file is
    /// written atomically; blob bodies are checked against their names on the way.
    pub fn write_dir(&self, dir: &Path, blobs: &dyn BlobSource, signer: Option<&Signer>) -> Result<(), CapsuleError> {
        self.check()?;
        if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
            return Err(invalid(format!("{} exists and is not empty", dir.display())));
        }
        fsio::create_dir_all_synced(dir)?;
        for (path, bytes) in &self.files {
            fsio::write_atomic(&dir.join(path), bytes)?;
        }
        for sha in self.blob_hashes() {
            let body = blobs.blob(&sha)?;
            if sha256_hex(&body) != sha {
                return Err(invalid(format!("blob {sha} does not match its hash")));
            }
            fsio::write_atomic(&dir.join(blob_path(&sha)), &body)?;
        }
        let manifest = self.manifest.to_bytes();
        fsio::write_atomic(&dir.join(manifest::MANIFEST), &manifest)?;
        if let Some(s) = signer {
            fsio::write_atomic(&dir.join(manifest::SIGNATURE), &s.sign(&manifest).to_bytes())?;
        }
        fsio::sync_dir(dir)?;
        Ok(())
    }

    /// Writes the capsule as a tar at `path` (built beside it, then renamed into place).
    pub fn write_tar(&self, path: &Path, blobs: &dyn BlobSource, signer: Option<&Signer>) -> Result<(), CapsuleError> {
        self.check()?;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        fsio::create_dir_all_synced(dir)?;
        let name = path.file_name().ok_or_else(|| invalid("tar path has no file name"))?;
        let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), uuid::Uuid::new_v4().simple()));
        let mtime =
            chrono::DateTime::parse_from_rfc3339(&self.manifest.exported_at).map_or(0, |t| t.timestamp().max(0));
        let result = (|| -> Result<(), CapsuleError> {
            let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            let mut tar = tar::Builder::new(file);
            let mut add = |p: &str, bytes: &[u8]| -> io::Result<()> {
                let mut h = tar::Header::new_gnu();
                h.set_size(bytes.len() as u64);
                h.set_mode(0o644);
                h.set_mtime(mtime as u64);
                h.set_uid(0);
                h.set_gid(0);
                h.set_entry_type(tar::EntryType::Regular);
                tar.append_data(&mut h, p, bytes)
            };
            let manifest = self.manifest.to_bytes();
            add(manifest::MANIFEST, &manifest)?;
            if let Some(s) = signer {
                add(manifest::SIGNATURE, &s.sign(&manifest).to_bytes())?;
            }
            for (p, bytes) in &self.files {
                add(p, bytes)?;
            }
            for sha in self.blob_hashes() {
                let body = blobs.blob(&sha)?;
                if sha256_hex(&body) != sha {
                    return Err(invalid(format!("blob {sha} does not match its hash")));
                }
                add(&blob_path(&sha), &body)?;
            }
            let mut file = tar.into_inner()?;
            file.flush()?;
            file.sync_all()?;
            std::fs::rename(&tmp, path)?;
            fsio::sync_dir(dir)?;
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Reads a capsule folder (verify it first: this only parses).
    pub fn read_dir(dir: &Path) -> Result<(Self, DirBlobs), CapsuleError> {
        let manifest = Manifest::parse(&std::fs::read(dir.join(manifest::MANIFEST))?)?;
        let mut files = BTreeMap::new();
        for path in manifest.files.keys().filter(|p| !p.starts_with(BLOBS_DIR)) {
            files.insert(path.clone(), std::fs::read(dir.join(path))?);
        }
        Ok((Self { manifest, files }, DirBlobs(dir.join(BLOBS_DIR))))
    }

    /// Reads a capsule tar (verify it first: this only parses) within the default
    /// [`TarLimits`]. Blobs come back in memory.
    pub fn read_tar(path: &Path) -> Result<(Self, BTreeMap<String, Vec<u8>>), CapsuleError> {
        Self::read_tar_within(path, &TarLimits::default())
    }

    /// [`read_tar`](Self::read_tar) within `limits`.
    pub fn read_tar_within(path: &Path, limits: &TarLimits) -> Result<(Self, BTreeMap<String, Vec<u8>>), CapsuleError> {
        let mut all = BTreeMap::new();
        for_each_tar_entry(path, limits, |p, body| {
            all.insert(p.to_string(), body);
            Ok(())
        })?;
        let manifest = Manifest::parse(all.get(manifest::MANIFEST).ok_or_else(|| invalid("no manifest.json"))?)?;
        let mut files = BTreeMap::new();
        let mut blobs = BTreeMap::new();
        for path in manifest.files.keys() {
            let body = all.remove(path).ok_or_else(|| invalid(format!("`{path}` is missing")))?;
            match path.strip_prefix(BLOBS_DIR) {
                Some(sha) => {
                    blobs.insert(sha.to_string(), body);
                }
                None => {
                    files.insert(path.clone(), body);
                }
            }
        }
        Ok((Self { manifest, files }, blobs))
    }

    /// The non-blob files, base64-encoded (for the node protocol).
    pub fn files_base64(&self) -> BTreeMap<String, String> {
        use base64::Engine;
        self.files.iter().map(|(p, b)| (p.clone(), base64::engine::general_purpose::STANDARD.encode(b))).collect()
    }

    /// The inverse of [`files_base64`](Self::files_base64).
    pub fn from_base64(manifest: Manifest, files: &BTreeMap<String, String>) -> Result<Self, CapsuleError> {
        use base64::Engine;
        let mut out = BTreeMap::new();
        for (p, b) in files {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|_| invalid(format!("`{p}` is not base64")))?;
            out.insert(p.clone(), bytes);
        }
        Ok(Self { manifest, files: out })
    }
}

/// How much a capsule tar may hold: checked against each entry's header before its body
/// is read or any memory is set aside for it, so a header claiming a huge file costs
/// nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TarLimits {
    /// The largest file (`capsules.max_tar_entry_bytes`).
    pub max_entry_bytes: u64,
    /// The most all files may hold together (`capsules.max_tar_total_bytes`).
    pub max_total_bytes: u64,
}

impl Default for TarLimits {
    fn default() -> Self {
        let d = airlock_core::config::CapsulesConfig::default();
        Self { max_entry_bytes: d.max_tar_entry_bytes, max_total_bytes: d.max_tar_total_bytes }
    }
}

impl TarLimits {
    pub fn from_config(c: &airlock_core::config::CapsulesConfig) -> Self {
        Self { max_entry_bytes: c.max_tar_entry_bytes, max_total_bytes: c.max_tar_total_bytes }
    }
}

/// Calls `f` with each regular file of a tar (path, body). Directory entries are skipped;
/// any other kind of entry (link, device) is reported to `f` with an empty body and a
/// path prefixed by `\0` so a verifier can name it. An entry over `limits` (by its
/// header) ends the walk with an error before its body is read.
pub fn for_each_tar_entry(
    path: &Path,
    limits: &TarLimits,
    mut f: impl FnMut(&str, Vec<u8>) -> Result<(), CapsuleError>,
) -> Result<(), CapsuleError> {
    let file = std::fs::File::open(path)?;
    let mut archive = tar::Archive::new(io::BufReader::new(file));
    let mut total = 0u64;
    for entry in archive.entries()? {
        let mut entry = entry?;
        let kind = entry.header().entry_type();
        let p = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let p = p.strip_prefix("./").unwrap_or(&p).to_string();
        if kind.is_dir() {
            continue;
        }
        if !(kind.is_file() || kind == tar::EntryType::Continuous) {
            f(&format!("\0{p}"), Vec::new())?;
            continue;
        }
        let size = entry.size();
        if size > limits.max_entry_bytes {
            return Err(invalid(format!(
                "`{p}` is {size} bytes, more than the {} a capsule file may hold (capsules.max_tar_entry_bytes)",
                limits.max_entry_bytes
            )));
        }
        total = total.saturating_add(size);
        if total > limits.max_total_bytes {
            return Err(invalid(format!(
                "the files are more than the {} bytes a capsule may hold (capsules.max_tar_total_bytes)",
                limits.max_total_bytes
            )));
        }
        // Within the limit, and never more than the header said.
        let mut body = Vec::with_capacity(size as usize);
        (&mut entry).take(size).read_to_end(&mut body)?;
        f(&p, body)?;
    }
    Ok(())
}

fn json_bytes<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(v).unwrap_or_default();
    out.push(b'\n');
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::journal::EventKind;

    pub(crate) fn sample() -> (CapsuleFiles, BTreeMap<String, Vec<u8>>) {
        let mut journal = Journal::new();
        journal.append(
            "node-a",
            EventKind::Message,
            serde_json::json!({"role": "user", "text": "hi"}),
            "2026-01-01T00:00:00Z",
        );
        let parts = Parts {
            working_memory: b"# notes\n".to_vec(),
            journal,
            vector_index: b"{\"dims\": 0, \"entries\": []}\n".to_vec(),
            workspace: BTreeMap::from([
                ("src/main.rs".to_string(), b"fn main() {}\n".to_vec()),
                ("copy.rs".to_string(), b"fn main() {}\n".to_vec()),
                ("README".to_string(), b"hello\n".to_vec()),
            ]),
            env: EnvSpec { tier: Some("light".into()), ..EnvSpec::default() },
        };
        CapsuleFiles::assemble(AgentId::parse("agent-1").unwrap(), "node-a", 1, &parts).unwrap()
    }

    #[test]
    fn dir_and_tar_round_trip() {
        let (cap, blobs) = sample();
        assert_eq!(cap.blob_hashes().len(), 2, "identical bodies are stored once");
        let root = std::env::temp_dir().join(format!("airlock-files-{}", uuid::Uuid::new_v4()));
        let dir = root.join("cap");
        cap.write_dir(&dir, &blobs, None).unwrap();
        let (back, dir_blobs) = CapsuleFiles::read_dir(&dir).unwrap();
        assert_eq!(back, cap);
        assert!(cap.write_dir(&dir, &blobs, None).is_err(), "refuses a non-empty folder");
        let tar_path = root.join("cap.tar");
        back.write_tar(&tar_path, &dir_blobs, None).unwrap();
        let (from_tar, tar_blobs) = CapsuleFiles::read_tar(&tar_path).unwrap();
        assert_eq!(from_tar, cap);
        assert_eq!(tar_blobs, blobs);
        std::fs::remove_dir_all(root).unwrap();
    }
}
