//! Agent turns (`agent.*`: the most a turn may ask for) and the HTTP tools an operator
//! declares for them (`tools.<id>.*`).

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// The ceilings of a turn's limits; a turn asks within them (0 takes the ceiling).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// Model answers a turn may ask for (a repair request counts as a round).
    pub max_rounds: u32,
    /// Tool calls a turn may make.
    pub max_tool_calls: u32,
    /// The most bytes of context sent to the model in one request.
    pub max_context_bytes: usize,
    /// The most bytes of one tool result handed to the model (cut beyond, and said so).
    pub max_result_bytes: usize,
    /// How long `sandbox.run` waits for its task to end.
    pub sandbox_wait_seconds: u64,
    /// How long a declared HTTP tool may take.
    pub tool_timeout_seconds: u64,
    /// The most bytes of the agent's earlier turns (whole turns, the newest first) read
    /// from its journal for a turn's context (an agent with a capsule) and for
    /// `journal.search`: what a turn reads does not grow with the agent's history.
    pub journal_read_bytes: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            max_rounds: 12,
            max_tool_calls: 16,
            max_context_bytes: 96 * 1024,
            max_result_bytes: 16 * 1024,
            sandbox_wait_seconds: 300,
            tool_timeout_seconds: 30,
            journal_read_bytes: 256 * 1024,
        }
    }
}

/// What repeating a declared tool's call would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolEffect {
    /// No effect outside: run whenever asked.
    Pure,
    /// Safe to repeat with the same `Idempotency-Key`.
    Idempotent,
    /// Runs only once a human granted the exact call.
    NonRepeatable,
}

/// One declared HTTP tool (`tools.<id>`): called as `POST <url>` of the arguments, with an
/// `Idempotency-Key` and the webhook signature headers; its 2xx JSON body is the result.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// `https://host[:port]/path` of an allowed webhook origin (`delivery.webhook_origins`).
    pub url: String,
    pub effect: ToolEffect,
    /// What the tool does, for the model.
    pub description: String,
    /// A closed JSON schema of the arguments (`"type": "object"`,
    /// `"additionalProperties": false`): a TOML table, or one JSON string.
    #[serde(deserialize_with = "json_or_table")]
    pub schema: Value,
}

fn json_or_table<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::String(s) => serde_json::from_str(&s).map_err(|e| serde::de::Error::custom(format!("not JSON: {e}"))),
        other => Ok(other),
    }
}

impl AgentConfig {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_rounds == 0 || self.max_rounds > 200 {
            return Err("agent.max_rounds: between 1 and 200".into());
        }
        if self.max_tool_calls > 1000 {
            return Err("agent.max_tool_calls: at most 1000".into());
        }
        if !(1024..=16 * 1024 * 1024).contains(&self.max_context_bytes) {
            return Err("agent.max_context_bytes: between 1024 and 16777216".into());
        }
        if !(256..=4 * 1024 * 1024).contains(&self.max_result_bytes) {
            return Err("agent.max_result_bytes: between 256 and 4194304".into());
        }
        if !(self.max_context_bytes..=256 * 1024 * 1024).contains(&self.journal_read_bytes) {
            return Err("agent.journal_read_bytes: between agent.max_context_bytes and 268435456".into());
        }
        if self.sandbox_wait_seconds == 0 || self.tool_timeout_seconds == 0 {
            return Err("agent.sandbox_wait_seconds and agent.tool_timeout_seconds: positive".into());
        }
        Ok(())
    }
}

/// Tool ids: lowercase words joined by `.`, `_` or `-`, never in airlock's namespaces.
pub fn check_tool_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
        && id.bytes().next().is_some_and(|b| b.is_ascii_lowercase());
    if !ok {
        return Err(format!("`tools.{id}`: a tool id is 1 to 64 of a-z, 0-9, `.`, `_`, `-`, starting with a letter"));
    }
    const BUILT_IN: &[&str] = &["delivery.email", "delivery.webhook", "memory.read", "journal.search", "sandbox.run"];
    if BUILT_IN.contains(&id) || ["airlock.", "admin.", "delivery.", "authorization"].iter().any(|p| id.starts_with(p))
    {
        return Err(format!("`tools.{id}`: the name is reserved"));
    }
    Ok(())
}

/// A closed object schema: `"type": "object"` with `"additionalProperties": false`.
pub fn check_closed_schema(id: &str, schema: &Value) -> Result<(), String> {
    let closed = schema.get("type").and_then(Value::as_str) == Some("object")
        && schema.get("additionalProperties") == Some(&Value::Bool(false));
    if closed {
        Ok(())
    } else {
        Err(format!(
            "`tools.{id}.schema`: a closed object schema (\"type\": \"object\", \"additionalProperties\": false)"
        ))
    }
}
