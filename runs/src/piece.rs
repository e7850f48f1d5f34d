//! Typed parts of other crates' statements that spend from a run in the same statement
//! that records what the run did (a delivery, a step), so nothing is recorded without its
//! budget spent, and no other crate writes SQL for `runs`.

use airlock_core::ids::RunId;
use sqlx::{Postgres, QueryBuilder};

/// Pushes `cte AS (…)`: spends one step of run `run_id` of `agent`, if it has a step left;
/// the step that spends the last one leaves the run `budget_exhausted`. Yields `(id)` when
/// the step was spent, nothing otherwise (another agent's run, or no step left).
pub fn spend_step(qb: &mut QueryBuilder<Postgres>, cte: &str, run_id: RunId, agent: &str) {
    qb.push(cte).push(
        " AS (UPDATE runs SET used_steps = used_steps + 1, updated_at = now(), \
             state = CASE WHEN max_steps <> 0 AND used_steps + 1 >= max_steps \
                          THEN 'budget_exhausted'::run_state ELSE state END \
         WHERE id = ",
    );
    qb.push_bind(run_id);
    qb.push(" AND agent = ");
    qb.push_bind(agent.to_string());
    qb.push(" AND (max_steps = 0 OR used_steps < max_steps) RETURNING id)");
}
