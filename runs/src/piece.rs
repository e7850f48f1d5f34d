//! Typed parts of other crates' statements that spend from a run and record their step in
//! its replay log in the same statement that records what the run did (a delivery), so
//! nothing is recorded without its budget spent, and no other crate writes SQL for `runs`
//! or `run_steps`.

use airlock_core::ids::RunId;
use serde_json::Value;
use sqlx::{Postgres, QueryBuilder};

use crate::budget::Usage;
use crate::steps::{NewStep, StepKind, push_insert, push_spend};

/// Pushes `spent AS (…), step AS (…)`: spends one step of active run `run_id` of `agent`
/// (if no limit would be passed) and records step `step_id` of kind `kind` with `data` in
/// its replay log. `step` yields `(run_id, seq, step_id, …)` when both were written,
/// nothing otherwise; a step that exists fails the statement (the unique key
/// `run_steps_run_step_key`), and with it everything the statement wrote. With `unless`,
/// the name of an earlier CTE of the statement: nothing is spent or recorded when it
/// yields a row.
pub fn spend_and_record(
    qb: &mut QueryBuilder<Postgres>,
    run_id: RunId,
    agent: &str,
    step_id: &str,
    kind: StepKind,
    data: &Value,
    unless: Option<&'static str>,
) {
    let usage = Usage::default();
    push_spend(qb, run_id, Some(agent), None, usage, true, unless);
    qb.push(", ");
    push_insert(qb, "step", "spent", &NewStep { step_id, kind, data, usage });
}

/// Whether a statement failed because its step exists already.
pub fn is_step_taken(e: &sqlx::Error) -> bool {
    crate::steps::is_step_taken(e)
}
