//! Sandboxed tasks, for operators: the admin queue of tasks awaiting a choice, the human
//! choice that resumes them, the decision log with outcomes, and the report of outcomes by
//! tier and mode (`GET /admin/v1/sandbox/report` and `airlock-admin sandbox report`).
//!
//! Every choice is audited in the transaction that makes it.

use std::fmt::Write as _;

use airlock_core::config::sandbox::Tiers;
use airlock_core::principals::Role;
use airlock_http::{ApiError, Auth, JsonBody, Page, parse_id};
use airlock_sandbox::report::{self, Report};
use airlock_sandbox::service::{self, Choice};
use airlock_sandbox::state::TaskState;
use airlock_sandbox::{store, view};
use axum::Json;
use axum::extract::{Path, Query, State};
use clap::Subcommand;
use serde::Deserialize;
use serde_json::Value;
use sqlx::PgPool;
use utoipa::{IntoParams, ToSchema};

use crate::server::AppState;
use airlock_http::{decode_cursor, decode_time_cursor, encode_cursor, next_time_cursor, page_limit};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChooseBody {
    /// The tier to run the task in (required unless `deny`).
    tier: Option<String>,
    note: Option<String>,
    /// Refuse the task instead (needs a note).
    #[serde(default)]
    deny: bool,
}

/// The human choice for a task awaiting one (mode `human`, or an escalation): a tier, and
/// the task is queued to run; or `deny`.
#[utoipa::path(post, path = "/admin/v1/tasks/{id}/choose", params(("id" = String, Path, description = "task id")),
    request_body = ChooseBody,
    responses((status = 200, description = "the task"), (status = 400, description = "unknown tier, or no note"),
        (status = 404), (status = 409, description = "the task is not awaiting a choice")))]
pub async fn choose(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ChooseBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Operator)?;
    let id = parse_id(&id)?;
    let choice = match (body.tier, body.deny) {
        (Some(t), false) => Choice::Tier(t),
        (None, true) => Choice::Deny,
        (Some(_), true) => return Err(ApiError::validation("tier: not with deny")),
        (None, false) => return Err(ApiError::validation("tier: required (or deny)")),
    };
    let task = service::choose(&state.pool, &state.config.sandbox, who, id, &choice, body.note.as_deref()).await?;
    Ok(Json(view::task(&state.pool, &task, true).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct TasksQuery {
    /// `awaiting_choice` for the queue of tasks waiting for an operator.
    state: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Tasks, oldest first; `?state=awaiting_choice` is the queue waiting for an operator.
#[utoipa::path(get, path = "/admin/v1/tasks", params(TasksQuery), responses((status = 200, description = "tasks, oldest first")))]
pub async fn list_tasks(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<TasksQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => {
            Some(TaskState::parse(s).ok_or_else(|| ApiError::validation(format!("state: unknown state `{s}`")))?)
        }
    };
    let after = decode_time_cursor(q.cursor.as_deref())?;
    let mut rows = store::list_tasks(&pool, state, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = next_time_cursor(more, rows.last().map(|t| (t.created_at, t.id)));
    Ok(Json(Page { items: rows.iter().map(view::summary).collect(), next }))
}

/// Everything about a task: spec (secret names only), every decision, every run.
#[utoipa::path(get, path = "/admin/v1/tasks/{id}", params(("id" = String, Path, description = "task id")),
    responses((status = 200, description = "the task"), (status = 404)))]
pub async fn get_task(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Operator)?;
    let t = store::get_task(&pool, parse_id(&id)?).await?.ok_or_else(|| ApiError::not_found("task"))?;
    Ok(Json(view::task(&pool, &t, true).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DecisionsQuery {
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Every tier decision, newest first: task, requested and chosen tier, mode, chooser,
/// reason, and the outcome of the run it led to.
#[utoipa::path(get, path = "/admin/v1/sandbox/decisions", params(DecisionsQuery),
    responses((status = 200, description = "decisions with outcomes, newest first")))]
pub async fn list_decisions(
    State(pool): State<PgPool>,
    auth: Auth,
    Query(q): Query<DecisionsQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Operator)?;
    let limit = page_limit(q.limit)?;
    let before = match &q.cursor {
        None => None,
        Some(c) => Some(parse_id(&decode_cursor(c)?)?),
    };
    let mut rows = store::list_decisions(&pool, before, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more { rows.last().map(|r| encode_cursor(&r.decision.id.to_string())) } else { None };
    Ok(Json(Page { items: rows.iter().map(view::decision_row).collect(), next }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ReportQuery {
    /// Outcomes recorded in the last this many hours (default 168).
    since_hours: Option<u32>,
}

/// Outcomes by tier and mode, with over- and under-provisioned runs.
#[utoipa::path(get, path = "/admin/v1/sandbox/report", params(ReportQuery),
    responses((status = 200, description = "the report")))]
pub async fn get_report(
    State(state): State<AppState>,
    auth: Auth,
    Query(q): Query<ReportQuery>,
) -> Result<Json<Report>, ApiError> {
    auth.require(Role::Operator)?;
    let hours = q.since_hours.unwrap_or(DEFAULT_REPORT_HOURS);
    if hours == 0 || hours > MAX_REPORT_HOURS {
        return Err(ApiError::validation(format!("since_hours: between 1 and {MAX_REPORT_HOURS}")));
    }
    Ok(Json(build_report(&state.pool, &state.config.sandbox.tiers, hours).await?))
}

const DEFAULT_REPORT_HOURS: u32 = 168;
/// Ten years: beyond that the window is meaningless (and would overflow the clock).
const MAX_REPORT_HOURS: u32 = 87_600;

async fn build_report(pool: &PgPool, tiers: &Tiers, hours: u32) -> Result<Report, sqlx::Error> {
    let since = chrono::Utc::now() - chrono::Duration::hours(i64::from(hours));
    report::build(pool, tiers, since).await
}

/// `airlock-admin sandbox …`
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Outcomes by tier and mode; over-provisioned (used far less than the tier) and
    /// under-provisioned (stopped by a limit) runs.
    Report {
        /// Outcomes recorded in the last this many hours.
        #[arg(long, default_value_t = DEFAULT_REPORT_HOURS)]
        since_hours: u32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `sandbox` subcommand.
pub async fn run_cli(pool: &PgPool, cfg: &airlock_core::config::Config, cmd: SandboxCommand) -> anyhow::Result<()> {
    match cmd {
        SandboxCommand::Report { since_hours, json } => {
            anyhow::ensure!(
                (1..=MAX_REPORT_HOURS).contains(&since_hours),
                "--since-hours must be between 1 and {MAX_REPORT_HOURS}"
            );
            let r = build_report(pool, &cfg.sandbox.tiers, since_hours).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", render(&r));
            }
            Ok(())
        }
    }
}

/// The report as text.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "sandbox outcomes since {}", r.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    let _ = writeln!(
        s,
        "{:<12} {:<9} {:>5} {:>5} {:>6} {:>9} {:>7} {:>5} {:>6} {:>10} {:>13} {:>10}",
        "tier",
        "mode",
        "runs",
        "ok",
        "failed",
        "timed_out",
        "memory",
        "over",
        "under",
        "avg_ms",
        "max_peak_kib",
        "cost"
    );
    for row in &r.rows {
        let _ = writeln!(
            s,
            "{:<12} {:<9} {:>5} {:>5} {:>6} {:>9} {:>7} {:>5} {:>6} {:>10} {:>13} {:>10.4}",
            row.tier,
            row.mode,
            row.runs,
            row.succeeded,
            row.failed,
            row.timed_out,
            row.killed_for_memory,
            row.over_provisioned,
            row.under_provisioned,
            row.total_duration_ms / row.runs.max(1),
            row.max_peak_rss_kib,
            row.cost
        );
    }
    if !r.decisions.is_empty() {
        let counts: Vec<String> =
            r.decisions.iter().map(|d| format!("{} {}: {}", d.mode.as_str(), d.verdict.as_str(), d.count)).collect();
        let _ = writeln!(s, "decisions: {}", counts.join(", "));
    }
    let line = |s: &mut String, f: &report::Finding, why: String| {
        let _ = writeln!(
            s,
            "  task {} agent {} tier {} ({} MiB, {} s) mode {} chosen by {}: {why} -> {}",
            f.task_id,
            f.agent,
            f.tier,
            f.tier_memory_mb,
            f.tier_timeout_seconds,
            f.mode.as_str(),
            f.chooser,
            f.suggested_tier.as_deref().unwrap_or("no larger tier")
        );
    };
    let _ = writeln!(s, "over-provisioned (used far less than the tier): {}", r.over_provisioned.len());
    for f in &r.over_provisioned {
        line(&mut s, f, format!("peak {} KiB in {} ms", f.peak_rss_kib, f.duration_ms));
    }
    let _ = writeln!(s, "under-provisioned (stopped by a limit of the tier): {}", r.under_provisioned.len());
    for f in &r.under_provisioned {
        let why = format!(
            "killed for {} at peak {} KiB after {} ms",
            f.killed_for.as_deref().unwrap_or("?"),
            f.peak_rss_kib,
            f.duration_ms
        );
        line(&mut s, f, why);
    }
    s
}
