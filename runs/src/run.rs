//! The `runs` table: a run's state, its holder epoch and its budget, and every move of
//! the run. Each move is a guarded UPDATE naming the states [`crate::state::next`] allows
//! it from (and, for a holder's write, the epoch it holds); when it matches nothing,
//! [`refusal`] says why: no such run, a stale epoch, or a state that does not allow it.

use airlock_core::ids::RunId;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};

use crate::budget::{Limits, Usage, passed};
use crate::error::RunError;
use crate::state::{Action, RunState};

#[derive(Debug, Clone, FromRow)]
pub struct Run {
    pub id: RunId,
    pub agent: String,
    pub inputs: Value,
    pub state: RunState,
    pub epoch: i64,
    /// The principal that holds the run at `epoch`.
    pub holder: String,
    pub max_steps: i64,
    pub max_tokens: i64,
    pub max_cost_micros: i64,
    pub used_steps: i64,
    pub used_tokens: i64,
    pub used_cost_micros: i64,
    /// What the run waits for while `waiting` (`effect:<step_id>`, …).
    pub waiting_on: Option<String>,
    pub result: Option<Value>,
    pub error: Option<Value>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl Run {
    pub fn limits(&self) -> Limits {
        Limits { max_steps: self.max_steps, max_tokens: self.max_tokens, max_cost_micros: self.max_cost_micros }
    }

    pub fn used(&self) -> (i64, i64, i64) {
        (self.used_steps, self.used_tokens, self.used_cost_micros)
    }
}

/// The columns of [`Run`], for every statement that returns one.
const COLUMNS: &str = "id, agent, inputs, state, epoch, holder, max_steps, max_tokens, max_cost_micros, used_steps, \
     used_tokens, used_cost_micros, waiting_on, result, error, created_at, updated_at, finished_at";

/// The statement's text with the run columns in place of `{cols}` (the statements are
/// kept prepared, so each is built once).
macro_rules! with_columns {
    ($sql:expr) => {{
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| $sql.replace("{cols}", COLUMNS));
        sqlx::AssertSqlSafe(SQL.as_str())
    }};
}

/// Creates a run of `agent`, held by `holder` at epoch 1.
pub async fn create(
    db: impl PgExecutor<'_>,
    agent: &str,
    holder: &str,
    inputs: &Value,
    limits: Limits,
) -> Result<Run, sqlx::Error> {
    sqlx::query_as(with_columns!(
        "INSERT INTO runs (id, agent, holder, inputs, max_steps, max_tokens, max_cost_micros)
         VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {cols}"
    ))
    .bind(RunId::new())
    .bind(agent)
    .bind(holder)
    .bind(inputs)
    .bind(limits.max_steps)
    .bind(limits.max_tokens)
    .bind(limits.max_cost_micros)
    .fetch_one(db)
    .await
}

/// A run, if it exists and belongs to `agent`.
pub async fn get(db: impl PgExecutor<'_>, id: RunId, agent: &str) -> Result<Option<Run>, sqlx::Error> {
    sqlx::query_as(with_columns!("SELECT {cols} FROM runs WHERE id = $1 AND agent = $2"))
        .bind(id)
        .bind(agent)
        .fetch_optional(db)
        .await
}

/// A run, whoever's it is (the admin service).
pub async fn get_any(db: impl PgExecutor<'_>, id: RunId) -> Result<Option<Run>, sqlx::Error> {
    sqlx::query_as(with_columns!("SELECT {cols} FROM runs WHERE id = $1")).bind(id).fetch_optional(db).await
}

/// Locks a run for the rest of the transaction; `agent` `None` reads anyone's.
pub async fn lock(
    tx: &mut Transaction<'_, Postgres>,
    id: RunId,
    agent: Option<&str>,
) -> Result<Option<Run>, sqlx::Error> {
    sqlx::query_as(with_columns!(
        "SELECT {cols} FROM runs WHERE id = $1 AND ($2::text IS NULL OR agent = $2) FOR UPDATE"
    ))
    .bind(id)
    .bind(agent)
    .fetch_optional(&mut **tx)
    .await
}

/// Runs oldest first, optionally in one state and of one agent, after a cursor.
pub async fn list(
    db: impl PgExecutor<'_>,
    state: Option<RunState>,
    agent: Option<&str>,
    after: Option<(DateTime<Utc>, RunId)>,
    limit: i64,
) -> Result<Vec<Run>, sqlx::Error> {
    sqlx::query_as(with_columns!(
        "SELECT {cols} FROM runs
         WHERE ($1::run_state IS NULL OR state = $1) AND ($2::text IS NULL OR agent = $2)
           AND ($3::timestamptz IS NULL OR (created_at, id) > ($3, $4))
         ORDER BY created_at, id LIMIT $5"
    ))
    .bind(state)
    .bind(agent)
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Why a guarded write of `action` matched no run: no such run of `agent`, a stale
/// `epoch` (when the write names one), or a state that does not allow it.
pub async fn refusal(
    db: impl PgExecutor<'_>,
    id: RunId,
    agent: Option<&str>,
    epoch: Option<i64>,
    action: Action,
) -> Result<RunError, sqlx::Error> {
    let run = match agent {
        Some(a) => get(db, id, a).await?,
        None => get_any(db, id).await?,
    };
    Ok(match run {
        None => RunError::NotFound("run"),
        Some(r) if epoch.is_some_and(|e| e != r.epoch) => {
            RunError::StaleEpoch { held: r.epoch, given: epoch.unwrap_or_default() }
        }
        Some(r) => not_allowed(r.state, action),
    })
}

/// The refusal of `action` in `state`.
pub fn not_allowed(state: RunState, action: Action) -> RunError {
    if state == RunState::BudgetExhausted && matches!(action, Action::Exhaust | Action::Complete) {
        return RunError::BudgetExhausted { limit: "the run's budget" };
    }
    RunError::InvalidTransition(format!("a run in state {} cannot {}", state.as_str(), action.as_str()))
}

/// A guarded move: `action` from the states it is legal in, with the run's other columns
/// set by `set` (a fragment of the statement), fenced on `epoch` when given.
macro_rules! guarded_move {
    ($db:expr, $id:expr, $agent:expr, $epoch:expr, $action:expr, $set:literal $(, $bind:expr)*) => {{
        let from = RunState::from_states($action);
        let row: Option<Run> = sqlx::query_as(with_columns!(concat!(
            "UPDATE runs SET updated_at = now(), ",
            $set,
            " WHERE id = $1 AND ($2::text IS NULL OR agent = $2) AND ($3::bigint IS NULL OR epoch = $3)
               AND state = ANY ($4) RETURNING {cols}"
        )))
        .bind($id)
        .bind($agent)
        .bind($epoch)
        .bind(&from)
        $(.bind($bind))*
        .fetch_optional($db)
        .await?;
        row
    }};
}

/// Takes a run over: the caller holds it at epoch + 1, and every write of an older epoch
/// is refused from now on.
pub async fn claim(pool: &sqlx::PgPool, id: RunId, agent: &str, holder: &str) -> Result<Run, RunError> {
    match guarded_move!(pool, id, Some(agent), None::<i64>, Action::Claim, "epoch = epoch + 1, holder = $5", holder) {
        Some(r) => Ok(r),
        None => Err(refusal(pool, id, Some(agent), None, Action::Claim).await?),
    }
}

/// Ends a run with its result.
pub async fn complete(
    pool: &sqlx::PgPool,
    id: RunId,
    agent: &str,
    epoch: i64,
    result: &Value,
) -> Result<Run, RunError> {
    let done = guarded_move!(
        pool,
        id,
        Some(agent),
        Some(epoch),
        Action::Complete,
        "state = 'completed', result = $5, finished_at = now()",
        result
    );
    match done {
        Some(r) => Ok(r),
        None => Err(refusal(pool, id, Some(agent), Some(epoch), Action::Complete).await?),
    }
}

/// Ends a run with an error.
pub async fn fail(pool: &sqlx::PgPool, id: RunId, agent: &str, epoch: i64, error: &Value) -> Result<Run, RunError> {
    let done = guarded_move!(
        pool,
        id,
        Some(agent),
        Some(epoch),
        Action::Fail,
        "state = 'failed', error = $5, waiting_on = NULL, finished_at = now()",
        error
    );
    match done {
        Some(r) => Ok(r),
        None => Err(refusal(pool, id, Some(agent), Some(epoch), Action::Fail).await?),
    }
}

/// Cancels a run, whoever holds it: its agent (`agent`), or an operator (`None`). Every
/// later step and effect is refused.
pub async fn cancel(
    conn: &mut sqlx::PgConnection,
    id: RunId,
    agent: Option<&str>,
    reason: &str,
) -> Result<Run, RunError> {
    let error = serde_json::json!({"cancelled": reason});
    let done = guarded_move!(
        &mut *conn,
        id,
        agent,
        None::<i64>,
        Action::Cancel,
        "state = 'cancelled', waiting_on = NULL, finished_at = now(), error = $5",
        &error
    );
    match done {
        Some(r) => Ok(r),
        None => Err(refusal(&mut *conn, id, agent, None, Action::Cancel).await?),
    }
}

/// Puts an active run in `waiting` on `what`; a run already waiting on it stays.
pub async fn wait_on(tx: &mut Transaction<'_, Postgres>, id: RunId, what: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE runs SET state = 'waiting', waiting_on = $2, updated_at = now() WHERE id = $1 AND state = 'active'",
    )
    .bind(id)
    .bind(what)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Puts a run waiting on `what` back to `active`; false when it was not waiting on it.
pub async fn resume(tx: &mut Transaction<'_, Postgres>, id: RunId, what: &str) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE runs SET state = 'active', waiting_on = NULL, updated_at = now()
         WHERE id = $1 AND state = 'waiting' AND waiting_on = $2",
    )
    .bind(id)
    .bind(what)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Ends an active run as `budget_exhausted` if one more step spending `usage` would pass a
/// limit; returns the limit (`None`: it fits, and the run is left as it is).
pub async fn exhaust_if_over(
    db: impl PgExecutor<'_> + Copy,
    id: RunId,
    usage: Usage,
) -> Result<Option<&'static str>, sqlx::Error> {
    let Some(run) = get_any(db, id).await? else { return Ok(None) };
    let Some(limit) = passed(run.limits(), run.used(), usage) else { return Ok(None) };
    sqlx::query(
        "UPDATE runs SET state = 'budget_exhausted', finished_at = now(), updated_at = now()
         WHERE id = $1 AND state = 'active'",
    )
    .bind(id)
    .execute(db)
    .await?;
    Ok(Some(limit))
}

/// Samples the runs-by-state gauge for `/metrics`.
pub async fn sample_gauges(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    let runs: Vec<(String, i64)> =
        sqlx::query_as("SELECT state::text, count(*) FROM runs GROUP BY state").fetch_all(db).await?;
    for (state, n) in runs {
        metrics::gauge!(airlock_core::metrics::RUNS, "state" => state).set(n as f64);
    }
    Ok(())
}
