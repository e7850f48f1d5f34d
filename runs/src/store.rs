//! SQL of `runs`. Every read names the agent that owns the run.

use airlock_core::ids::RunId;
use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};

use crate::state::RunState;

#[derive(Debug, Clone, FromRow)]
pub struct Run {
    pub id: RunId,
    pub agent: String,
    pub inputs: serde_json::Value,
    pub state: RunState,
    pub max_steps: i64,
    pub max_tokens: i64,
    pub max_cost_micros: i64,
    pub used_steps: i64,
    pub used_tokens: i64,
    pub used_cost_micros: i64,
    pub created_at: DateTime<Utc>,
}

/// The limits a run is created with; 0 is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_steps: i64,
    pub max_tokens: i64,
    pub max_cost_micros: i64,
}

/// Creates a run of `agent`.
pub async fn insert(
    db: impl PgExecutor<'_>,
    agent: &str,
    inputs: &serde_json::Value,
    limits: Limits,
) -> Result<Run, sqlx::Error> {
    sqlx::query_as(
        r#"INSERT INTO runs (id, agent, inputs, max_steps, max_tokens, max_cost_micros)
           VALUES ($1, $2, $3, $4, $5, $6)
           RETURNING id, agent, inputs, state, max_steps, max_tokens, max_cost_micros,
                     used_steps, used_tokens, used_cost_micros, created_at"#,
    )
    .bind(RunId::new())
    .bind(agent)
    .bind(inputs)
    .bind(limits.max_steps)
    .bind(limits.max_tokens)
    .bind(limits.max_cost_micros)
    .fetch_one(db)
    .await
}

/// A run, if it exists and belongs to `agent`.
pub async fn get(db: impl PgExecutor<'_>, id: RunId, agent: &str) -> Result<Option<Run>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, agent, inputs, state, max_steps, max_tokens, max_cost_micros,
                  used_steps, used_tokens, used_cost_micros, created_at
           FROM runs WHERE id = $1 AND agent = $2"#,
    )
    .bind(id)
    .bind(agent)
    .fetch_optional(db)
    .await
}
