//! The replay log (`run_steps`): every non-deterministic input of a run, keyed by
//! `(run, step_id)`, numbered by `seq`, append-only.
//!
//! Recording a step spends one step of the run's budget and its usage in the same
//! statement that records it ([`record`]); recording a step that exists returns the
//! recorded one, whatever was sent now, so a resumed process takes the branch the first one
//! took; recording it as another kind is a divergence, never silently accepted.

use airlock_core::ids::RunId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor, PgPool, Postgres, QueryBuilder};

use crate::budget::Usage;
use crate::error::RunError;
use crate::run::{self, not_allowed};
use crate::state::{Action, RunState};

/// What a step records. A caller records the first six; `effect` and `delivery` are
/// written by the effects ledger and the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "run_step_kind", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    ModelOutput,
    ToolResult,
    Clock,
    Random,
    Input,
    Note,
    Effect,
    Delivery,
}

impl StepKind {
    pub const ALL: [StepKind; 8] = [
        StepKind::ModelOutput,
        StepKind::ToolResult,
        StepKind::Clock,
        StepKind::Random,
        StepKind::Input,
        StepKind::Note,
        StepKind::Effect,
        StepKind::Delivery,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::ModelOutput => "model_output",
            StepKind::ToolResult => "tool_result",
            StepKind::Clock => "clock",
            StepKind::Random => "random",
            StepKind::Input => "input",
            StepKind::Note => "note",
            StepKind::Effect => "effect",
            StepKind::Delivery => "delivery",
        }
    }

    /// A kind a caller may record with `POST /v1/runs/{id}/steps`.
    pub fn parse_recordable(s: &str) -> Option<Self> {
        Self::ALL.into_iter().take(6).find(|k| k.as_str() == s)
    }
}

/// One step of the replay log.
#[derive(Debug, Clone, FromRow)]
pub struct Step {
    pub run_id: RunId,
    pub seq: i64,
    pub step_id: String,
    pub kind: StepKind,
    pub data: Value,
    pub usage_tokens: i64,
    pub usage_cost_micros: i64,
    pub epoch: i64,
    pub recorded_at: DateTime<Utc>,
}

/// A step to record.
#[derive(Debug, Clone, Copy)]
pub struct NewStep<'a> {
    pub step_id: &'a str,
    pub kind: StepKind,
    pub data: &'a Value,
    pub usage: Usage,
}

/// What recording a step did.
#[derive(Debug, Clone)]
pub enum Recorded {
    /// Recorded now, with its budget spent.
    New(Step),
    /// Recorded before: the recorded step, unchanged.
    Replayed(Step),
}

/// Checks a step id: 1 to 200 characters, no control characters.
pub fn check_step_id(s: &str) -> Result<(), RunError> {
    if s.is_empty() || s.chars().count() > 200 || s.chars().any(char::is_control) {
        return Err(RunError::Invalid("step_id: must be 1 to 200 characters, without control characters".into()));
    }
    Ok(())
}

/// Pushes `spent AS (…)`: spends one step and `usage` of active run `run_id` (of `agent`,
/// held at `epoch`, when given), if no limit would be passed, and takes the next `seq`
/// when `take_seq`. Yields `(id, seq, epoch)`, or nothing (not found, stale, not active,
/// or over budget: [`run::refusal`] and [`run::exhaust_if_over`] say which). With
/// `unless`, an earlier CTE of the statement: nothing is spent when it yields a row.
pub(crate) fn push_spend(
    qb: &mut QueryBuilder<Postgres>,
    run_id: RunId,
    agent: Option<&str>,
    epoch: Option<i64>,
    usage: Usage,
    take_seq: bool,
    unless: Option<&'static str>,
) {
    qb.push("spent AS (UPDATE runs SET used_steps = used_steps + 1, used_tokens = used_tokens + ");
    qb.push_bind(usage.tokens).push(", used_cost_micros = used_cost_micros + ").push_bind(usage.cost_micros);
    qb.push(if take_seq { ", next_seq = next_seq + 1" } else { "" });
    qb.push(", updated_at = now() WHERE id = ").push_bind(run_id);
    if let Some(agent) = agent {
        qb.push(" AND agent = ").push_bind(agent.to_string());
    }
    if let Some(epoch) = epoch {
        qb.push(" AND epoch = ").push_bind(epoch);
    }
    if let Some(unless) = unless {
        qb.push(" AND NOT EXISTS (SELECT 1 FROM ").push(unless).push(")");
    }
    qb.push(
        " AND state = 'active' AND (max_steps = 0 OR used_steps < max_steps) AND (max_tokens = 0 OR used_tokens + ",
    );
    qb.push_bind(usage.tokens).push(" <= max_tokens) AND (max_cost_micros = 0 OR used_cost_micros + ");
    qb.push_bind(usage.cost_micros).push(" <= max_cost_micros) RETURNING id, ");
    qb.push(if take_seq { "next_seq - 1" } else { "next_seq" }).push(" AS seq, epoch)");
}

/// Pushes `cte AS (INSERT INTO run_steps …)`: the step, from the spend CTE `spent`.
/// Yields the step's columns.
pub(crate) fn push_insert(qb: &mut QueryBuilder<Postgres>, cte: &str, spent: &str, new: &NewStep<'_>) {
    qb.push(cte).push(
        " AS (INSERT INTO run_steps (run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch) SELECT id, seq, ",
    );
    qb.push_bind(new.step_id.to_string()).push(", ").push_bind(new.kind).push(", ").push_bind(new.data.clone());
    qb.push(", ").push_bind(new.usage.tokens).push(", ").push_bind(new.usage.cost_micros);
    qb.push(", epoch FROM ").push(spent).push(" RETURNING ").push(STEP_COLUMNS).push(")");
}

const STEP_COLUMNS: &str = "run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch, recorded_at";

/// Whether `e` is the insert of a step that exists already.
pub(crate) fn is_step_taken(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.constraint()).is_some_and(|c| c == "run_steps_run_step_key")
}

/// Records a step of `agent`'s run held at `epoch`: one statement that spends the budget
/// and inserts the step. A step that exists is returned as it was recorded (or refused as
/// diverged); past a limit nothing is recorded and the run ends `budget_exhausted`.
pub async fn record(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    epoch: i64,
    new: &NewStep<'_>,
) -> Result<Recorded, RunError> {
    check_step_id(new.step_id)?;
    new.usage.check()?;
    // A run whose state changed between the attempt and its diagnosis is tried again.
    for _ in 0..3 {
        let mut qb = QueryBuilder::new("WITH ");
        push_spend(&mut qb, run_id, Some(agent), Some(epoch), new.usage, true, None);
        qb.push(", ");
        push_insert(&mut qb, "step", "spent", new);
        qb.push(" SELECT * FROM step");
        match qb.build_query_as::<Step>().fetch_optional(pool).await {
            Ok(Some(step)) => {
                metrics::counter!(airlock_core::metrics::RUN_STEPS, "kind" => step.kind.as_str()).increment(1);
                return Ok(Recorded::New(step));
            }
            Ok(None) => {}
            Err(e) if is_step_taken(&e) => {}
            Err(e) => return Err(e.into()),
        }
        if let Some(answer) = why_not(pool, run_id, agent, epoch, new).await? {
            return answer;
        }
    }
    Err(RunError::InvalidTransition("the run kept changing while the step was recorded; try again".into()))
}

/// Why a step was not recorded, in the order a write is judged: whose run, the epoch, the
/// step recorded before, the run's state, the budget. `None`: nothing stands in the way
/// now (the run changed meanwhile).
async fn why_not(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    epoch: i64,
    new: &NewStep<'_>,
) -> Result<Option<Result<Recorded, RunError>>, RunError> {
    let Some(run) = run::get(pool, run_id, agent).await? else {
        return Ok(Some(Err(RunError::NotFound("run"))));
    };
    if run.epoch != epoch {
        return Ok(Some(Err(RunError::StaleEpoch { held: run.epoch, given: epoch })));
    }
    if let Some(existing) = get(pool, run_id, new.step_id).await? {
        if existing.kind != new.kind {
            return Ok(Some(Err(RunError::Diverged {
                step_id: existing.step_id,
                recorded: existing.kind.as_str().into(),
                given: new.kind.as_str().into(),
            })));
        }
        return Ok(Some(Ok(Recorded::Replayed(existing))));
    }
    if run.state != RunState::Active {
        return Ok(Some(Err(not_allowed(run.state, Action::Exhaust))));
    }
    if let Some(limit) = run::exhaust_if_over(pool, run_id, new.usage).await? {
        return Ok(Some(Err(RunError::BudgetExhausted { limit })));
    }
    Ok(None)
}

/// One step of a run.
pub async fn get(db: impl PgExecutor<'_>, run_id: RunId, step_id: &str) -> Result<Option<Step>, sqlx::Error> {
    sqlx::query_as(
        "SELECT run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch, recorded_at
         FROM run_steps WHERE run_id = $1 AND step_id = $2",
    )
    .bind(run_id)
    .bind(step_id)
    .fetch_optional(db)
    .await
}

/// The replay log in order, after `after_seq`.
pub async fn list(
    db: impl PgExecutor<'_>,
    run_id: RunId,
    after_seq: i64,
    limit: i64,
) -> Result<Vec<Step>, sqlx::Error> {
    sqlx::query_as(
        "SELECT run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch, recorded_at
         FROM run_steps WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
    )
    .bind(run_id)
    .bind(after_seq)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// The steps of a run whose id starts with `prefix`, in order (a turn's steps are named
/// under its own step id).
pub async fn list_under(db: impl PgExecutor<'_>, run_id: RunId, prefix: &str) -> Result<Vec<Step>, sqlx::Error> {
    sqlx::query_as(
        "SELECT run_id, seq, step_id, kind, data, usage_tokens, usage_cost_micros, epoch, recorded_at
         FROM run_steps WHERE run_id = $1 AND starts_with(step_id, $2) ORDER BY seq",
    )
    .bind(run_id)
    .bind(prefix)
    .fetch_all(db)
    .await
}
