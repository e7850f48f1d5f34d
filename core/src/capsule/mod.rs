//! Capsules: an agent's whole portable state as a folder (or its tar) that anyone can
//! open with `tar`, `sha256sum` and `jq`, and the pieces that move it between machines.
//!
//! A tour:
//! - [`files`]: the capsule in memory ([`CapsuleFiles`]), written to and read from a folder
//!   or a tar, every file atomically ([`fsio`]).
//! - [`manifest`]: format v1's `manifest.json` (identity, holder, epoch, sha256 and size of
//!   every other file) and the optional ed25519 `manifest.sig`.
//! - [`verify`]: the offline check that reports every missing, truncated, altered or extra
//!   file, a bad signature and a broken journal chain.
//! - [`journal`]: `memory/timeline_events.jsonl`, hash-chained per machine, ordered by a
//!   Lamport clock; merging two copies is a set union.
//! - [`env`]: `environment/spec.json` (secret names only) and the host keyring that lends
//!   secret values to one run.
//! - [`render`]: pure functions from the journal to provider messages, and `fit`.
//! - [`store`]: the durable copy of each agent's latest checkpoint, behind a trait.
//! - [`protocol`]: the node protocol (types, request authentication, the HTTP client).
//! - [`agents`] and [`migrations`]: the Postgres side (holder and epoch of each agent; the
//!   phases of each migration).
//!
//! Invariants: a capsule names its agent by one id everywhere; a blob's file name is the
//! sha256 of its content; nothing but secret *names* is ever written into a capsule.

pub mod agents;
pub mod env;
pub mod files;
pub mod fsio;
pub mod journal;
pub mod manifest;
pub mod migrations;
pub mod protocol;
pub mod render;
pub mod store;
pub mod verify;

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use files::CapsuleFiles;
pub use manifest::{FORMAT_V1, Manifest};

/// The one name of an agent: in the capsule, in Postgres, on every node and in every
/// request. It becomes a directory name, so it is restricted to a safe alphabet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AgentId(String);

impl AgentId {
    /// 1 to 128 characters of `[A-Za-z0-9._-]`, starting with a letter or digit.
    pub fn parse(s: &str) -> Result<Self, InvalidName> {
        if valid_name(s, 128) {
            Ok(Self(s.to_string()))
        } else {
            Err(InvalidName { what: "agent id", value: s.into() })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for AgentId {
    type Error = InvalidName;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<AgentId> for String {
    fn from(a: AgentId) -> Self {
        a.0
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The id of a node that can host agents (`worker.node_id`). Lowercase, because
/// configuration keys from the environment are lowercased (`nodes.<id>.url`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

impl NodeId {
    /// 1 to 64 characters of `[a-z0-9_-]`, starting with a letter or digit.
    pub fn parse(s: &str) -> Result<Self, InvalidName> {
        let ok = valid_name(s, 64) && !s.contains('.') && !s.bytes().any(|b| b.is_ascii_uppercase());
        if ok { Ok(Self(s.to_string())) } else { Err(InvalidName { what: "node id", value: s.into() }) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for NodeId {
    type Error = InvalidName;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<NodeId> for String {
    fn from(n: NodeId) -> Self {
        n.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn valid_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("`{value}` is not a valid {what}")]
pub struct InvalidName {
    pub what: &'static str,
    pub value: String,
}

/// The lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Whether `s` is a lowercase hex sha256 (64 characters).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Where a blob lives inside a capsule.
pub fn blob_path(sha: &str) -> String {
    format!("{}{sha}", files::BLOBS_DIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(AgentId::parse("agent-1").is_ok());
        assert!(AgentId::parse("A.b_c-9").is_ok());
        for bad in ["", ".hidden", "-x", "a/b", "..", "a b", &"x".repeat(129)] {
            assert!(AgentId::parse(bad).is_err(), "{bad}");
        }
        assert!(NodeId::parse("node-a").is_ok());
        assert!(NodeId::parse("Node").is_err());
        assert!(NodeId::parse("a.b").is_err());
    }

    #[test]
    fn hashes() {
        let h = sha256_hex(b"abc");
        assert_eq!(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(is_sha256_hex(&h));
        assert!(!is_sha256_hex(&h.to_uppercase()));
        assert!(!is_sha256_hex("abc"));
    }
}
