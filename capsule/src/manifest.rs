//! `manifest.json` and `manifest.sig` of capsule format v1.
//!
//! The manifest names the agent, its holder and epoch, and lists every other file of the
//! capsule with its sha256 and size, so that any truncation or tampering is found offline.
//! Readers ignore unknown top-level keys (forward compatibility) and refuse an unknown
//! `format`. The signature, when present, is ed25519 over the exact bytes of
//! `manifest.json`; its `key_id` is the hex public key. It attests an *exported* state:
//! capsules are signed at export, not at rest.

use std::collections::BTreeMap;

use base64::Engine;
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use super::{AgentId, is_sha256_hex};
use airlock_core::secret::Secret;

/// The format tag of this version.
pub const FORMAT_V1: &str = "airlock.capsule.v1";
/// The manifest's file name, at the capsule's root.
pub const MANIFEST: &str = "manifest.json";
/// The optional signature's file name, at the capsule's root.
pub const SIGNATURE: &str = "manifest.sig";

/// One listed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub sha256: String,
    pub size: u64,
}

/// `manifest.json`. Field order is the serialized order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub agent_id: AgentId,
    /// The node that held the agent when this state was written (empty: none).
    pub holder: String,
    /// The holder's fencing epoch.
    pub epoch: i64,
    /// RFC 3339 UTC.
    pub exported_at: String,
    /// Every file but `manifest.json` and `manifest.sig`, by relative path.
    pub files: BTreeMap<String, FileEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest.json is not JSON: {0}")]
    NotJson(String),
    #[error("unknown capsule format `{0}`")]
    UnknownFormat(String),
    #[error("manifest.json: {0}")]
    Invalid(String),
}

impl Manifest {
    /// Parses and checks a manifest: known format, safe paths, well-formed hashes.
    pub fn parse(bytes: &[u8]) -> Result<Self, ManifestError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ManifestError::NotJson(e.to_string()))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT_V1) => {}
            Some(other) => return Err(ManifestError::UnknownFormat(other.to_string())),
            None => return Err(ManifestError::Invalid("no `format`".into())),
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| ManifestError::Invalid(e.to_string()))?;
        m.check()?;
        Ok(m)
    }

    fn check(&self) -> Result<(), ManifestError> {
        if self.epoch < 0 {
            return Err(ManifestError::Invalid("epoch must not be negative".into()));
        }
        for (path, entry) in &self.files {
            check_rel_path(path).map_err(|m| ManifestError::Invalid(format!("path `{path}`: {m}")))?;
            if path == MANIFEST || path == SIGNATURE {
                return Err(ManifestError::Invalid(format!("`{path}` must not list itself")));
            }
            if !is_sha256_hex(&entry.sha256) {
                return Err(ManifestError::Invalid(format!("`{path}`: sha256 is not lowercase hex")));
            }
        }
        Ok(())
    }

    /// The bytes written to `manifest.json` (pretty JSON, keys in a fixed order, newline).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// Checks a path inside a capsule: relative, `/`-separated, no `.`/`..`/empty segment.
pub fn check_rel_path(path: &str) -> Result<(), &'static str> {
    if path.is_empty() {
        return Err("empty");
    }
    if path.starts_with('/') {
        return Err("absolute");
    }
    if path.contains('\\') || path.contains('\0') {
        return Err("contains a backslash or NUL");
    }
    if path.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
        return Err("has an empty, `.` or `..` segment");
    }
    Ok(())
}

/// `manifest.sig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestSig {
    pub alg: String,
    /// The signer's ed25519 public key, hex.
    pub key_id: String,
    /// base64 (standard, padded) of the 64-byte signature.
    pub sig: String,
}

impl ManifestSig {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SignerError {
    #[error("signing key: environment variable `{0}` is not set")]
    Missing(String),
    #[error("signing key in `{0}`: expected 32 bytes as hex (64 characters) or base64")]
    Malformed(String),
}

/// An ed25519 signing key, read from the environment variable the configuration names.
pub struct Signer {
    key: SigningKey,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({})", self.key_id())
    }
}

impl Signer {
    /// Reads the 32-byte seed (hex or base64) from the variable named `var`.
    pub fn from_env(var: &str) -> Result<Self, SignerError> {
        let value = airlock_core::secret::from_env(var).ok_or_else(|| SignerError::Missing(var.to_string()))?;
        Self::from_secret(&value).ok_or_else(|| SignerError::Malformed(var.to_string()))
    }

    /// Parses a seed given as hex or base64.
    pub fn from_secret(value: &Secret) -> Option<Self> {
        let v = value.expose().trim();
        let bytes = hex::decode(v).ok().or_else(|| base64::engine::general_purpose::STANDARD.decode(v).ok())?;
        let seed: [u8; 32] = bytes.try_into().ok()?;
        Some(Self::from_seed(seed))
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self { key: SigningKey::from_bytes(&seed) }
    }

    /// A fresh random key; returns it with its seed as hex (to put in the environment).
    pub fn generate() -> (Self, Secret) {
        use rand::Rng;
        let mut seed = [0u8; 32];
        rand::rng().fill_bytes(&mut seed);
        (Self::from_seed(seed), Secret::new(hex::encode(seed)))
    }

    /// The hex public key, which is the signature's `key_id`.
    pub fn key_id(&self) -> String {
        hex::encode(self.key.verifying_key().to_bytes())
    }

    /// Signs the exact bytes of `manifest.json`.
    pub fn sign(&self, manifest_bytes: &[u8]) -> ManifestSig {
        let sig = self.key.sign(manifest_bytes);
        ManifestSig {
            alg: "ed25519".into(),
            key_id: self.key_id(),
            sig: base64::engine::general_purpose::STANDARD.encode(sig.to_bytes()),
        }
    }
}

/// Whether `sig_bytes` (a `manifest.sig`) is a valid ed25519 signature of `manifest_bytes`
/// by its `key_id`, and, when `trusted` is given, whether that key is one of them.
pub fn check_signature(manifest_bytes: &[u8], sig_bytes: &[u8], trusted: &[String]) -> bool {
    let Ok(sig) = serde_json::from_slice::<ManifestSig>(sig_bytes) else { return false };
    if sig.alg != "ed25519" {
        return false;
    }
    if !trusted.is_empty() && !trusted.iter().any(|k| k.eq_ignore_ascii_case(&sig.key_id)) {
        return false;
    }
    let Some(key) = hex::decode(&sig.key_id).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()) else { return false };
    let Ok(key) = VerifyingKey::from_bytes(&key) else { return false };
    let Some(raw) = base64::engine::general_purpose::STANDARD
        .decode(sig.sig.trim())
        .ok()
        .and_then(|b| <[u8; 64]>::try_from(b).ok())
    else {
        return false;
    };
    key.verify_strict(manifest_bytes, &ed25519_dalek::Signature::from_bytes(&raw)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let mut files = BTreeMap::new();
        files.insert("memory/working_memory.md".into(), FileEntry { sha256: super::super::sha256_hex(b""), size: 0 });
        Manifest {
            format: FORMAT_V1.into(),
            agent_id: AgentId::parse("a1").unwrap(),
            holder: "node-a".into(),
            epoch: 3,
            exported_at: "2026-01-01T00:00:00Z".into(),
            files,
        }
    }

    #[test]
    fn round_trip_ignores_unknown_keys_and_refuses_unknown_format() {
        let m = manifest();
        let bytes = m.to_bytes();
        assert_eq!(Manifest::parse(&bytes).unwrap(), m);
        let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        v["future_key"] = serde_json::json!({"x": 1});
        assert_eq!(Manifest::parse(&serde_json::to_vec(&v).unwrap()).unwrap(), m);
        v["format"] = "airlock.capsule.v9".into();
        assert!(matches!(Manifest::parse(&serde_json::to_vec(&v).unwrap()), Err(ManifestError::UnknownFormat(_))));
    }

    #[test]
    fn unsafe_paths_refused() {
        for bad in ["/etc/passwd", "../x", "a/../b", "a//b", "./a", "manifest.json"] {
            let mut m = manifest();
            m.files.insert(bad.into(), FileEntry { sha256: super::super::sha256_hex(b""), size: 0 });
            assert!(Manifest::parse(&m.to_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn signatures() {
        let (signer, seed) = Signer::generate();
        let bytes = manifest().to_bytes();
        let sig = signer.sign(&bytes).to_bytes();
        assert!(check_signature(&bytes, &sig, &[]));
        assert!(check_signature(&bytes, &sig, &[signer.key_id()]));
        assert!(!check_signature(&bytes, &sig, &["00".repeat(32)]));
        let mut tampered = bytes.clone();
        tampered[10] ^= 1;
        assert!(!check_signature(&tampered, &sig, &[]));
        let again = Signer::from_secret(&seed).unwrap();
        assert_eq!(again.key_id(), signer.key_id());
    }
}
