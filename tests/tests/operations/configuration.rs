//! The configuration reference (`docs/configuration.md`) against the code: every key the
//! configuration accepts must be documented, and the example file must load.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use airlock_core::config::Config;

/// Loads a TOML snippet; returns the error text, if any.
fn load(toml: &str) -> Option<String> {
    let path = std::env::temp_dir().join(format!("airlock-config-probe-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(&path, toml).unwrap();
    let r = Config::from_sources(Some(path.to_str().unwrap()), &[("DATABASE_URL".into(), "postgres://x/y".into())]);
    std::fs::remove_file(&path).unwrap();
    r.err().map(|e| e.to_string())
}

/// The field names serde expects at `section`, read from its "unknown field" error.
fn fields_at(section: &str) -> Option<Vec<String>> {
    let toml = if section.is_empty() { "__probe__ = 1\n".to_string() } else { format!("[{section}]\n__probe__ = 1\n") };
    let err = load(&toml)?;
    let rest = err.split("unknown field `__probe__`, expected ").nth(1)?;
    let list = rest.split(" for key").next().unwrap_or(rest);
    Some(list.split('`').skip(1).step_by(2).map(str::to_string).collect())
}

/// Every key path the configuration accepts; map levels appear as `*`.
fn keys(section: &str, out: &mut BTreeSet<String>, depth: usize) {
    let Some(fields) = fields_at(section) else { return };
    for f in fields {
        let path = if section.is_empty() { f.clone() } else { format!("{section}.{f}") };
        if depth < 4 && fields_at(&path).is_some() {
            keys(&path, out, depth + 1);
        } else if depth < 4 && fields_at(&format!("{path}.probe_entry")).is_some() {
            // A map: its entries are structs.
            keys(&format!("{path}.probe_entry"), out, depth + 1);
        } else {
            out.insert(path.replace(".probe_entry", ".*"));
        }
    }
}

fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md")).unwrap();
    let mut out = BTreeSet::new();
    for line in doc.lines().filter(|l| l.starts_with("| `")) {
        let key = line.split('`').nth(1).unwrap();
        let normalized: Vec<String> =
            key.split('.').map(|seg| if seg.starts_with('<') { "*".to_string() } else { seg.to_string() }).collect();
        out.insert(normalized.join("."));
    }
    out
}

#[test]
fn every_configuration_key_is_documented() {
    let mut code = BTreeSet::new();
    keys("", &mut code, 0);
    assert!(code.contains("database.url") && code.contains("worker.concurrency"), "{code:?}");
    let doc = documented();
    let missing: Vec<&String> = code.difference(&doc).collect();
    assert!(missing.is_empty(), "keys in the code but not in docs/configuration.md: {missing:?}");
    let stale: Vec<&String> = doc.difference(&code).collect();
    assert!(stale.is_empty(), "keys documented but unknown to the code: {stale:?}");
}

#[test]
fn the_example_configuration_loads() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../airlock.example.toml");
    let cfg = Config::from_sources(Some(path), &[]);
    assert!(cfg.is_ok(), "{:?}", cfg.err());
}
