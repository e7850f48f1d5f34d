//! How tasks and decisions look on the wire.
//!
//! The agent sees its task with the latest decision and the outcome (the contract's
//! fields, plus a few more); a reviewer also sees every decision, every run, and the
//! task's spec (secret names only: values never leave the worker).

use serde_json::{Value, json};
use sqlx::PgExecutor;

use super::store::{self, Decision, DecisionRow, Task};

/// `{"requested", "chosen", "mode", "chooser", "reason", …}`.
pub fn decision(d: &Decision) -> Value {
    json!({
        "id": d.id,
        "requested": d.requested_tier,
        "chosen": d.chosen_tier,
        "mode": d.mode,
        "chooser": d.chooser,
        "reason": d.reason,
        "verdict": d.verdict,
        "decided_at": d.decided_at,
        "tier": d.tier_spec.as_ref().map(|t| &t.0),
    })
}

/// `{"exit_code", "duration_ms", "peak_rss_kib", "timed_out", "killed_for", …}` once the
/// decision's run ended.
pub fn outcome(d: &Decision) -> Option<Value> {
    d.outcome_at.map(|at| {
        let cost = match (&d.tier_spec, d.duration_ms) {
            (Some(t), Some(ms)) => Some(t.0.cost_of(ms.max(0) as u64)),
            _ => None,
        };
        json!({
            "exit_code": d.exit_code,
            "duration_ms": d.duration_ms,
            "peak_rss_kib": d.peak_rss_kib,
            "timed_out": d.timed_out,
            "killed_for": d.killed_for,
            "signal": d.signal,
            "output_bytes": d.output_bytes,
            "limits": d.limits,
            "cost": cost,
            "at": at,
        })
    })
}

/// A decision as the review list shows it.
pub fn decision_row(r: &DecisionRow) -> Value {
    let mut v = decision(&r.decision);
    if let Some(m) = v.as_object_mut() {
        m.insert("task_id".into(), json!(r.decision.task_id));
        m.insert("agent".into(), json!(r.agent));
        m.insert("task_state".into(), json!(r.task_state));
        m.insert("kind".into(), json!(r.kind));
        m.insert("outcome".into(), outcome(&r.decision).unwrap_or(Value::Null));
    }
    v
}

/// A task. `full` adds the spec, every decision and every run (for reviewers).
pub async fn task(db: impl PgExecutor<'_> + Copy, t: &Task, full: bool) -> Result<Value, sqlx::Error> {
    let decisions = store::decisions_of(db, t.id).await?;
    let chosen = decisions.iter().find(|d| d.chosen_tier.is_some());
    let mut v = json!({
        "id": t.id,
        "state": t.state,
        "mode": t.mode,
        "requested_tier": t.requested_tier,
        "tier": t.tier,
        "effect": t.effect,
        "kind": t.kind,
        "size": t.size,
        "reason": t.reason,
        "run_count": t.run_count,
        "decision": decisions.last().map(decision),
        "outcome": chosen.and_then(outcome),
        "output": if t.state.is_terminal() && t.stdout.is_some() {
            json!({"stdout": t.stdout, "stderr": t.stderr})
        } else {
            Value::Null
        },
        "error": t.error,
        "created_at": t.created_at,
        "updated_at": t.updated_at,
        "finished_at": t.finished_at,
    });
    if full {
        let runs = json!(store::runs_of(db, t.id).await?);
        if let Some(m) = v.as_object_mut() {
            m.insert("agent".into(), json!(t.agent));
            m.insert("command".into(), json!(t.command));
            m.insert("env".into(), json!(t.env.0));
            m.insert("secrets".into(), json!(t.secrets));
            m.insert("context".into(), json!(t.context));
            m.insert("decisions".into(), Value::Array(decisions.iter().map(decision).collect()));
            m.insert("runs".into(), runs);
        }
    }
    Ok(v)
}

/// A task as the admin queue lists it.
pub fn summary(t: &Task) -> Value {
    json!({
        "id": t.id, "agent": t.agent, "state": t.state, "mode": t.mode, "requested_tier": t.requested_tier,
        "tier": t.tier, "kind": t.kind, "size": t.size, "reason": t.reason, "command": t.command,
        "created_at": t.created_at,
    })
}
