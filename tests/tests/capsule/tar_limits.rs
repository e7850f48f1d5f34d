//! Hostile capsule tars: an entry whose header claims more than a capsule file may hold is
//! refused from its header alone, before its body is read or memory is set aside for it;
//! files that together exceed the total are refused too. Verification, reading and import
//! all refuse them, nothing stored.

use std::io::Write;
use std::path::Path;

use airlock_capsule::files::{CapsuleFiles, TarLimits};
use airlock_capsule::verify::{VerifyOptions, verify_path};
use airlock_tests::app::TempDir;
use airlock_tests::capsule::sample_capsule;
use sqlx::PgPool;

const HUNDRED_MB: u64 = 100 * 1024 * 1024;

fn temp() -> TempDir {
    let d = std::env::temp_dir().join(format!("airlock-tar-limits-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

/// A tar with a real manifest first, then one entry whose header says `size` bytes. The
/// body is a hole (`set_len`): the file is as long as the header says, yet costs no disk.
fn tar_with_huge_entry(dir: &Path, size: u64) -> std::path::PathBuf {
    let (cap, blobs) = sample_capsule("agent-t", "origin", 2);
    let folder = dir.join("cap");
    cap.write_dir(&folder, &blobs, None).unwrap();
    let path = dir.join("huge.tar");
    let mut file = std::fs::File::create(&path).unwrap();
    {
        let mut b = tar::Builder::new(&mut file);
        let manifest = std::fs::read(folder.join("manifest.json")).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(manifest.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, "manifest.json", manifest.as_slice()).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_path("workspace/huge.bin").unwrap();
        h.set_size(size);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.get_mut().write_all(h.as_bytes()).unwrap();
    }
    let at = std::fs::metadata(&path).unwrap().len();
    file.set_len(at + size.div_ceil(512) * 512 + 1024).unwrap();
    path
}

#[test]
fn a_100_mb_entry_is_refused_from_its_header() {
    let dir = temp();
    let path = tar_with_huge_entry(&dir.0, HUNDRED_MB);
    assert!(std::fs::metadata(&path).unwrap().len() > HUNDRED_MB, "the body is really there (as a hole)");

    // The default limits refuse it (64 MiB a file).
    let err = CapsuleFiles::read_tar(&path).unwrap_err().to_string();
    assert!(err.contains("workspace/huge.bin") && err.contains("max_tar_entry_bytes"), "{err}");
    let err = verify_path(&path, &VerifyOptions::default()).unwrap_err().to_string();
    assert!(err.contains("max_tar_entry_bytes"), "{err}");

    // A tighter configured limit refuses a smaller one, by its header: the same answer
    // whether or not a body follows.
    let tight = TarLimits { max_entry_bytes: 1024 * 1024, max_total_bytes: 8 * 1024 * 1024 };
    let small = tar_with_huge_entry(&dir.0.join("small"), 2 * 1024 * 1024);
    let err = CapsuleFiles::read_tar_within(&small, &tight).unwrap_err().to_string();
    assert!(err.contains("2097152 bytes, more than the 1048576"), "{err}");
    assert!(CapsuleFiles::read_tar_within(&small, &TarLimits::default()).is_err(), "the fake body is no capsule");
}

#[test]
fn files_over_the_total_are_refused() {
    let dir = temp();
    let (cap, blobs) = sample_capsule("agent-t", "origin", 2);
    let path = dir.0.join("cap.tar");
    cap.write_tar(&path, &blobs, None).unwrap();
    // It reads within the defaults, and not within a total smaller than its files.
    assert!(CapsuleFiles::read_tar(&path).is_ok());
    let tiny = TarLimits { max_entry_bytes: 64 * 1024, max_total_bytes: 200 };
    let err = CapsuleFiles::read_tar_within(&path, &tiny).unwrap_err().to_string();
    assert!(err.contains("max_tar_total_bytes"), "{err}");
    let opts = VerifyOptions { tar_limits: tiny, ..VerifyOptions::default() };
    assert!(verify_path(&path, &opts).is_err());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn import_refuses_a_huge_entry_and_stores_nothing(pool: PgPool) {
    let dir = temp();
    let path = tar_with_huge_entry(&dir.0, HUNDRED_MB);
    let store = airlock_capsule::archive::DirArchive::new(dir.0.join("store"));
    // Even an import that would take an unsigned capsule: the size is refused first.
    let trust = airlock_admin::capsule::Trust { trusted_keys: &[], allow_unsigned: true };
    let err = airlock_admin::capsule::import(&pool, &store, &path, "test", &trust).await.unwrap_err().to_string();
    assert!(err.contains("max_tar_entry_bytes"), "{err}");
    let agents: i64 = sqlx::query_scalar("SELECT count(*) FROM agents").fetch_one(&pool).await.unwrap();
    assert_eq!(agents, 0, "nothing imported");
    assert!(!dir.0.join("store").exists() || std::fs::read_dir(dir.0.join("store")).unwrap().next().is_none());
}
