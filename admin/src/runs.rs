//! Durable runs, for reviewers and operators: the runs (by state and agent), one run with
//! its replay log and its effects, an operator's cancellation, and a human's settlement of
//! an effect whose outcome nobody knows. Every human action is audited with its note.

use airlock_core::audit;
use airlock_core::principals::Role;
use airlock_http::{ApiError, Auth, JsonBody, Page, decode_time_cursor, next_time_cursor, page_limit, parse_id};
use airlock_runs::effects::{self, Resolution};
use airlock_runs::state::RunState;
use airlock_runs::{run, steps, view};
use axum::Json;
use axum::extract::{Path, Query, State};
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use crate::server::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct RunsQuery {
    /// `active`, `waiting`, `completed`, `failed`, `cancelled` or `budget_exhausted`.
    state: Option<String>,
    agent: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Runs, oldest first; `?state=waiting` lists the runs a human must unblock, each with the
/// effect it waits on.
#[utoipa::path(get, path = "/admin/v1/runs", params(RunsQuery),
    responses((status = 200, description = "`{items, next}`: runs, oldest first (waiting ones with their pending effect)"),
        (status = 400, description = "unknown state or bad cursor"), (status = 401, description = "no valid token"),
        (status = 403, description = "not a reviewer")))]
pub async fn list_runs(
    State(state): State<AppState>,
    auth: Auth,
    Query(q): Query<RunsQuery>,
) -> Result<Json<Page<Value>>, ApiError> {
    auth.require(Role::Reviewer)?;
    let limit = page_limit(q.limit)?;
    let st = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(RunState::parse(s).ok_or_else(|| ApiError::validation(format!("state: unknown state `{s}`")))?),
    };
    if let Some(a) = &q.agent {
        airlock_http::printable("agent", a)?;
    }
    let after = decode_time_cursor(q.cursor.as_deref())?;
    let rows = run::list(&state.pool, st, q.agent.as_deref(), after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    let rows = &rows[..rows.len().min(limit as usize)];
    let mut items = Vec::with_capacity(rows.len());
    for r in rows {
        let mut v = view::run(r);
        if r.state == RunState::Waiting {
            let history = effects::history(&state.pool, r.id).await?;
            let pending: Vec<Value> = effects::current(r, &history)
                .iter()
                .filter(|e| e.state == effects::EffectState::AwaitingHuman)
                .map(|e| {
                    let attempts: Vec<&effects::EffectRow> =
                        history.iter().filter(|h| h.step_id == e.step_id).collect();
                    json!({"effect": view::effect(e), "attempts": attempts})
                })
                .collect();
            v["pending"] = json!(pending);
        }
        items.push(v);
    }
    let next = next_time_cursor(more, rows.last().map(|r| (r.created_at, r.id)));
    Ok(Json(Page { items, next }))
}

/// One run with its replay log and its effects (every attempt, outcome and settlement).
#[utoipa::path(get, path = "/admin/v1/runs/{id}", params(("id" = String, Path, description = "run id")),
    responses((status = 200, description = "the run with `steps` and `effects`"), (status = 400, description = "not a run id"),
        (status = 404, description = "no such run")))]
pub async fn get_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    auth.require(Role::Reviewer)?;
    let r = run::get_any(&state.pool, parse_id(&id)?).await?.ok_or_else(|| ApiError::not_found("run"))?;
    let log = steps::list(&state.pool, r.id, 0, 10_000).await?;
    let history = effects::history(&state.pool, r.id).await?;
    let mut v = view::run(&r);
    v["steps"] = json!(log.iter().map(|s| view::step(s, false)).collect::<Vec<_>>());
    v["effects"] = json!(effects::current(&r, &history).iter().map(view::effect).collect::<Vec<_>>());
    v["effect_history"] = json!(history);
    Ok(Json(v))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRunBody {
    reason: Option<String>,
}

/// Cancels a run: every later step and effect is refused, whoever asks (audited).
#[utoipa::path(post, path = "/admin/v1/runs/{id}/cancel", params(("id" = String, Path, description = "run id")), request_body = CancelRunBody,
    responses((status = 200, description = "the run, `cancelled`"), (status = 400, description = "no reason"),
        (status = 403, description = "not an operator"), (status = 404, description = "no such run"),
        (status = 409, description = "INVALID_TRANSITION: already ended")))]
pub async fn cancel_run(
    State(state): State<AppState>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CancelRunBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Operator)?;
    let reason = reason(body.reason.as_deref(), "reason")?;
    let mut tx = state.pool.begin().await?;
    let r = run::cancel(&mut tx, parse_id(&id)?, None, &reason).await?;
    airlock_agent::turn::end_with_cancelled_run(&mut tx, r.id).await?;
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action: "run.cancel",
            target_kind: "run",
            target_id: r.id.to_string(),
            reason: Some(&reason),
            data: json!({"agent": r.agent}),
        },
    )
    .await?;
    tx.commit().await?;
    Ok(Json(view::run(&r)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveEffectBody {
    /// `confirmed_done`, `retry` or `abandon`.
    resolution: String,
    /// What the human checked (required).
    note: Option<String>,
    /// For `confirmed_done`: the result as attested.
    #[serde(default)]
    result: Option<Value>,
}

/// Settles an effect whose outcome nobody knows; the run is `active` again (audited).
#[utoipa::path(post, path = "/admin/v1/runs/{id}/effects/{step_id}/resolve",
    params(("id" = String, Path, description = "run id"), ("step_id" = String, Path, description = "the effect's step id")),
    request_body = ResolveEffectBody,
    responses((status = 200, description = "`{run, effect}` after the decision"), (status = 400, description = "unknown resolution or no note"),
        (status = 403, description = "not a reviewer"), (status = 404, description = "no such run or effect"),
        (status = 409, description = "INVALID_TRANSITION: the run is not waiting on this effect")))]
pub async fn resolve_effect(
    State(state): State<AppState>,
    auth: Auth,
    Path((id, step_id)): Path<(String, String)>,
    JsonBody(body): JsonBody<ResolveEffectBody>,
) -> Result<Json<Value>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    let resolution = Resolution::parse(&body.resolution)
        .ok_or_else(|| ApiError::validation("resolution: `confirmed_done`, `retry` or `abandon`"))?;
    let note = reason(body.note.as_deref(), "note")?;
    let (r, e) =
        effects::resolve(&state.pool, who, parse_id(&id)?, &step_id, resolution, &note, body.result.as_ref()).await?;
    // A turn that waited on this effect goes on.
    airlock_agent::turn::requeue_run(&state.pool, r.id).await?;
    Ok(Json(json!({"run": view::run(&r), "effect": view::effect(&e)})))
}

fn reason(r: Option<&str>, field: &str) -> Result<String, ApiError> {
    airlock_core::text::human_note(r, field).map(str::to_string).map_err(ApiError::validation)
}
