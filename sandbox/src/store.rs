//! SQL for sandboxed tasks, their decisions and their runs.
//!
//! Every state change goes through [`transition`]: a guarded `UPDATE … WHERE state =
//! expected` whose target comes from [`super::state::next`]. A decision's outcome is
//! written once ([`record_outcome`] is guarded on `outcome_at IS NULL`, and a trigger
//! refuses any other change to a decision). Functions take an executor so the caller
//! decides the transaction.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor};
use uuid::Uuid;

use super::SandboxError;
use super::provider::RunOutcome;
use super::spec::TaskRequest;
use super::state::{Mode, TaskState, Transition, Verdict, next};
use crate::selection::Sample;
use airlock_core::config::sandbox::Tier;
use airlock_queue::{EffectClass, Lease};

/// A task row.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Task {
    pub id: Uuid,
    pub agent: String,
    pub principal_id: Uuid,
    pub command: Vec<String>,
    pub env: Json<BTreeMap<String, String>>,
    pub secrets: Vec<String>,
    pub context: Vec<String>,
    pub kind: Option<String>,
    pub size: Option<String>,
    pub similarity: String,
    pub mode: Mode,
    pub requested_tier: Option<String>,
    pub reason: Option<String>,
    pub effect: EffectClass,
    pub state: TaskState,
    pub tier: Option<String>,
    pub run_count: i32,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// A decision row, with its outcome once the run that used it ended.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Decision {
    pub id: Uuid,
    pub task_id: Uuid,
    pub mode: Mode,
    pub verdict: Verdict,
    pub requested_tier: Option<String>,
    pub chosen_tier: Option<String>,
    pub tier_spec: Option<Json<Tier>>,
    pub chooser: String,
    pub reason: String,
    pub decided_at: DateTime<Utc>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub duration_ms: Option<i64>,
    pub peak_rss_kib: Option<i64>,
    pub output_bytes: Option<i64>,
    pub timed_out: Option<bool>,
    pub killed_for: Option<String>,
    pub limits: Option<Vec<String>>,
    pub outcome_at: Option<DateTime<Utc>>,
}

/// A decision with the task facts a reviewer wants beside it.
#[derive(Debug, Clone, FromRow)]
pub struct DecisionRow {
    #[sqlx(flatten)]
    pub decision: Decision,
    pub agent: String,
    pub task_state: TaskState,
    pub kind: Option<String>,
    pub similarity: String,
}

/// One start of a run.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Run {
    pub id: i64,
    pub task_id: Uuid,
    pub decision_id: Uuid,
    pub job_id: Uuid,
    pub job_attempt: i32,
    pub worker: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    pub result: Option<String>,
}

/// Inserts a new task in `selecting`. With an idempotency key that a task holds already,
/// nothing is inserted (`None`).
pub async fn insert_task(
    db: impl PgExecutor<'_>,
    agent: &str,
    principal_id: Uuid,
    r: &TaskRequest,
    idempotency_key: Option<&str>,
) -> Result<Option<Task>, sqlx::Error> {
    sqlx::query_as(
        r#"INSERT INTO sandbox_tasks (id, agent, principal_id, command, env, secrets, context, kind, size,
                                      similarity, mode, requested_tier, reason, effect, idempotency_key)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
           ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
           RETURNING *"#,
    )
    .bind(Uuid::now_v7())
    .bind(agent)
    .bind(principal_id)
    .bind(&r.command)
    .bind(Json(&r.env))
    .bind(&r.secrets)
    .bind(&r.context)
    .bind(&r.kind)
    .bind(r.size.map(|s| s.as_str()))
    .bind(r.similarity())
    .bind(r.mode)
    .bind(&r.requested_tier)
    .bind(&r.reason)
    .bind(r.effect)
    .bind(idempotency_key)
    .fetch_optional(db)
    .await
}

/// The task of an idempotency key.
pub async fn task_by_key(db: impl PgExecutor<'_>, key: &str) -> Result<Option<Task>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM sandbox_tasks WHERE idempotency_key = $1").bind(key).fetch_optional(db).await
}

pub async fn get_task(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<Task>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM sandbox_tasks WHERE id = $1").bind(id).fetch_optional(db).await
}

/// Reads a task and locks its row until the transaction ends.
pub async fn lock_task(db: impl PgExecutor<'_>, id: Uuid) -> Result<Task, SandboxError> {
    sqlx::query_as("SELECT * FROM sandbox_tasks WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(SandboxError::NotFound("task"))
}

/// What a transition writes besides the state.
#[derive(Debug, Clone, Default)]
pub struct Change<'a> {
    /// The chosen tier (on `Choose`).
    pub tier: Option<&'a str>,
    /// Counts a start (on `Start`).
    pub count_run: bool,
    pub stdout: Option<&'a str>,
    pub stderr: Option<&'a str>,
    pub error: Option<&'a str>,
}

/// Moves a task by `t` from the state it was read in. Refuses an illegal move, and a task
/// that changed since it was read.
#[tracing::instrument(skip_all, fields(task.id = %task.id, from = task.state.as_str()))]
pub async fn transition(
    db: impl PgExecutor<'_>,
    task: &Task,
    t: Transition,
    change: Change<'_>,
) -> Result<Task, SandboxError> {
    let to = next(task.state, t)
        .ok_or_else(|| SandboxError::InvalidTransition(format!("a task in state {} cannot take {t:?}", task.state)))?;
    sqlx::query_as(
        r#"UPDATE sandbox_tasks SET
               state = $3, tier = coalesce($4, tier), run_count = run_count + $5,
               stdout = coalesce($6, stdout), stderr = coalesce($7, stderr), error = coalesce($8, error),
               updated_at = now(),
               finished_at = CASE WHEN $3 IN ('succeeded', 'failed', 'timed_out', 'denied') THEN now() END
           WHERE id = $1 AND state = $2
           RETURNING *"#,
    )
    .bind(task.id)
    .bind(task.state)
    .bind(to)
    .bind(change.tier)
    .bind(if change.count_run { 1i32 } else { 0 })
    .bind(change.stdout)
    .bind(change.stderr)
    .bind(change.error)
    .fetch_optional(db)
    .await?
    .ok_or_else(|| SandboxError::InvalidTransition(format!("task {} changed while this was decided", task.id)))
}

/// A decision to store.
#[derive(Debug, Clone)]
pub struct NewDecision<'a> {
    pub task_id: Uuid,
    pub mode: Mode,
    pub verdict: Verdict,
    pub requested_tier: Option<&'a str>,
    pub tier: Option<&'a Tier>,
    pub chooser: &'a str,
    pub reason: &'a str,
}

pub async fn insert_decision(db: impl PgExecutor<'_>, d: &NewDecision<'_>) -> Result<Decision, sqlx::Error> {
    sqlx::query_as(
        r#"INSERT INTO sandbox_decisions (id, task_id, mode, verdict, requested_tier, chosen_tier, tier_spec, chooser, reason)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
           RETURNING *"#,
    )
    .bind(Uuid::now_v7())
    .bind(d.task_id)
    .bind(d.mode)
    .bind(d.verdict)
    .bind(d.requested_tier)
    .bind(d.tier.map(|t| t.name.as_str()))
    .bind(d.tier.map(Json))
    .bind(d.chooser)
    .bind(truncate(d.reason, 4000))
    .fetch_one(db)
    .await
}

/// The task's decisions, oldest first.
pub async fn decisions_of(db: impl PgExecutor<'_>, task_id: Uuid) -> Result<Vec<Decision>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM sandbox_decisions WHERE task_id = $1 ORDER BY decided_at, id")
        .bind(task_id)
        .fetch_all(db)
        .await
}

/// The decision that chose the task's tier.
pub async fn chosen_decision(db: impl PgExecutor<'_>, task_id: Uuid) -> Result<Option<Decision>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM sandbox_decisions WHERE task_id = $1 AND verdict = 'chosen'")
        .bind(task_id)
        .fetch_optional(db)
        .await
}

/// Writes a run's outcome onto the decision that chose its tier, once.
pub async fn record_outcome(db: impl PgExecutor<'_>, decision_id: Uuid, o: &RunOutcome) -> Result<(), SandboxError> {
    let r = sqlx::query(
        r#"UPDATE sandbox_decisions SET exit_code = $2, signal = $3, duration_ms = $4, peak_rss_kib = $5,
               output_bytes = $6, timed_out = $7, killed_for = $8, limits = $9, outcome_at = now()
           WHERE id = $1 AND verdict = 'chosen' AND outcome_at IS NULL"#,
    )
    .bind(decision_id)
    .bind(o.exit_code)
    .bind(o.signal)
    .bind(clamp(o.duration_ms))
    .bind(clamp(o.peak_rss_kib))
    .bind(clamp(o.output_bytes))
    .bind(o.timed_out)
    .bind(o.killed_for.map(|k| k.as_str()))
    .bind(&o.limits)
    .execute(db)
    .await?;
    if r.rows_affected() == 0 {
        return Err(SandboxError::InvalidTransition(format!("decision {decision_id} already has an outcome")));
    }
    Ok(())
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Sandbox minutes of the agent's machine-or-human-chosen decisions in the last 24 hours:
/// the real duration once known, the tier's timeout until then.
pub async fn used_minutes(db: impl PgExecutor<'_>, agent: &str) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT coalesce(sum(CASE WHEN d.outcome_at IS NOT NULL THEN d.duration_ms / 60000.0
                                    ELSE (d.tier_spec ->> 'timeout_seconds')::numeric / 60.0 END), 0)::float8
           FROM sandbox_decisions d JOIN sandbox_tasks t ON t.id = d.task_id
           WHERE t.agent = $1 AND d.verdict = 'chosen' AND d.decided_at > now() - interval '24 hours'"#,
    )
    .bind(agent)
    .fetch_one(db)
    .await
}

/// Outcomes of the agent's similar tasks in the last `days`, newest first.
pub async fn history(
    db: impl PgExecutor<'_>,
    agent: &str,
    similarity: &str,
    days: u32,
    limit: i64,
) -> Result<Vec<Sample>, sqlx::Error> {
    let rows: Vec<(i64, i64, Option<String>, Json<Tier>)> = sqlx::query_as(
        r#"SELECT d.peak_rss_kib, d.duration_ms, d.killed_for, d.tier_spec
           FROM sandbox_decisions d JOIN sandbox_tasks t ON t.id = d.task_id
           WHERE t.agent = $1 AND t.similarity = $2 AND d.outcome_at IS NOT NULL
             AND d.outcome_at > now() - make_interval(days => $3)
           ORDER BY d.outcome_at DESC LIMIT $4"#,
    )
    .bind(agent)
    .bind(similarity)
    .bind(days as i32)
    .bind(limit)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(kib, ms, killed_for, tier)| Sample {
            peak_rss_kib: kib.max(0) as u64,
            duration_ms: ms.max(0) as u64,
            killed_for,
            tier: tier.0,
        })
        .collect())
}

/// Records a start of a run under a job's lease epoch.
pub async fn insert_run(
    db: impl PgExecutor<'_>,
    task_id: Uuid,
    decision_id: Uuid,
    lease: Lease,
    worker: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        r#"INSERT INTO sandbox_runs (task_id, decision_id, job_id, job_attempt, worker)
           VALUES ($1, $2, $3, $4, $5) RETURNING id"#,
    )
    .bind(task_id)
    .bind(decision_id)
    .bind(lease.id())
    .bind(lease.attempt())
    .bind(worker)
    .fetch_one(db)
    .await
}

/// Closes the task's open runs as `lost` (their worker vanished); returns how many.
pub async fn close_lost_runs(db: impl PgExecutor<'_>, task_id: Uuid) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE sandbox_runs SET ended_at = now(), result = 'lost' WHERE task_id = $1 AND ended_at IS NULL",
    )
    .bind(task_id)
    .execute(db)
    .await?;
    Ok(r.rows_affected())
}

/// Closes a run that reached its outcome.
pub async fn close_finished_run(db: impl PgExecutor<'_>, run_id: i64) -> Result<(), SandboxError> {
    let r =
        sqlx::query("UPDATE sandbox_runs SET ended_at = now(), result = 'finished' WHERE id = $1 AND ended_at IS NULL")
            .bind(run_id)
            .execute(db)
            .await?;
    if r.rows_affected() == 0 {
        return Err(SandboxError::InvalidTransition(format!("run {run_id} was already closed")));
    }
    Ok(())
}

pub async fn runs_of(db: impl PgExecutor<'_>, task_id: Uuid) -> Result<Vec<Run>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM sandbox_runs WHERE task_id = $1 ORDER BY id").bind(task_id).fetch_all(db).await
}

/// Decisions newest first, before the cursor id (ids are time-ordered UUIDv7).
pub async fn list_decisions(
    db: impl PgExecutor<'_>,
    before: Option<Uuid>,
    limit: i64,
) -> Result<Vec<DecisionRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT d.*, t.agent, t.state AS task_state, t.kind, t.similarity
           FROM sandbox_decisions d JOIN sandbox_tasks t ON t.id = d.task_id
           WHERE ($1::uuid IS NULL OR d.id < $1)
           ORDER BY d.id DESC LIMIT $2"#,
    )
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Chosen decisions whose outcome was recorded since `since`, oldest first.
pub async fn outcomes_since(db: impl PgExecutor<'_>, since: DateTime<Utc>) -> Result<Vec<DecisionRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT d.*, t.agent, t.state AS task_state, t.kind, t.similarity
           FROM sandbox_decisions d JOIN sandbox_tasks t ON t.id = d.task_id
           WHERE d.outcome_at IS NOT NULL AND d.outcome_at >= $1
           ORDER BY d.outcome_at, d.id"#,
    )
    .bind(since)
    .fetch_all(db)
    .await
}

/// Decisions of every verdict since `since` (escalations and denials count in a review).
pub async fn verdict_counts_since(
    db: impl PgExecutor<'_>,
    since: DateTime<Utc>,
) -> Result<Vec<(Mode, Verdict, i64)>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT mode, verdict, count(*) FROM sandbox_decisions WHERE decided_at >= $1
           GROUP BY mode, verdict ORDER BY mode, verdict"#,
    )
    .bind(since)
    .fetch_all(db)
    .await
}

/// Tasks oldest first, optionally in one state, after a `(created_at, id)` cursor.
pub async fn list_tasks(
    db: impl PgExecutor<'_>,
    state: Option<TaskState>,
    after: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<Task>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT * FROM sandbox_tasks
           WHERE ($1::sandbox_task_state IS NULL OR state = $1)
             AND ($2::timestamptz IS NULL OR (created_at, id) > ($2::timestamptz, $3::uuid))
           ORDER BY created_at, id LIMIT $4"#,
    )
    .bind(state)
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit)
    .fetch_all(db)
    .await
}

/// The newest runs of an agent's durable context: what a task may mount read-only.
pub async fn agent_runs_for_context(
    db: impl PgExecutor<'_>,
    agent: &str,
    limit: i64,
) -> Result<Vec<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT jsonb_build_object('id', id, 'state', state::text, 'inputs', inputs, 'created_at', created_at)
           FROM runs WHERE agent = $1 ORDER BY created_at DESC LIMIT $2"#,
    )
    .bind(agent)
    .bind(limit)
    .fetch_all(db)
    .await
}

fn truncate(s: &str, max_chars: usize) -> &str {
    match s.char_indices().nth(max_chars) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
