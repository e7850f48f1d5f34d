//! The capsule format from the outside: `airlock-admin capsule verify` (offline, no
//! database), `capsule export` and `capsule import` as real processes on real capsules, a
//! tampered byte named by its file, tar round trips, signatures, and refusals.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use airlock_capsule::env::EnvSpec;
use airlock_capsule::files::CapsuleFiles;
use airlock_capsule::manifest::Signer;
use airlock_capsule::{AgentId, agents};
use airlock_tests::app::TempDir;
use airlock_tests::capsule::sample_capsule;
use airlock_tests::harness;
use sqlx::PgPool;

/// Runs `airlock-admin capsule ARGS` with only the given environment (no database unless
/// given); returns (exit code, stdout).
fn admin(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(harness::bin_path("airlock-admin"));
    cmd.arg("capsule").args(args).env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run airlock-admin");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn temp() -> TempDir {
    let d = std::env::temp_dir().join(format!("airlock-capsule-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

fn write_sample(dir: &Path) {
    let (cap, blobs) = sample_capsule("agent-f", "origin", 4);
    cap.write_dir(dir, &blobs, None).unwrap();
}

#[test]
fn verify_needs_no_database_and_names_every_damaged_file() {
    let t = temp();
    let dir = t.0.join("cap");
    write_sample(&dir);
    assert_eq!(admin(&["verify", dir.to_str().unwrap()], &[]), (0, "ok\n".into()));

    // One tampered byte in a workspace blob, one in the journal, a truncated file, a
    // missing file and an extra one: each named on its own line.
    let blobs: Vec<_> = std::fs::read_dir(dir.join("artifacts/blobs")).unwrap().map(|e| e.unwrap().path()).collect();
    let blob = blobs.iter().find(|p| std::fs::metadata(p).unwrap().len() < 100).unwrap();
    let mut b = std::fs::read(blob).unwrap();
    b[0] ^= 0x20;
    std::fs::write(blob, &b).unwrap();
    let journal = dir.join("memory/timeline_events.jsonl");
    let j = std::fs::read_to_string(&journal).unwrap().replacen("Summarise", "Summarize", 1);
    std::fs::write(&journal, j).unwrap();
    let wm = dir.join("memory/working_memory.md");
    let w = std::fs::read(&wm).unwrap();
    std::fs::write(&wm, &w[..w.len() / 2]).unwrap();
    std::fs::remove_file(dir.join("memory/vector_index/index.json")).unwrap();
    std::fs::write(dir.join("artifacts/notes.txt"), b"not in the manifest").unwrap();

    let (code, out) = admin(&["verify", dir.to_str().unwrap()], &[]);
    assert_eq!(code, 1, "{out}");
    let name = blob.file_name().unwrap().to_string_lossy();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        vec![
            format!("altered: artifacts/blobs/{name}").as_str(),
            "altered: memory/timeline_events.jsonl",
            "missing: memory/vector_index/index.json",
            "truncated: memory/working_memory.md",
            "extra: artifacts/notes.txt",
            "bad-chain: machine origin at seq 3",
        ]
    );
}

#[test]
fn a_tar_verifies_and_a_flipped_byte_in_it_is_named() {
    let t = temp();
    let (cap, blobs) = sample_capsule("agent-t", "origin", 1);
    let tar = t.0.join("agent-t.tar");
    cap.write_tar(&tar, &blobs, None).unwrap();
    assert_eq!(admin(&["verify", tar.to_str().unwrap()], &[]), (0, "ok\n".into()));
    // The tar holds exactly the capsule's paths at its root.
    let listing = Command::new("tar").arg("-tf").arg(&tar).output().unwrap();
    let mut paths: Vec<String> = String::from_utf8(listing.stdout).unwrap().lines().map(str::to_string).collect();
    paths.sort();
    let mut want: Vec<String> = cap.manifest.files.keys().cloned().collect();
    want.push("manifest.json".into());
    want.sort();
    assert_eq!(paths, want);

    let mut bytes = std::fs::read(&tar).unwrap();
    let needle = b"A demo repository.";
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap();
    bytes[at] = b'a';
    std::fs::write(&tar, &bytes).unwrap();
    let (code, out) = admin(&["verify", tar.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    // The last line has no successor, so only the manifest catches it.
    assert_eq!(out, "altered: memory/timeline_events.jsonl\n");
}

#[test]
fn signatures_are_checked_and_can_be_pinned() {
    let t = temp();
    let (signer, _) = Signer::generate();
    let (cap, blobs) = sample_capsule("agent-s", "origin", 1);
    let dir = t.0.join("signed");
    cap.write_dir(&dir, &blobs, Some(&signer)).unwrap();
    let p = dir.to_str().unwrap();
    assert_eq!(admin(&["verify", p, "--key", &signer.key_id()], &[]).0, 0);
    let (other, _) = Signer::generate();
    assert_eq!(admin(&["verify", p, "--key", &other.key_id()], &[]), (1, "bad-signature\n".into()));
    let m = std::fs::read_to_string(dir.join("manifest.json")).unwrap().replace("\"epoch\": 1", "\"epoch\": 9");
    std::fs::write(dir.join("manifest.json"), m).unwrap();
    assert_eq!(admin(&["verify", p], &[]), (1, "bad-signature\n".into()));
    let unsigned = t.0.join("unsigned");
    cap.write_dir(&unsigned, &blobs, None).unwrap();
    assert_eq!(
        admin(&["verify", unsigned.to_str().unwrap(), "--require-signature"], &[]),
        (1, "missing: manifest.sig\n".into())
    );
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn import_then_export_through_the_command_line(pool: PgPool) {
    let url = harness::database_url(&pool);
    let t = temp();
    let store = t.0.join("store");
    let (signer, seed) = Signer::generate();
    let trusted = signer.key_id();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("AIRLOCK__CAPSULES__STORE_DIR", store.to_str().unwrap()),
        ("AIRLOCK_CAPSULE_SIGNING_KEY", seed.expose()),
        ("AIRLOCK__CAPSULES__TRUSTED_KEYS", trusted.as_str()),
    ];
    let src = t.0.join("in");
    write_sample(&src);
    let (code, out) = admin(&["import", src.to_str().unwrap(), "--allow-unsigned"], &env);
    assert_eq!((code, out.as_str()), (0, "imported agent-f at epoch 4\n"));
    let a = agents::get(&pool, &AgentId::parse("agent-f").unwrap()).await.unwrap().unwrap();
    assert_eq!((a.epoch, a.state, a.holder), (4, agents::AgentState::Stored, None));
    // The same epoch again is refused; nothing changes.
    assert_eq!(admin(&["import", src.to_str().unwrap(), "--allow-unsigned"], &env).0, 1);

    let out_dir = t.0.join("out");
    let (code, out) = admin(&["export", "agent-f", "--out", out_dir.to_str().unwrap(), "--sign"], &env);
    assert_eq!(code, 0, "{out}");
    let (code, out) = admin(&["verify", out_dir.to_str().unwrap(), "--key", &signer.key_id()], &[]);
    assert_eq!((code, out.as_str()), (0, "ok\n"));
    let tar = t.0.join("out.tar");
    assert_eq!(admin(&["export", "agent-f", "--out", tar.to_str().unwrap(), "--tar"], &env).0, 0);
    assert_eq!(admin(&["verify", tar.to_str().unwrap()], &[]), (0, "ok\n".into()));
    let (a, _) = CapsuleFiles::read_dir(&src).unwrap();
    let (b, _) = CapsuleFiles::read_tar(&tar).unwrap();
    assert_eq!(a.files, b.files, "what was imported is what is exported");

    // A newer epoch of the stored agent imports when a trusted key signed it; a tampered
    // capsule does not, whatever the flags.
    let (cap, blobs) = sample_capsule("agent-f", "origin", 5);
    let newer = t.0.join("newer");
    cap.write_dir(&newer, &blobs, Some(&signer)).unwrap();
    assert_eq!(admin(&["import", newer.to_str().unwrap()], &env), (0, "imported agent-f at epoch 5\n".into()));
    let (cap, blobs) = sample_capsule("agent-g", "origin", 1);
    let bad = t.0.join("bad");
    cap.write_dir(&bad, &blobs, None).unwrap();
    std::fs::write(bad.join("memory/working_memory.md"), b"changed").unwrap();
    assert_eq!(admin(&["import", bad.to_str().unwrap(), "--allow-unsigned"], &env).0, 1);
    assert!(agents::get(&pool, &AgentId::parse("agent-g").unwrap()).await.unwrap().is_none());
    let imports: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'capsule.import'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(imports, 2);
    // Both exports are on record, with the key that signed the first.
    let exports: Vec<serde_json::Value> =
        sqlx::query_scalar("SELECT data FROM audit_log WHERE action = 'capsule.export' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(exports.len(), 2, "{exports:?}");
    assert_eq!(exports[0]["signed_by"], trusted.as_str());
    assert_eq!((exports[1]["tar"].as_bool(), exports[1]["signed_by"].is_null()), (Some(true), true));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn only_a_trusted_signature_imports_and_only_it_replaces_an_agent(pool: PgPool) {
    let url = harness::database_url(&pool);
    let t = temp();
    let store = t.0.join("store");
    let (trusted, _) = Signer::generate();
    let (forger, _) = Signer::generate();
    let key = trusted.key_id();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("AIRLOCK__CAPSULES__STORE_DIR", store.to_str().unwrap()),
        ("AIRLOCK__CAPSULES__TRUSTED_KEYS", key.as_str()),
    ];
    let write = |name: &str, agent: &str, epoch: i64, signer: Option<&Signer>| {
        let (cap, blobs) = sample_capsule(agent, "origin", epoch);
        let dir = t.0.join(name);
        cap.write_dir(&dir, &blobs, signer).unwrap();
        dir.to_str().unwrap().to_string()
    };
    let audit = || async {
        sqlx::query_as::<_, (Option<String>, serde_json::Value)>(
            "SELECT reason, data FROM audit_log WHERE action = 'capsule.import' ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    let agent = |id: &'static str| {
        let pool = pool.clone();
        async move { agents::get(&pool, &AgentId::parse(id).unwrap()).await.unwrap() }
    };

    // Unsigned, or signed by a key nobody trusts: refused, nothing stored.
    let unsigned = write("unsigned", "agent-n", 1, None);
    let forged = write("forged", "agent-n", 1, Some(&forger));
    for dir in [&unsigned, &forged] {
        assert_eq!(admin(&["import", dir], &env).0, 1, "{dir}");
    }
    assert!(agent("agent-n").await.is_none());
    assert!(audit().await.is_empty());
    // The operator may bring an unsigned new agent in, on the record.
    assert_eq!(admin(&["import", &unsigned, "--allow-unsigned"], &env), (0, "imported agent-n at epoch 1\n".into()));
    let entries = audit().await;
    assert_eq!(entries.len(), 1);
    assert!(entries[0].0.as_deref().unwrap().contains("--allow-unsigned"), "{entries:?}");
    assert_eq!(entries[0].1["trusted_signature"], false);

    // Replacing the stored agent: a forged or unsigned capsule never does, flag or not.
    let forged_newer = write("forged-newer", "agent-n", 2, Some(&forger));
    let unsigned_newer = write("unsigned-newer", "agent-n", 2, None);
    for dir in [&forged_newer, &unsigned_newer] {
        assert_eq!(admin(&["import", dir, "--allow-unsigned"], &env).0, 1, "{dir}");
        assert_eq!(admin(&["import", dir], &env).0, 1, "{dir}");
    }
    assert_eq!(agent("agent-n").await.unwrap().epoch, 1);
    assert_eq!(audit().await.len(), 1, "nothing refused is on record as imported");
    // A capsule whose signature was moved onto another manifest does not verify at all.
    let moved = write("moved", "agent-n", 3, None);
    std::fs::copy(Path::new(&forged_newer).join("manifest.sig"), Path::new(&moved).join("manifest.sig")).unwrap();
    assert_eq!(admin(&["import", &moved, "--allow-unsigned"], &env).0, 1);
    // The trusted key's capsule does.
    let signed_newer = write("signed-newer", "agent-n", 2, Some(&trusted));
    assert_eq!(admin(&["import", &signed_newer], &env), (0, "imported agent-n at epoch 2\n".into()));
    let entries = audit().await;
    assert_eq!((entries.len(), entries[1].0.as_deref()), (2, None));
    assert_eq!(entries[1].1["trusted_signature"], true);
    assert_eq!(agent("agent-n").await.unwrap().epoch, 2);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn literal_credentials_are_refused_at_import_and_export(pool: PgPool) {
    let t = temp();
    let (mut cap, blobs) = sample_capsule("agent-k", "origin", 1);
    // A spec with a literal credential, written around the writer's own refusal.
    let spec = EnvSpec {
        tier: Some("light".into()),
        env: [("API_KEY".to_string(), "sk-live-123".to_string())].into(),
        ..EnvSpec::default()
    };
    assert!(spec.to_bytes().is_err(), "the writer refuses it");
    cap.set_file("environment/spec.json", serde_json::to_vec_pretty(&spec).unwrap());
    assert!(cap.write_dir(&t.0.join("x"), &blobs, None).is_err(), "export refuses it");
    // Hand-made on disk (as another tool might), it verifies (integrity) but does not import.
    let dir = t.0.join("hand");
    let (good, blobs) = sample_capsule("agent-k", "origin", 1);
    good.write_dir(&dir, &blobs, None).unwrap();
    std::fs::write(dir.join("environment/spec.json"), &cap.files["environment/spec.json"]).unwrap();
    let mut m = good.manifest.clone();
    m.files.insert("environment/spec.json".into(), cap.manifest.files["environment/spec.json"].clone());
    std::fs::write(dir.join("manifest.json"), m.to_bytes()).unwrap();
    assert_eq!(admin(&["verify", dir.to_str().unwrap()], &[]), (0, "ok\n".into()));
    let store = airlock_capsule::archive::DirArchive::new(t.0.join("store"));
    let trust = airlock_admin::capsule::Trust { trusted_keys: &[], allow_unsigned: true };
    let err = airlock_admin::capsule::import(&pool, &store, &dir, "test", &trust).await.unwrap_err();
    assert!(err.to_string().contains("API_KEY"), "{err}");
    assert!(agents::get(&pool, &AgentId::parse("agent-k").unwrap()).await.unwrap().is_none());
}
