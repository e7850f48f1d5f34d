//! What an agent asks for, parsed: a [`TaskRequest`] that exists is well formed.
//!
//! Checked here, before any transaction (so bad input leaves no rows): the command's shape
//! and size, the mode, that a requested tier exists, the effect class, variable names
//! (none that steers how programs load or are found: `LD_*`, `PATH`, `BASH_ENV`, …, see
//! [`is_loader_variable`]),
//! that no variable named like a credential carries a literal value (credentials come from
//! the keyring by name), and the size of every field. Whether the agent *may* have the
//! tier, the context or the secrets is not input validation: the `sandbox.select` job
//! decides that and logs it as a decision.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::state::{Mode, Size};
use airlock_core::config::sandbox::{SandboxConfig, is_loader_variable, valid_env_name};
use airlock_core::secret::looks_like_credential;
use airlock_queue::EffectClass;

/// The JSON body of `POST /v1/tasks`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskBody {
    pub command: Vec<String>,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub requested_tier: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
    /// `pure` (default) or `idempotent`.
    #[serde(default)]
    pub effect: Option<String>,
    /// A label for the platform's rules and history (`build`, `test`, …).
    #[serde(default)]
    pub kind: Option<String>,
    /// `small`, `medium` or `large`: a hint for the platform's rules.
    #[serde(default)]
    pub size: Option<String>,
    /// Literal variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Keyring names, delivered as variables of the same name.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Agents whose durable context is mounted read-only (the caller's own by default
    /// when listed; others need a scope).
    #[serde(default)]
    pub context: Vec<String>,
}

/// A parsed, well-formed request.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRequest {
    pub command: Vec<String>,
    pub mode: Mode,
    pub requested_tier: Option<String>,
    pub reason: Option<String>,
    pub effect: EffectClass,
    pub kind: Option<String>,
    pub size: Option<Size>,
    pub env: BTreeMap<String, String>,
    pub secrets: Vec<String>,
    pub context: Vec<String>,
}

/// The mode when a request names none: the agent proposes, the platform keeps the bounds.
pub const DEFAULT_MODE: Mode = Mode::Hybrid;

const MAX_ARGS: usize = 256;
const MAX_COMMAND_BYTES: usize = 64 * 1024;
const MAX_ENV: usize = 64;
const MAX_ENV_BYTES: usize = 64 * 1024;

impl TaskRequest {
    /// Parses a body against the configured tiers. The error is a message for a 400.
    pub fn parse(b: TaskBody, cfg: &SandboxConfig) -> Result<Self, String> {
        if b.command.is_empty() || b.command.len() > MAX_ARGS {
            return Err(format!("command: 1 to {MAX_ARGS} arguments"));
        }
        if b.command[0].trim().is_empty() {
            return Err("command: the program (first element) must not be empty".to_string());
        }
        if b.command.iter().any(|a| a.contains('\0')) {
            return Err("command: arguments must not contain NUL".to_string());
        }
        if b.command.iter().map(String::len).sum::<usize>() > MAX_COMMAND_BYTES {
            return Err(format!("command: at most {MAX_COMMAND_BYTES} bytes in all"));
        }
        let mode = match b.mode.as_deref() {
            None => DEFAULT_MODE,
            Some(m) => Mode::parse(m)
                .ok_or_else(|| "mode: must be \"agent\", \"platform\", \"human\" or \"hybrid\"".to_string())?,
        };
        let requested_tier = match b.requested_tier {
            None => None,
            Some(t) if cfg.tiers.get(&t).is_some() => Some(t),
            Some(t) => {
                return Err(format!(
                    "requested_tier: unknown tier `{}` (tiers: {})",
                    t.chars().take(64).collect::<String>(),
                    cfg.tiers.names().join(", ")
                ));
            }
        };
        let reason = optional_text(b.reason, "reason", 2000)?;
        let effect = match b.effect.as_deref() {
            None | Some("pure") => EffectClass::Pure,
            Some("idempotent") => EffectClass::Idempotent,
            Some("non_repeatable") => {
                return Err("effect: a sandboxed task is run again after a lost worker, so it must be \"pure\" or \
                            \"idempotent\"; effects that must not repeat go through deliveries"
                    .to_string());
            }
            Some(_) => return Err("effect: must be \"pure\" or \"idempotent\"".to_string()),
        };
        let kind = optional_text(b.kind, "kind", 100)?;
        if kind.as_deref().is_some_and(|k| k.chars().any(char::is_control)) {
            return Err("kind: no control characters".to_string());
        }
        let size = match b.size.as_deref() {
            None => None,
            Some(s) => {
                Some(Size::parse(s).ok_or_else(|| "size: must be \"small\", \"medium\" or \"large\"".to_string())?)
            }
        };
        if b.env.len() > MAX_ENV {
            return Err(format!("env: at most {MAX_ENV} variables"));
        }
        let mut env_bytes = 0;
        for (k, v) in &b.env {
            check_var_name(k, "env")?;
            if looks_like_credential(k) {
                return Err(format!(
                    "env.{k}: a variable named like a credential cannot carry a literal value; list it in `secrets`"
                ));
            }
            if v.contains('\0') {
                return Err(format!("env.{k}: must not contain NUL"));
            }
            env_bytes += k.len() + v.len();
        }
        if env_bytes > MAX_ENV_BYTES {
            return Err(format!("env: at most {MAX_ENV_BYTES} bytes in all"));
        }
        let secrets = dedup(b.secrets);
        if secrets.len() > MAX_ENV {
            return Err(format!("secrets: at most {MAX_ENV} names"));
        }
        for s in &secrets {
            check_var_name(s, "secrets")?;
            if b.env.contains_key(s) {
                return Err(format!("secrets: `{s}` is also a literal in env"));
            }
        }
        let context = dedup(b.context);
        if context.len() > 16 {
            return Err("context: at most 16 agents".to_string());
        }
        if context.iter().any(|a| a.trim().is_empty() || a.len() > 200) {
            return Err("context: agent ids of 1 to 200 characters".to_string());
        }
        Ok(Self { command: b.command, mode, requested_tier, reason, effect, kind, size, env: b.env, secrets, context })
    }

    /// What "a similar task" means for the platform's history: the kind, else the program.
    pub fn similarity(&self) -> String {
        match &self.kind {
            Some(k) => format!("kind:{k}"),
            None => {
                let program = self.command[0].rsplit('/').next().unwrap_or_default();
                format!("program:{}", program.chars().take(200).collect::<String>())
            }
        }
    }
}

fn check_var_name(k: &str, field: &str) -> Result<(), String> {
    if !valid_env_name(k) {
        return Err(format!("{field}: `{}` is not a variable name", k.chars().take(64).collect::<String>()));
    }
    if k.starts_with("AIRLOCK_") {
        return Err(format!("{field}: names starting with AIRLOCK_ are set by the platform"));
    }
    if is_loader_variable(k) {
        return Err(format!(
            "{field}: `{k}` steers how programs are loaded or found (loader, shell and runtime search paths and \
             start-up files); the platform sets PATH and a task cannot set the others"
        ));
    }
    Ok(())
}

fn optional_text(v: Option<String>, field: &str, max: usize) -> Result<Option<String>, String> {
    match v.map(|s| s.trim().to_string()) {
        Some(s) if s.chars().count() > max => Err(format!("{field}: at most {max} characters")),
        Some(s) if s.is_empty() => Ok(None),
        other => Ok(other),
    }
}

fn dedup(mut v: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    v.retain(|s| seen.insert(s.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: serde_json::Value) -> TaskBody {
        serde_json::from_value(v).unwrap()
    }

    fn parse(v: serde_json::Value) -> Result<TaskRequest, String> {
        TaskRequest::parse(body(v), &SandboxConfig::default())
    }

    #[test]
    fn defaults() {
        let r = parse(serde_json::json!({"command": ["echo", "hi"]})).unwrap();
        assert_eq!(r.mode, Mode::Hybrid);
        assert_eq!(r.effect, EffectClass::Pure);
        assert_eq!(r.requested_tier, None);
        assert_eq!(r.similarity(), "program:echo");
        let r = parse(serde_json::json!({"command": ["/usr/bin/make"], "kind": "build"})).unwrap();
        assert_eq!(r.similarity(), "kind:build");
    }

    #[test]
    fn refusals() {
        let e = |v| parse(v).unwrap_err();
        assert!(e(serde_json::json!({"command": []})).starts_with("command"));
        assert!(e(serde_json::json!({"command": [""]})).starts_with("command"));
        assert!(e(serde_json::json!({"command": ["x"], "mode": "boss"})).starts_with("mode"));
        assert!(e(serde_json::json!({"command": ["x"], "requested_tier": "huge"})).starts_with("requested_tier"));
        assert!(e(serde_json::json!({"command": ["x"], "effect": "non_repeatable"})).starts_with("effect"));
        assert!(e(serde_json::json!({"command": ["x"], "env": {"API_TOKEN": "abc"}})).starts_with("env.API_TOKEN"));
        assert!(e(serde_json::json!({"command": ["x"], "env": {"1X": "abc"}})).starts_with("env"));
        assert!(e(serde_json::json!({"command": ["x"], "env": {"AIRLOCK_TIER": "x"}})).starts_with("env"));
        assert!(e(serde_json::json!({"command": ["x"], "secrets": ["A B"]})).starts_with("secrets"));
        for loader in ["LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "BASH_ENV", "ENV", "IFS", "PYTHONPATH"] {
            assert!(e(serde_json::json!({"command": ["x"], "env": {loader: "/tmp/x"}})).starts_with("env"), "{loader}");
            assert!(e(serde_json::json!({"command": ["x"], "secrets": [loader]})).starts_with("secrets"), "{loader}");
        }
        assert!(e(serde_json::json!({"command": ["x"], "size": "huge"})).starts_with("size"));
        assert!(serde_json::from_value::<TaskBody>(serde_json::json!({"command": ["x"], "extra": 1})).is_err());
    }
}
