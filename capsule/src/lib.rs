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
//! - [`archive`]: the durable copy of each agent's latest checkpoint and its blobs, behind a
//!   trait (a directory today; an object store later).
//! - [`protocol`]: the node protocol (types, request authentication, the HTTP client).
//! - [`agents`] and [`relocation`]: the Postgres side (holder and epoch of each agent; the
//!   phases of each migration).
//!
//! Invariants: a capsule names its agent by one id everywhere; a blob's file name is the
//! sha256 of its content; nothing but secret *names* is ever written into a capsule.

pub mod agents;
pub mod archive;
pub mod env;
pub mod files;
pub mod fsio;
pub mod journal;
pub mod manifest;
pub mod protocol;
pub mod relocation;
pub mod render;
pub mod verify;

use sha2::{Digest, Sha256};

pub use files::CapsuleFiles;
pub use manifest::{FORMAT_V1, Manifest};

pub use airlock_core::ids::{AgentId, InvalidName, NodeId};

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
    fn hashes() {
        let h = sha256_hex(b"abc");
        assert_eq!(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(is_sha256_hex(&h));
        assert!(!is_sha256_hex(&h.to_uppercase()));
        assert!(!is_sha256_hex("abc"));
    }
}
