//! Secrets: a string that must never be printed (credentials, signing keys, tokens), read
//! from the environment variable the configuration names, or from the host's keyring,
//! which lends named secret values to a run or a node.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;

/// Holds a secret value. `Debug` and `Display` print a placeholder, so a secret cannot
/// reach a log line or an error message by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself; call only where it is handed to the party that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Reads a secret from the environment variable the configuration names.
pub fn from_env(var: &str) -> Option<Secret> {
    std::env::var(var).ok().filter(|v| !v.is_empty()).map(Secret)
}

/// Whether a variable name suggests a credential (a literal value under such a name is
/// refused: it must come from a keyring).
pub fn looks_like_credential(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    ["TOKEN", "KEY", "PASSWORD", "PASSWD", "SECRET", "CREDENTIAL"].iter().any(|w| upper.contains(w))
}

/// Where a host keeps secret values. Implementations read on demand and never cache.
pub trait Keyring: Send + Sync {
    fn get(&self, name: &str) -> Option<Secret>;
}

/// The host keyring the configuration names: the file `capsules.keyring_file`, else the
/// variables `capsules.keyring_env_prefix` + NAME.
pub fn host_keyring(cfg: &crate::config::CapsulesConfig) -> std::sync::Arc<dyn Keyring> {
    match &cfg.keyring_file {
        Some(path) => std::sync::Arc::new(FileKeyring { path: path.into() }),
        None => std::sync::Arc::new(EnvKeyring { prefix: cfg.keyring_env_prefix.clone() }),
    }
}

/// Secrets from the process environment, each under `prefix` + its name.
#[derive(Debug, Clone, Default)]
pub struct EnvKeyring {
    pub prefix: String,
}

impl Keyring for EnvKeyring {
    fn get(&self, name: &str) -> Option<Secret> {
        from_env(&format!("{}{name}", self.prefix))
    }
}

/// Secrets from a file of `NAME=value` lines (`#` starts a comment), read at each lookup.
#[derive(Debug, Clone)]
pub struct FileKeyring {
    pub path: PathBuf,
}

impl Keyring for FileKeyring {
    fn get(&self, name: &str) -> Option<Secret> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| k.trim() == name)
            .map(|(_, v)| Secret::new(v.trim()))
    }
}

/// Secrets held in memory (tests, and hosts that load them from elsewhere).
#[derive(Debug, Clone, Default)]
pub struct MapKeyring(pub HashMap<String, Secret>);

impl Keyring for MapKeyring {
    fn get(&self, name: &str) -> Option<Secret> {
        self.0.get(name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_printed() {
        let s = Secret::new("hunter2");
        assert!(!format!("{s:?} {s}").contains("hunter2"));
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn file_keyring() {
        let dir = std::env::temp_dir().join(format!("airlock-ring-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ring");
        std::fs::write(&path, "# host secrets\nGITHUB_TOKEN = abc\nOTHER=x\n").unwrap();
        let ring = FileKeyring { path };
        assert_eq!(ring.get("GITHUB_TOKEN").unwrap().expose(), "abc");
        assert!(ring.get("MISSING").is_none());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
