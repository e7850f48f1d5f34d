//! The JSON shapes of turns.

use serde_json::{Value, json};

use crate::authorization::{self, Authorization};
use crate::turn::{Event, Turn};

/// `GET /v1/turns/{id}`.
pub fn turn(t: &Turn, authorization: Option<&Authorization>) -> Value {
    json!({
        "id": t.id, "run_id": t.run_id, "step_id": t.step_id, "state": t.state, "model": t.model,
        "tools": t.tools, "limits": t.limits.0, "rounds": t.rounds, "tool_calls": t.tool_calls,
        "final": t.final_text.as_ref().map(|text| json!({"text": text})),
        "delivery_id": t.delivery_id,
        "authorization": authorization.map(|a| json!({
            "id": a.id, "tool_id": a.tool_id, "arguments": a.arguments,
            "arguments_sha256": a.arguments_sha256, "state": a.state,
        })),
        "error": t.error, "created_at": t.created_at, "updated_at": t.updated_at, "finished_at": t.finished_at,
    })
}

/// One event of `GET /v1/turns/{id}/events`.
pub fn event(e: &Event) -> Value {
    json!({"seq": e.seq, "kind": e.kind, "data": e.data, "at": e.at})
}

/// One authorization of `GET /admin/v1/authorizations`.
pub fn authorization(a: &Authorization) -> Value {
    authorization::view(a)
}
