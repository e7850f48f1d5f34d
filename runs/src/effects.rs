//! The effects ledger (`run_effects`): before an external write its holder *begins* the
//! effect, which is committed with its budget spent before the write happens; after the
//! write it records the outcome. Append-only: an effect's state is its latest event.
//!
//! Beginning an effect again tells a resumed process what to do: an outcome recorded → the
//! recorded result (skip the write); started without an outcome and `idempotent` → a new
//! attempt with the same key (redo it); started without an outcome and `non_repeatable` →
//! the run waits for a human, who confirms it done, authorises one more attempt, or
//! abandons it.

use airlock_core::audit;
use airlock_core::ids::RunId;
use airlock_core::principals::Principal;
use airlock_queue::EffectClass;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{FromRow, PgExecutor, PgPool, Postgres, QueryBuilder, Transaction};

use crate::budget::Usage;
use crate::error::RunError;
use crate::run::{self, Run, not_allowed};
use crate::state::{Action, RunState};
use crate::steps::{self, NewStep, StepKind, check_step_id, is_step_taken, push_insert, push_spend};

/// One event of the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "run_effect_event", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum EffectEvent {
    Started,
    Succeeded,
    Failed,
    /// A human authorised one more attempt of an effect whose outcome nobody knows.
    RetryAuthorised,
}

/// A row of the ledger.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct EffectRow {
    #[serde(skip)]
    pub run_id: RunId,
    pub step_id: String,
    pub attempt: i32,
    pub event: EffectEvent,
    pub effect_class: EffectClass,
    pub target: String,
    pub description: String,
    pub idempotency_key: String,
    pub result: Option<Value>,
    pub epoch: i64,
    pub actor: String,
    pub resolution: Option<String>,
    pub note: Option<String>,
    pub recorded_at: DateTime<Utc>,
}

/// Where an effect stands, as a caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectState {
    /// An attempt is started and has no outcome yet.
    Started,
    Succeeded,
    Failed,
    /// Started, no outcome, not repeatable: a human decides.
    AwaitingHuman,
    /// A human authorised one more attempt; beginning it again starts it.
    RetryAuthorised,
}

/// An effect: its latest event, and what it is.
#[derive(Debug, Clone, Serialize)]
pub struct Effect {
    pub step_id: String,
    pub idempotency_key: String,
    pub effect_class: EffectClass,
    pub state: EffectState,
    pub attempt: i32,
    pub target: String,
    pub description: String,
    pub result: Option<Value>,
    /// Whether this answer was recorded before (a replay).
    pub replayed: bool,
    /// Who settled it, when a human did.
    pub attested_by: Option<String>,
}

impl Effect {
    fn of(latest: &EffectRow, run: &Run, replayed: bool) -> Self {
        let state = match latest.event {
            EffectEvent::Succeeded => EffectState::Succeeded,
            EffectEvent::Failed => EffectState::Failed,
            EffectEvent::RetryAuthorised => EffectState::RetryAuthorised,
            EffectEvent::Started
                if latest.effect_class == EffectClass::NonRepeatable
                    && run.waiting_on.as_deref() == Some(waiting_key(&latest.step_id).as_str()) =>
            {
                EffectState::AwaitingHuman
            }
            EffectEvent::Started => EffectState::Started,
        };
        Self {
            step_id: latest.step_id.clone(),
            idempotency_key: latest.idempotency_key.clone(),
            effect_class: latest.effect_class,
            state,
            attempt: latest.attempt,
            target: latest.target.clone(),
            description: latest.description.clone(),
            result: latest.result.clone(),
            replayed,
            attested_by: latest.resolution.as_ref().map(|_| latest.actor.clone()),
        }
    }
}

/// What a run waits on while a human settles its effect `step_id`.
pub fn waiting_key(step_id: &str) -> String {
    format!("effect:{step_id}")
}

/// The idempotency key of the effect of step `step_id` of run `run_id`: the same on every
/// attempt of every process (see [`crate::key`]).
pub fn idempotency_key(run_id: RunId, step_id: &str) -> String {
    format!("eff_{}", crate::key::digest(run_id, step_id))
}

/// An effect to begin.
#[derive(Debug, Clone, Copy)]
pub struct BeginEffect<'a> {
    pub step_id: &'a str,
    pub effect_class: EffectClass,
    pub target: &'a str,
    pub description: &'a str,
    pub usage: Usage,
}

/// What beginning an effect answered.
#[derive(Debug, Clone)]
pub enum Begun {
    /// An attempt is committed: perform the write with the effect's key (`first`: attempt 1
    /// was begun by this call).
    Started { effect: Effect, first: bool },
    /// The outcome is on record: skip the write.
    Recorded(Effect),
    /// Started before without an outcome, and not repeatable: the run waits for a human.
    AwaitingHuman(Effect),
}

fn check(new: &BeginEffect<'_>) -> Result<(), RunError> {
    check_step_id(new.step_id)?;
    new.usage.check()?;
    if new.effect_class == EffectClass::Pure {
        return Err(RunError::Invalid("effect_class: must be idempotent or non_repeatable".into()));
    }
    for (field, v) in [("target", new.target), ("description", new.description)] {
        if v.chars().count() > 2000 || v.chars().any(|c| c.is_control() && c != '\n') {
            return Err(RunError::Invalid(format!("{field}: at most 2000 characters, no control characters")));
        }
    }
    Ok(())
}

/// Begins an effect of `agent`'s run held at `epoch`.
pub async fn begin(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    holder: &str,
    epoch: i64,
    new: &BeginEffect<'_>,
) -> Result<Begun, RunError> {
    check(new)?;
    let key = idempotency_key(run_id, new.step_id);
    // The first attempt: the step in the log, its budget, and the attempt, in one statement.
    let data = json!({
        "effect_class": new.effect_class, "target": new.target, "description": new.description,
        "idempotency_key": key,
    });
    let step = NewStep { step_id: new.step_id, kind: StepKind::Effect, data: &data, usage: new.usage };
    let mut qb = QueryBuilder::new("WITH ");
    push_spend(&mut qb, run_id, Some(agent), Some(epoch), new.usage, true, None);
    qb.push(", ");
    push_insert(&mut qb, "step", "spent", &step);
    qb.push(
        " INSERT INTO run_effects (run_id, step_id, attempt, event, effect_class, target, description, \
         idempotency_key, epoch, actor) SELECT run_id, step_id, 1, 'started', ",
    );
    qb.push_bind(new.effect_class).push(", ").push_bind(new.target.to_string()).push(", ");
    qb.push_bind(new.description.to_string()).push(", ").push_bind(key.clone()).push(", epoch, ");
    qb.push_bind(holder.to_string()).push(" FROM step RETURNING ").push(ROW_COLUMNS);
    match qb.build_query_as::<EffectRow>().fetch_optional(pool).await {
        Ok(Some(row)) => {
            count("started");
            let run = run::get(pool, run_id, agent).await?.ok_or(RunError::NotFound("run"))?;
            return Ok(Begun::Started { effect: Effect::of(&row, &run, false), first: true });
        }
        Ok(None) => {}
        Err(e) if is_step_taken(&e) => {}
        Err(e) => return Err(e.into()),
    }
    begin_again(pool, run_id, agent, holder, epoch, new).await
}

/// Beginning an effect whose step exists (or a first attempt that was refused): decided
/// with the run locked, so two processes of one run cannot start two attempts at once.
async fn begin_again(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    holder: &str,
    epoch: i64,
    new: &BeginEffect<'_>,
) -> Result<Begun, RunError> {
    let mut tx = pool.begin().await?;
    let run = run::lock(&mut tx, run_id, Some(agent)).await?.ok_or(RunError::NotFound("run"))?;
    if run.epoch != epoch {
        return Err(RunError::StaleEpoch { held: run.epoch, given: epoch });
    }
    let Some(step) = steps::get(&mut *tx, run_id, new.step_id).await? else {
        drop(tx);
        // No such step: the first attempt was refused for the run's state or its budget.
        if run.state != RunState::Active {
            return Err(not_allowed(run.state, Action::Exhaust));
        }
        return match run::exhaust_if_over(pool, run_id, new.usage).await? {
            Some(limit) => Err(RunError::BudgetExhausted { limit }),
            None => Err(RunError::InvalidTransition("the run changed while the effect began; try again".into())),
        };
    };
    let latest = latest(&mut *tx, run_id, new.step_id).await?;
    let Some(latest) = latest.filter(|_| step.kind == StepKind::Effect) else {
        return Err(RunError::Diverged {
            step_id: new.step_id.into(),
            recorded: step.kind.as_str().into(),
            given: "effect".into(),
        });
    };
    if latest.effect_class != new.effect_class {
        return Err(RunError::Diverged {
            step_id: new.step_id.into(),
            recorded: format!("a {} effect", class_name(latest.effect_class)),
            given: format!("a {} effect", class_name(new.effect_class)),
        });
    }
    let again = match (latest.event, latest.effect_class) {
        (EffectEvent::Succeeded | EffectEvent::Failed, _) => {
            tx.commit().await?;
            return Ok(Begun::Recorded(Effect::of(&latest, &run, true)));
        }
        (EffectEvent::Started, EffectClass::NonRepeatable) => {
            if run.state == RunState::Active {
                run::wait_on(&mut tx, run_id, &waiting_key(new.step_id)).await?;
            }
            tx.commit().await?;
            count("awaiting_human");
            let run = run::get(pool, run_id, agent).await?.ok_or(RunError::NotFound("run"))?;
            let mut effect = Effect::of(&latest, &run, true);
            effect.state = EffectState::AwaitingHuman;
            return Ok(Begun::AwaitingHuman(effect));
        }
        // Idempotent and started, or a human authorised one more attempt: the next attempt.
        (EffectEvent::Started | EffectEvent::RetryAuthorised, _) => latest.attempt + 1,
    };
    if run.state != RunState::Active {
        return Err(not_allowed(run.state, Action::Exhaust));
    }
    let mut qb = QueryBuilder::new("WITH ");
    push_spend(&mut qb, run_id, Some(agent), Some(epoch), new.usage, false, None);
    qb.push(
        " INSERT INTO run_effects (run_id, step_id, attempt, event, effect_class, target, description, \
         idempotency_key, epoch, actor) SELECT id, ",
    );
    qb.push_bind(new.step_id.to_string()).push(", ").push_bind(again).push(", 'started', ");
    qb.push_bind(latest.effect_class).push(", ").push_bind(latest.target.clone()).push(", ");
    qb.push_bind(latest.description.clone()).push(", ").push_bind(latest.idempotency_key.clone());
    qb.push(", epoch, ").push_bind(holder.to_string()).push(" FROM spent RETURNING ").push(ROW_COLUMNS);
    let Some(row) = qb.build_query_as::<EffectRow>().fetch_optional(&mut *tx).await? else {
        drop(tx);
        return match run::exhaust_if_over(pool, run_id, new.usage).await? {
            Some(limit) => Err(RunError::BudgetExhausted { limit }),
            None => Err(RunError::InvalidTransition("the run changed while the effect began; try again".into())),
        };
    };
    tx.commit().await?;
    count("started");
    Ok(Begun::Started { effect: Effect::of(&row, &run, false), first: false })
}

fn class_name(c: EffectClass) -> &'static str {
    match c {
        EffectClass::Pure => "pure",
        EffectClass::Idempotent => "idempotent",
        EffectClass::NonRepeatable => "non_repeatable",
    }
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
}

impl Outcome {
    fn event(self) -> EffectEvent {
        match self {
            Outcome::Succeeded => EffectEvent::Succeeded,
            Outcome::Failed => EffectEvent::Failed,
        }
    }
}

/// Records what attempt `attempt` of effect `step_id` did. The outcome of the effect's
/// latest attempt, by the run's holder, while the run is active; the same outcome recorded
/// again is answered as recorded.
#[allow(clippy::too_many_arguments)]
pub async fn record_outcome(
    pool: &PgPool,
    run_id: RunId,
    agent: &str,
    holder: &str,
    epoch: i64,
    step_id: &str,
    attempt: i32,
    outcome: Outcome,
    result: &Value,
) -> Result<Effect, RunError> {
    let mut tx = pool.begin().await?;
    let run = run::lock(&mut tx, run_id, Some(agent)).await?.ok_or(RunError::NotFound("run"))?;
    if run.epoch != epoch {
        return Err(RunError::StaleEpoch { held: run.epoch, given: epoch });
    }
    let latest = latest(&mut *tx, run_id, step_id).await?.ok_or(RunError::NotFound("effect"))?;
    match latest.event {
        EffectEvent::Succeeded | EffectEvent::Failed
            if latest.attempt == attempt && latest.event == outcome.event() =>
        {
            return Ok(Effect::of(&latest, &run, true));
        }
        EffectEvent::Started if latest.attempt == attempt => {}
        _ => {
            return Err(RunError::InvalidTransition(format!(
                "effect `{step_id}` has no started attempt {attempt} without an outcome (its latest is attempt {} {:?})",
                latest.attempt, latest.event
            )));
        }
    }
    if run.state != RunState::Active {
        return Err(not_allowed(run.state, Action::Complete));
    }
    let row = insert_event(&mut tx, &latest, outcome.event(), Some(result), epoch, holder, None).await?;
    tx.commit().await?;
    count(match outcome {
        Outcome::Succeeded => "succeeded",
        Outcome::Failed => "failed",
    });
    Ok(Effect::of(&row, &run, false))
}

/// How a human settles an effect whose outcome nobody knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// They checked that it happened: recorded as succeeded, attested by them.
    ConfirmedDone,
    /// They authorise one more attempt (a possible duplicate).
    Retry,
    /// Recorded as failed.
    Abandon,
}

impl Resolution {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "confirmed_done" => Some(Resolution::ConfirmedDone),
            "retry" => Some(Resolution::Retry),
            "abandon" => Some(Resolution::Abandon),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::ConfirmedDone => "confirmed_done",
            Resolution::Retry => "retry",
            Resolution::Abandon => "abandon",
        }
    }
}

/// A human settles effect `step_id` of a run waiting on it: the decision is recorded with
/// their note, the run is `active` again, and the action is audited.
pub async fn resolve(
    pool: &PgPool,
    who: &Principal,
    run_id: RunId,
    step_id: &str,
    resolution: Resolution,
    note: &str,
    result: Option<&Value>,
) -> Result<(Run, Effect), RunError> {
    let note = note.trim();
    if note.is_empty() || note.chars().count() > 2000 {
        return Err(RunError::Invalid("note: what was checked, 1 to 2000 characters, is required".into()));
    }
    let mut tx = pool.begin().await?;
    let run = run::lock(&mut tx, run_id, None).await?.ok_or(RunError::NotFound("run"))?;
    let latest = latest(&mut *tx, run_id, step_id).await?.ok_or(RunError::NotFound("effect"))?;
    let waiting = waiting_key(step_id);
    if run.state != RunState::Waiting || run.waiting_on.as_deref() != Some(waiting.as_str()) {
        return Err(RunError::InvalidTransition(format!(
            "run {run_id} is {}, not waiting on effect `{step_id}`",
            run.state.as_str()
        )));
    }
    if latest.event != EffectEvent::Started {
        return Err(RunError::InvalidTransition(format!("effect `{step_id}` has no attempt without an outcome")));
    }
    let (event, result) = match resolution {
        Resolution::ConfirmedDone => (EffectEvent::Succeeded, result.cloned().unwrap_or_else(|| json!({}))),
        Resolution::Retry => (EffectEvent::RetryAuthorised, json!(null)),
        Resolution::Abandon => (EffectEvent::Failed, result.cloned().unwrap_or_else(|| json!({"abandoned": true}))),
    };
    let result = (event != EffectEvent::RetryAuthorised).then_some(result);
    let row =
        insert_event(&mut tx, &latest, event, result.as_ref(), run.epoch, &who.name, Some((resolution, note))).await?;
    run::resume(&mut tx, run_id, &waiting).await?;
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action: "run.effect.resolve",
            target_kind: "run",
            target_id: run_id.to_string(),
            reason: Some(note),
            data: json!({"step_id": step_id, "resolution": resolution.as_str(), "attempt": latest.attempt}),
        },
    )
    .await?;
    let run = run::lock(&mut tx, run_id, None).await?.ok_or(RunError::NotFound("run"))?;
    tx.commit().await?;
    count(resolution.as_str());
    Ok((run.clone(), Effect::of(&row, &run, false)))
}

async fn insert_event(
    tx: &mut Transaction<'_, Postgres>,
    latest: &EffectRow,
    event: EffectEvent,
    result: Option<&Value>,
    epoch: i64,
    actor: &str,
    human: Option<(Resolution, &str)>,
) -> Result<EffectRow, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO run_effects (run_id, step_id, attempt, event, effect_class, target, description, idempotency_key,
                                  result, epoch, actor, resolution, note)
         SELECT run_id, step_id, attempt, $3, effect_class, target, description, idempotency_key, $4, $5, $6, $7, $8
         FROM run_effects WHERE run_id = $1 AND step_id = $2 AND attempt = $9 AND event = 'started'
         RETURNING {ROW_COLUMNS}"
    )))
    .bind(latest.run_id)
    .bind(&latest.step_id)
    .bind(event)
    .bind(result)
    .bind(epoch)
    .bind(actor)
    .bind(human.map(|(r, _)| r.as_str()))
    .bind(human.map(|(_, n)| n))
    .bind(latest.attempt)
    .fetch_one(&mut **tx)
    .await
}

const ROW_COLUMNS: &str = "run_id, step_id, attempt, event, effect_class, target, description, idempotency_key, result, epoch, \
     actor, resolution, note, recorded_at";

/// The latest event of effect `step_id`.
async fn latest(db: impl PgExecutor<'_>, run_id: RunId, step_id: &str) -> Result<Option<EffectRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROW_COLUMNS} FROM run_effects WHERE run_id = $1 AND step_id = $2 ORDER BY id DESC LIMIT 1"
    )))
    .bind(run_id)
    .bind(step_id)
    .fetch_optional(db)
    .await
}

/// Every event of a run's effects, in order.
pub async fn history(db: impl PgExecutor<'_>, run_id: RunId) -> Result<Vec<EffectRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {ROW_COLUMNS} FROM run_effects WHERE run_id = $1 ORDER BY id")))
        .bind(run_id)
        .fetch_all(db)
        .await
}

/// Each effect of a run as it stands now (its latest event), in the order they began.
pub fn current(run: &Run, history: &[EffectRow]) -> Vec<Effect> {
    let mut order: Vec<&str> = Vec::new();
    let mut last: std::collections::HashMap<&str, &EffectRow> = std::collections::HashMap::new();
    for row in history {
        if last.insert(&row.step_id, row).is_none() {
            order.push(&row.step_id);
        }
    }
    order.into_iter().map(|s| Effect::of(last[s], run, false)).collect()
}

fn count(what: &'static str) {
    metrics::counter!(airlock_core::metrics::RUN_EFFECTS, "event" => what).increment(1);
}
