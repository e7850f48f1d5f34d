//! The JSON shapes of runs, steps and effects, as the agent API and the admin API answer.

use serde_json::{Value, json};

use crate::effects::Effect;
use crate::run::Run;
use crate::steps::Step;

/// A run with its budget, state and epoch.
pub fn run(r: &Run) -> Value {
    json!({
        "id": r.id,
        "agent": r.agent,
        "state": r.state,
        "epoch": r.epoch,
        "holder": r.holder,
        "inputs": r.inputs,
        "budget": {
            "limit": {"max_steps": r.max_steps, "max_tokens": r.max_tokens, "max_cost_micros": r.max_cost_micros},
            "used": {"steps": r.used_steps, "tokens": r.used_tokens, "cost_micros": r.used_cost_micros},
        },
        "waiting_on": r.waiting_on,
        "result": r.result,
        "error": r.error,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "finished_at": r.finished_at,
    })
}

/// A step of the replay log; `replayed` when it was recorded before this call.
pub fn step(s: &Step, replayed: bool) -> Value {
    json!({
        "run_id": s.run_id,
        "seq": s.seq,
        "step_id": s.step_id,
        "kind": s.kind,
        "data": s.data,
        "usage": {"tokens": s.usage_tokens, "cost_micros": s.usage_cost_micros},
        "epoch": s.epoch,
        "recorded_at": s.recorded_at,
        "replayed": replayed,
    })
}

/// An effect as it stands.
pub fn effect(e: &Effect) -> Value {
    json!({
        "step_id": e.step_id,
        "idempotency_key": e.idempotency_key,
        "effect_class": e.effect_class,
        "state": e.state,
        "attempt": e.attempt,
        "target": e.target,
        "description": e.description,
        "result": e.result,
        "replayed": e.replayed,
        "attested_by": e.attested_by,
    })
}
