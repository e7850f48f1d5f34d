//! `environment/spec.json`: how to rebuild an agent's sandbox, with secret *names* only.
//!
//! A spec lists an image or a tier, packages, literal variables and the names of secrets.
//! A literal variable whose name contains `TOKEN` or `KEY` is refused (at import and at
//! export), since a literal there is almost always a leaked credential. Secret values come
//! from the host's keyring ([`airlock_core::secret::Keyring`]) into a [`ResolvedEnv`] that lives for one run and is never
//! serialized: nothing resolved is ever written back into a capsule.

use std::collections::BTreeMap;
#[cfg(test)]
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

#[cfg(test)]
use airlock_core::secret::MapKeyring;
use airlock_core::secret::{Keyring, Secret, looks_like_credential};

/// The path of the spec inside a capsule.
pub const PATH: &str = "environment/spec.json";

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EnvSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    #[serde(default)]
    pub packages: Vec<String>,
    /// Literal variables (never credentials).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Names of secrets the run needs; values come from the host keyring.
    #[serde(default)]
    pub secrets: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("environment/spec.json is not valid: {0}")]
    Malformed(String),
    #[error(
        "environment/spec.json: `{0}` looks like a credential (its name contains TOKEN or KEY) and has a literal value; list it under `secrets` instead"
    )]
    LiteralSecret(String),
    #[error("environment/spec.json: `{0}` is not a valid variable name")]
    BadName(String),
    #[error("environment/spec.json: `{0}` is both a literal and a secret")]
    Both(String),
    #[error("secret `{0}` is not in this host's keyring")]
    MissingSecret(String),
}

impl EnvSpec {
    /// Parses and validates a spec.
    pub fn parse(bytes: &[u8]) -> Result<Self, EnvError> {
        let spec: EnvSpec = serde_json::from_slice(bytes).map_err(|e| EnvError::Malformed(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Refuses literal credentials, bad names and a name that is both literal and secret.
    pub fn validate(&self) -> Result<(), EnvError> {
        if self.image.is_none() && self.tier.is_none() {
            return Err(EnvError::Malformed("one of `image` or `tier` is required".into()));
        }
        for name in self.env.keys() {
            if !valid_var_name(name) {
                return Err(EnvError::BadName(name.clone()));
            }
            if looks_like_credential(name) {
                return Err(EnvError::LiteralSecret(name.clone()));
            }
        }
        for name in &self.secrets {
            if !valid_var_name(name) {
                return Err(EnvError::BadName(name.clone()));
            }
            if self.env.contains_key(name) {
                return Err(EnvError::Both(name.clone()));
            }
        }
        Ok(())
    }

    /// The bytes of `environment/spec.json`; refuses an invalid spec.
    pub fn to_bytes(&self) -> Result<Vec<u8>, EnvError> {
        self.validate()?;
        let mut v = serde_json::to_vec_pretty(self).map_err(|e| EnvError::Malformed(e.to_string()))?;
        v.push(b'\n');
        Ok(v)
    }
}

fn valid_var_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The variables of one execution (a sandbox task, an agent on a node): literals and resolved secrets. It has no `Serialize` and its
/// `Debug` hides secret values; drop it when the run ends.
pub struct ResolvedEnv {
    literals: Vec<(String, String)>,
    secrets: Vec<(String, Secret)>,
}

impl std::fmt::Debug for ResolvedEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.secrets.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("ResolvedEnv").field("literals", &self.literals).field("secrets", &names).finish()
    }
}

impl ResolvedEnv {
    /// Every variable, for handing to the process of the run.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> {
        self.literals
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(self.secrets.iter().map(|(k, v)| (k.as_str(), v.expose())))
    }
}

/// Resolves a spec against the host keyring for one run. Every named secret must exist.
pub fn resolve(spec: &EnvSpec, keyring: &dyn Keyring) -> Result<ResolvedEnv, EnvError> {
    spec.validate()?;
    let mut secrets = Vec::with_capacity(spec.secrets.len());
    for name in &spec.secrets {
        let value = keyring.get(name).ok_or_else(|| EnvError::MissingSecret(name.clone()))?;
        secrets.push((name.clone(), value));
    }
    Ok(ResolvedEnv { literals: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(), secrets })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> EnvSpec {
        EnvSpec {
            tier: Some("standard".into()),
            packages: vec!["ripgrep".into()],
            env: BTreeMap::from([("LANG".into(), "C.UTF-8".into())]),
            secrets: vec!["GITHUB_TOKEN".into()],
            ..EnvSpec::default()
        }
    }

    #[test]
    fn literal_credentials_are_refused() {
        for name in ["GITHUB_TOKEN", "api_key", "SSH_KEYFILE", "DB_PASSWORD", "client_secret", "AWS_CREDENTIALS"] {
            let mut s = spec();
            s.secrets.clear();
            s.env.insert(name.into(), "literal".into());
            assert_eq!(s.validate(), Err(EnvError::LiteralSecret(name.into())), "{name}");
            assert!(s.to_bytes().is_err());
            let bytes = serde_json::to_vec(&s).unwrap();
            assert!(EnvSpec::parse(&bytes).is_err());
        }
        assert!(spec().validate().is_ok(), "a credential named as a secret is fine");
    }

    #[test]
    fn secrets_resolve_for_a_run_and_never_reach_the_spec() {
        let s = spec();
        let ring = MapKeyring(HashMap::from([("GITHUB_TOKEN".to_string(), Secret::new("ghp_s3cr3t"))]));
        let run = resolve(&s, &ring).unwrap();
        assert!(run.vars().any(|(k, v)| k == "GITHUB_TOKEN" && v == "ghp_s3cr3t"));
        assert!(!format!("{run:?}").contains("ghp_s3cr3t"));
        let written = String::from_utf8(s.to_bytes().unwrap()).unwrap();
        assert!(!written.contains("ghp_s3cr3t"));
        assert_eq!(resolve(&s, &MapKeyring::default()).unwrap_err(), EnvError::MissingSecret("GITHUB_TOKEN".into()));
    }
}
