//! An agent's durable context, as the files a sandbox mounts read-only.
//!
//! The context stays in Postgres (and, with capsules, in the blob store); a task refers to
//! it by agent id, and each run gets a fresh read-only copy under `AIRLOCK_CONTEXT_DIR`:
//! `<agent>/runs.json` (the agent's newest runs with their inputs) and `index.json`
//! (agent id → directory). Whatever a run does to its copy, the durable context is not
//! touched. Which agents' context a task may read is the agent's scope, checked by
//! selection.

use sqlx::PgExecutor;

use super::provider::ContextFile;
use super::store;

/// Runs of each agent put in its context.
const RUNS_PER_AGENT: i64 = 100;

/// A directory name for an agent id: unreserved characters kept, the rest percent-encoded
/// (so no id can name `..` or a path).
pub fn dir_name(agent: &str) -> String {
    let mut out = String::new();
    for (i, b) in agent.bytes().enumerate() {
        let keep = b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0);
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The context files of the given agents.
pub async fn load<'c, E>(db: E, agents: &[String]) -> Result<Vec<ContextFile>, sqlx::Error>
where
    E: PgExecutor<'c> + Copy,
{
    let mut files = Vec::new();
    let mut index = serde_json::Map::new();
    for agent in agents {
        let dir = dir_name(agent);
        let runs = store::agent_runs_for_context(db, agent, RUNS_PER_AGENT).await?;
        let body = serde_json::to_vec_pretty(&runs).unwrap_or_default();
        files.push(ContextFile { path: format!("{dir}/runs.json"), bytes: body });
        index.insert(agent.clone(), serde_json::Value::String(dir));
    }
    if !agents.is_empty() {
        let body = serde_json::to_vec_pretty(&serde_json::Value::Object(index)).unwrap_or_default();
        files.push(ContextFile { path: "index.json".into(), bytes: body });
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_are_safe() {
        assert_eq!(dir_name("agent-1"), "agent-1");
        assert_eq!(dir_name("../x"), "%2E.%2Fx");
        assert_eq!(dir_name("a/b c"), "a%2Fb%20c");
        assert_eq!(dir_name(".."), "%2E.");
    }
}
