//! Offline verification of a capsule folder or tar, against its own manifest.
//!
//! Reports every problem, not just the first, one line each:
//! `missing: P`, `altered: P`, `truncated: P`, `extra: P`, `bad-signature`,
//! `bad-chain: machine M at seq N`; and, for a capsule that cannot be checked at all,
//! `bad-manifest: …` or `bad-journal: …`. A file is *truncated* when it is shorter than the
//! manifest says, *altered* when its size or hash differ otherwise (or it is not a regular
//! file, or a blob's name is not its hash), *extra* when the manifest does not list it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{self, Read};
use std::path::Path;

use sha2::{Digest, Sha256};

use super::files::{BLOBS_DIR, SNAPSHOT, Snapshot, for_each_tar_entry};
use super::manifest::{self, Manifest, check_rel_path};
use super::{blob_path, journal};

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Problem {
    Missing(String),
    Altered(String),
    Truncated(String),
    Extra(String),
    BadSignature,
    BadChain { machine: String, seq: u64 },
    BadManifest(String),
    BadJournal(String),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Missing(p) => write!(f, "missing: {p}"),
            Problem::Altered(p) => write!(f, "altered: {p}"),
            Problem::Truncated(p) => write!(f, "truncated: {p}"),
            Problem::Extra(p) => write!(f, "extra: {p}"),
            Problem::BadSignature => write!(f, "bad-signature"),
            Problem::BadChain { machine, seq } => write!(f, "bad-chain: machine {machine} at seq {seq}"),
            Problem::BadManifest(m) => write!(f, "bad-manifest: {m}"),
            Problem::BadJournal(m) => write!(f, "bad-journal: {m}"),
        }
    }
}

/// What verification found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub problems: Vec<Problem>,
    /// Whether a `manifest.sig` was present and valid.
    pub signed: bool,
    /// The key (hex, lowercase) whose valid signature the capsule carries.
    pub signed_by: Option<String>,
    pub manifest: Option<Manifest>,
}

impl Report {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// How strict to be about the signature.
#[derive(Debug, Clone, Default)]
pub struct VerifyOptions {
    /// Hex public keys the signature must come from (empty: any key, the signature then
    /// only proves the manifest was not changed after signing by its own key).
    pub trusted_keys: Vec<String>,
    /// Report `missing: manifest.sig` for an unsigned capsule.
    pub require_signature: bool,
    /// How much a tar may hold (a tar over them does not verify).
    pub tar_limits: super::files::TarLimits,
}

/// One file as found on disk or in the tar.
#[derive(Debug, Clone)]
struct Found {
    sha256: String,
    size: u64,
    regular: bool,
}

/// Everything verification needs from a capsule, gathered in one pass.
#[derive(Debug, Default)]
struct Scan {
    found: BTreeMap<String, Found>,
    /// Paths that cannot be part of any capsule (absolute, `..`, duplicated in a tar).
    unsafe_paths: Vec<String>,
    /// Bodies of the small files the checks read.
    kept: BTreeMap<String, Vec<u8>>,
}

const KEPT: [&str; 4] = [manifest::MANIFEST, manifest::SIGNATURE, journal::PATH, SNAPSHOT];

impl Scan {
    fn add(&mut self, path: String, body: Option<Vec<u8>>, found: Found) {
        if self.found.contains_key(&path) {
            self.unsafe_paths.push(path);
            return;
        }
        if let Some(b) = body.filter(|_| KEPT.contains(&path.as_str())) {
            self.kept.insert(path.clone(), b);
        }
        self.found.insert(path, found);
    }
}

/// Verifies a capsule folder, or a tar when `path` is a file.
pub fn verify_path(path: &Path, opts: &VerifyOptions) -> io::Result<Report> {
    let meta = std::fs::metadata(path)?;
    let scan = if meta.is_dir() { scan_dir(path)? } else { scan_tar(path, &opts.tar_limits)? };
    Ok(check(scan, opts))
}

fn scan_dir(root: &Path) -> io::Result<Scan> {
    let mut scan = Scan::default();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
            let meta = std::fs::symlink_metadata(entry.path())?;
            if meta.is_dir() {
                stack.push((entry.path(), rel));
            } else if meta.is_file() {
                let (sha256, size, body) = hash_file(&entry.path(), KEPT.contains(&rel.as_str()))?;
                scan.add(rel, body, Found { sha256, size, regular: true });
            } else {
                scan.add(rel, None, Found { sha256: String::new(), size: 0, regular: false });
            }
        }
    }
    Ok(scan)
}

fn hash_file(path: &Path, keep: bool) -> io::Result<(String, u64, Option<Vec<u8>>)> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut size = 0u64;
    let mut kept = keep.then(Vec::new);
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
        if let Some(k) = kept.as_mut() {
            k.extend_from_slice(&buf[..n]);
        }
    }
    Ok((hex::encode(hasher.finalize()), size, kept))
}

fn scan_tar(path: &Path, limits: &super::files::TarLimits) -> io::Result<Scan> {
    let mut scan = Scan::default();
    let r = for_each_tar_entry(path, limits, |p, body| {
        if let Some(odd) = p.strip_prefix('\0') {
            scan.add(odd.to_string(), None, Found { sha256: String::new(), size: 0, regular: false });
            return Ok(());
        }
        if check_rel_path(p).is_err() {
            scan.unsafe_paths.push(p.to_string());
            return Ok(());
        }
        let found = Found { sha256: super::sha256_hex(&body), size: body.len() as u64, regular: true };
        scan.add(p.to_string(), Some(body), found);
        Ok(())
    });
    match r {
        Ok(()) => Ok(scan),
        Err(super::files::CapsuleError::Io(e)) => Err(e),
        Err(e) => Err(io::Error::other(e.to_string())),
    }
}

fn check(scan: Scan, opts: &VerifyOptions) -> Report {
    let mut report = Report::default();
    let mut problems = Vec::new();
    let Some(manifest_bytes) = scan.kept.get(manifest::MANIFEST) else {
        problems.push(Problem::Missing(manifest::MANIFEST.into()));
        report.problems = problems;
        return report;
    };
    let manifest = match Manifest::parse(manifest_bytes) {
        Ok(m) => m,
        Err(e) => {
            problems.push(Problem::BadManifest(e.to_string()));
            report.problems = problems;
            return report;
        }
    };

    let mut missing = BTreeSet::new();
    for (path, want) in &manifest.files {
        match scan.found.get(path) {
            None => {
                missing.insert(path.clone());
                problems.push(Problem::Missing(path.clone()));
            }
            Some(got) if !got.regular => problems.push(Problem::Altered(path.clone())),
            Some(got) if got.size < want.size => problems.push(Problem::Truncated(path.clone())),
            Some(got) if got.size != want.size || got.sha256 != want.sha256 => {
                problems.push(Problem::Altered(path.clone()))
            }
            Some(_) => {
                if path.strip_prefix(BLOBS_DIR).is_some_and(|name| name != want.sha256) {
                    problems.push(Problem::Altered(path.clone()));
                }
            }
        }
    }
    for path in scan.found.keys() {
        if path != manifest::MANIFEST && path != manifest::SIGNATURE && !manifest.files.contains_key(path) {
            problems.push(Problem::Extra(path.clone()));
        }
    }
    for path in &scan.unsafe_paths {
        problems.push(Problem::Extra(path.clone()));
    }

    // Every workspace entry must be backed by a blob the capsule lists.
    if let Some(snapshot) = scan.kept.get(SNAPSHOT).and_then(|b| serde_json::from_slice::<Snapshot>(b).ok()) {
        let wanted: BTreeSet<String> = snapshot.values().map(|sha| blob_path(sha)).collect();
        for p in wanted {
            if !manifest.files.contains_key(&p) && !missing.contains(&p) {
                problems.push(Problem::Missing(p));
            }
        }
    }

    match scan.kept.get(manifest::SIGNATURE) {
        Some(sig) => {
            if manifest::check_signature(manifest_bytes, sig, &opts.trusted_keys) {
                report.signed = true;
                report.signed_by =
                    serde_json::from_slice::<manifest::ManifestSig>(sig).ok().map(|s| s.key_id.to_ascii_lowercase());
            } else {
                problems.push(Problem::BadSignature);
            }
        }
        None if opts.require_signature => problems.push(Problem::Missing(manifest::SIGNATURE.into())),
        None => {}
    }

    if let Some(bytes) = scan.kept.get(journal::PATH) {
        match journal::check_bytes(bytes) {
            Ok(breaks) => problems.extend(breaks.into_iter().map(|(machine, seq)| Problem::BadChain { machine, seq })),
            Err(e) => problems.push(Problem::BadJournal(e.to_string())),
        }
    }

    report.problems = problems;
    report.manifest = Some(manifest);
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::CapsuleFiles;
    use crate::manifest::Signer;

    fn write_sample(root: &Path, signer: Option<&Signer>) -> std::path::PathBuf {
        let (cap, blobs) = crate::files::tests::sample();
        let dir = root.join("cap");
        cap.write_dir(&dir, &blobs, signer).unwrap();
        dir
    }

    fn lines(r: &Report) -> Vec<String> {
        r.problems.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn every_kind_of_damage_is_named() {
        let root = std::env::temp_dir().join(format!("airlock-verify-{}", uuid::Uuid::new_v4()));
        let (signer, _) = Signer::generate();
        let dir = write_sample(&root, Some(&signer));
        let opts = VerifyOptions::default();
        let r = verify_path(&dir, &opts).unwrap();
        assert!(r.is_ok() && r.signed, "{:?}", r.problems);

        let wm = dir.join("memory/working_memory.md");
        std::fs::write(&wm, b"# notez\n").unwrap();
        std::fs::write(dir.join("memory/vector_index/index.json"), b"{").unwrap();
        std::fs::remove_file(dir.join("artifacts/snapshot.json")).unwrap();
        std::fs::write(dir.join("stray.txt"), b"x").unwrap();
        let r = verify_path(&dir, &opts).unwrap();
        assert_eq!(
            lines(&r),
            vec![
                "missing: artifacts/snapshot.json",
                "truncated: memory/vector_index/index.json",
                "altered: memory/working_memory.md",
                "extra: stray.txt",
            ]
        );

        let m = std::fs::read_to_string(dir.join("manifest.json")).unwrap().replace("node-a", "node-b");
        std::fs::write(dir.join("manifest.json"), m).unwrap();
        let r = verify_path(&dir, &opts).unwrap();
        assert!(lines(&r).contains(&"bad-signature".to_string()), "{:?}", lines(&r));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn tar_damage_is_named() {
        let root = std::env::temp_dir().join(format!("airlock-verify-{}", uuid::Uuid::new_v4()));
        let dir = write_sample(&root, None);
        let (cap, blobs) = CapsuleFiles::read_dir(&dir).unwrap();
        let tar = root.join("cap.tar");
        cap.write_tar(&tar, &blobs, None).unwrap();
        assert!(verify_path(&tar, &VerifyOptions::default()).unwrap().is_ok());
        let mut bytes = std::fs::read(&tar).unwrap();
        let needle = b"hello\n";
        let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap();
        bytes[at] = b'j';
        std::fs::write(&tar, &bytes).unwrap();
        let r = verify_path(&tar, &VerifyOptions::default()).unwrap();
        let sha = crate::sha256_hex(b"hello\n");
        assert_eq!(lines(&r), vec![format!("altered: artifacts/blobs/{sha}")]);
        std::fs::remove_dir_all(root).unwrap();
    }
}
