//! The sandboxed task's operations, each one transaction: submit, select, a human's
//! choice, the two transactions around a run, and the rescuer's settling of lost jobs.
//!
//! Invariants:
//! - Nothing is written for a refused request: input is parsed before the transaction
//!   ([`super::spec`]), and every check inside it aborts the whole transaction.
//! - A decision, the task's move and the job that follows (`sandbox.run` after a choice)
//!   commit together; so does the select job's completion. A select job that dies before
//!   its commit leaves no trace and is simply run again.
//! - Selection for one agent is serialised (a transaction-scoped advisory lock), so two
//!   concurrent tasks cannot both fit the same last minutes of a quota.
//! - A run starts only inside the transaction that records it (`sandbox_runs`), moves the
//!   task to `running` and marks the job's effect as started, which refuses an expired
//!   lease. The outcome, the task's end and the job's completion commit together, fenced
//!   on the lease. A lost worker's run is closed as `lost` and the task rerun (the task is
//!   `pure` or `idempotent`), until the job's attempts are spent.

use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::SandboxError;
use super::provider::RunOutcome;
use super::spec::TaskRequest;
use super::state::{Mode, TaskState, Transition, Verdict};
use super::store::{self, Change, Decision, NewDecision, Task};
use crate::selection::{self, Ask, Facts};
use airlock_core::audit;
use airlock_core::config::sandbox::{SandboxConfig, Tier};
use airlock_core::principals::Principal;
use airlock_queue::{self as queue, Lease, NewJob, RescueOutcome, Rescued};

/// Job kinds and the queue they run in (`worker.queues` can give sandbox work its own
/// workers).
pub const SELECT_JOB: &str = "sandbox.select";
pub const RUN_JOB: &str = "sandbox.run";
pub const QUEUE: &str = "sandbox";

/// Attempts of a select job (it has no effect; failures are database trouble).
const SELECT_ATTEMPTS: i32 = 5;
/// Runs of a task: the first, and reruns after lost workers.
pub const RUN_ATTEMPTS: i32 = 3;
/// Similar tasks the history rule reads.
const HISTORY_LIMIT: i64 = 20;

fn task_id_of(payload: &serde_json::Value) -> Option<Uuid> {
    payload.get("task_id").and_then(|v| v.as_str()).and_then(|s| Uuid::parse_str(s).ok())
}

/// The task a sandbox job serves.
pub fn job_task_id(payload: &serde_json::Value) -> Result<Uuid, SandboxError> {
    task_id_of(payload).ok_or_else(|| SandboxError::Invalid("the job's payload has no task_id".into()))
}

/// Stores a task and enqueues its selection.
#[tracing::instrument(skip_all, fields(agent = agent))]
pub async fn submit(pool: &PgPool, who: &Principal, agent: &str, req: &TaskRequest) -> Result<Task, SandboxError> {
    Ok(submit_keyed(pool, who.id, agent, req, None).await?.0)
}

/// [`submit`] for the principal `principal_id`, once per `idempotency_key`: the same key
/// again returns the task it made (`false`), whatever was asked now.
#[tracing::instrument(skip_all, fields(agent = agent))]
pub async fn submit_keyed(
    pool: &PgPool,
    principal_id: Uuid,
    agent: &str,
    req: &TaskRequest,
    idempotency_key: Option<&str>,
) -> Result<(Task, bool), SandboxError> {
    let mut tx = pool.begin().await?;
    let Some(task) = store::insert_task(&mut *tx, agent, principal_id, req, idempotency_key).await? else {
        drop(tx);
        let key = idempotency_key.unwrap_or_default();
        return match store::task_by_key(pool, key).await? {
            Some(t) if t.agent == agent => Ok((t, false)),
            _ => Err(SandboxError::Invalid("the idempotency key belongs to another agent's task".into())),
        };
    };
    let job = NewJob::new(SELECT_JOB, json!({"task_id": task.id}))
        .queue(QUEUE)
        .max_attempts(SELECT_ATTEMPTS)
        .unique_key(format!("{SELECT_JOB}:{}", task.id));
    queue::enqueue(&mut tx, &job).await?;
    tx.commit().await?;
    tracing::info!(task.id = %task.id, mode = task.mode.as_str(), "sandbox task stored");
    Ok((task, true))
}

/// Decides a `selecting` task's tier (the `sandbox.select` job) and completes the job in
/// the same transaction. Any other state just completes the job.
#[tracing::instrument(skip_all, fields(task.id = %task_id))]
pub async fn select(
    pool: &PgPool,
    cfg: &SandboxConfig,
    lease: Lease,
    task_id: Uuid,
) -> Result<Option<Decision>, SandboxError> {
    let mut tx = pool.begin().await?;
    let task = store::lock_task(&mut *tx, task_id).await?;
    if task.state != TaskState::Selecting {
        queue::complete(&mut *tx, lease).await?;
        tx.commit().await?;
        return Ok(None);
    }
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('sandbox.select:' || $1))")
        .bind(&task.agent)
        .execute(&mut *tx)
        .await?;
    let used_minutes = store::used_minutes(&mut *tx, &task.agent).await?;
    let history = if task.mode == Mode::Platform {
        store::history(&mut *tx, &task.agent, &task.similarity, cfg.platform.history_days, HISTORY_LIMIT).await?
    } else {
        Vec::new()
    };
    let ask = Ask {
        agent: &task.agent,
        mode: task.mode,
        requested_tier: task.requested_tier.as_deref(),
        reason: task.reason.as_deref(),
        kind: task.kind.as_deref(),
        size: task.size.as_deref().and_then(super::state::Size::parse),
        context: &task.context,
        secrets: &task.secrets,
    };
    let d = selection::decide(cfg, &ask, &Facts { used_minutes, history });
    let (_, decision) = settle(&mut tx, &task, d.verdict, d.tier.as_ref(), &d.chooser, &d.reason).await?;
    queue::complete(&mut *tx, lease).await?;
    tx.commit().await?;
    tracing::info!(
        task.id = %task.id, verdict = decision.verdict.as_str(), tier = decision.chosen_tier.as_deref(),
        chooser = %decision.chooser, "sandbox tier decided"
    );
    Ok(Some(decision))
}

/// Stores a decision, moves the task by it, and enqueues the run when a tier was chosen.
async fn settle(
    tx: &mut Transaction<'_, Postgres>,
    task: &Task,
    verdict: Verdict,
    tier: Option<&Tier>,
    chooser: &str,
    reason: &str,
) -> Result<(Task, Decision), SandboxError> {
    let decision = store::insert_decision(
        &mut **tx,
        &NewDecision {
            task_id: task.id,
            mode: task.mode,
            verdict,
            requested_tier: task.requested_tier.as_deref(),
            tier,
            chooser,
            reason,
        },
    )
    .await?;
    let (t, change) = match (verdict, tier) {
        (Verdict::Chosen, Some(tier)) => (Transition::Choose, Change { tier: Some(&tier.name), ..Change::default() }),
        (Verdict::Chosen, None) => return Err(SandboxError::Invalid("a chosen decision needs a tier".into())),
        (Verdict::Escalated, _) => (Transition::Escalate, Change::default()),
        (Verdict::Denied, _) => (Transition::Deny, Change::default()),
    };
    let task = store::transition(&mut **tx, task, t, change).await?;
    if verdict == Verdict::Chosen {
        let job = NewJob::new(RUN_JOB, json!({"task_id": task.id}))
            .queue(QUEUE)
            .effect_class(task.effect)
            .max_attempts(RUN_ATTEMPTS)
            .unique_key(format!("{RUN_JOB}:{}", task.id));
        queue::enqueue(tx, &job).await?;
    }
    Ok((task, decision))
}

/// What an operator decides for a task waiting in the admin queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Tier(String),
    Deny,
}

/// An operator's choice for an `awaiting_choice` task: a tier (the task is queued to run)
/// or a refusal, each with its note. Not bounded by the agent's scope: it is the
/// exception path, and it is audited.
#[tracing::instrument(skip_all, fields(task.id = %id))]
pub async fn choose(
    pool: &PgPool,
    cfg: &SandboxConfig,
    who: &Principal,
    id: Uuid,
    choice: &Choice,
    note: Option<&str>,
) -> Result<Task, SandboxError> {
    // Every human action is recorded with why.
    let note = airlock_core::text::human_note(note, "note").map_err(SandboxError::Invalid)?;
    let tier = match choice {
        Choice::Tier(name) => Some(cfg.tiers.get(name).ok_or_else(|| {
            SandboxError::Invalid(format!("tier: unknown tier `{name}` (tiers: {})", cfg.tiers.names().join(", ")))
        })?),
        Choice::Deny => None,
    };
    let mut tx = pool.begin().await?;
    let task = store::lock_task(&mut *tx, id).await?;
    if task.state != TaskState::AwaitingChoice {
        return Err(SandboxError::InvalidTransition(format!(
            "only a task awaiting a choice can be chosen for; this one is {}",
            task.state
        )));
    }
    let (verdict, action) = match tier {
        Some(_) => (Verdict::Chosen, "sandbox.choose"),
        None => (Verdict::Denied, "sandbox.deny"),
    };
    let chooser = selection::human_chooser(&who.name);
    let (task, decision) = settle(&mut tx, &task, verdict, tier, &chooser, note).await?;
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action,
            target_kind: "sandbox_task",
            target_id: task.id.to_string(),
            reason: Some(note),
            data: json!({"tier": decision.chosen_tier, "requested_tier": task.requested_tier,
                         "mode": task.mode, "agent": task.agent, "decision_id": decision.id}),
        },
    )
    .await?;
    tx.commit().await?;
    Ok(task)
}

/// A run about to start: the task, the decision that chose its tier, and the row that
/// records this start.
#[derive(Debug, Clone)]
pub struct RunPlan {
    pub task: Task,
    pub decision_id: Uuid,
    pub tier: Tier,
    pub run_id: i64,
}

/// How [`begin_run`] went.
#[derive(Debug)]
pub enum RunStart {
    Run(Box<RunPlan>),
    /// The task is past running (or was never chosen): the job was completed.
    Nothing,
}

/// Records the start of a run: closes a run a lost worker left open, moves the task to
/// `running`, inserts the run row and marks the job's effect started (refused under an
/// expired lease), in one transaction.
#[tracing::instrument(skip_all, fields(task.id = %task_id))]
pub async fn begin_run(pool: &PgPool, lease: Lease, worker: &str, task_id: Uuid) -> Result<RunStart, SandboxError> {
    let mut tx = pool.begin().await?;
    let task = store::lock_task(&mut *tx, task_id).await?;
    let decision = store::chosen_decision(&mut *tx, task_id).await?;
    let (decision, tier) = match (&task.state, decision) {
        (TaskState::Queued | TaskState::Running, Some(d)) if d.outcome_at.is_none() => match d.tier_spec.clone() {
            Some(t) => (d, t.0),
            None => return Err(SandboxError::Invalid("the chosen decision has no tier".into())),
        },
        _ => {
            queue::complete(&mut *tx, lease).await?;
            tx.commit().await?;
            return Ok(RunStart::Nothing);
        }
    };
    if task.state == TaskState::Running {
        let lost = store::close_lost_runs(&mut *tx, task.id).await?;
        tracing::warn!(task.id = %task.id, lost, "a previous run's worker was lost; running again");
    }
    let task =
        store::transition(&mut *tx, &task, Transition::Start, Change { count_run: true, ..Change::default() }).await?;
    let run_id = store::insert_run(&mut *tx, task.id, decision.id, lease, worker).await?;
    queue::mark_effect_started(&mut *tx, lease).await?;
    tx.commit().await?;
    Ok(RunStart::Run(Box::new(RunPlan { task, decision_id: decision.id, tier, run_id })))
}

/// Records a run's outcome on its decision, ends the task and completes the job, fenced on
/// the lease, in one transaction.
#[tracing::instrument(skip_all, fields(task.id = %plan.task.id))]
pub async fn finish_run(pool: &PgPool, lease: Lease, plan: &RunPlan, o: &RunOutcome) -> Result<Task, SandboxError> {
    let mut tx = pool.begin().await?;
    queue::complete(&mut *tx, lease).await?;
    let task = store::lock_task(&mut *tx, plan.task.id).await?;
    store::record_outcome(&mut *tx, plan.decision_id, o).await?;
    store::close_finished_run(&mut *tx, plan.run_id).await?;
    let change = Change { stdout: Some(&o.stdout), stderr: Some(&o.stderr), ..Change::default() };
    let task = store::transition(&mut *tx, &task, Transition::Finish(o.end()), change).await?;
    tx.commit().await?;
    Ok(task)
}

/// Ends a task whose job is failing for good (a secret missing from this worker's
/// keyring, a sandbox that cannot be prepared on the last attempt, …): the task fails with
/// the reason, any run it started is closed as lost, and the job fails permanently,
/// fenced on the lease.
pub async fn give_up(pool: &PgPool, lease: Lease, task_id: Uuid, error: &str) -> Result<(), SandboxError> {
    let mut tx = pool.begin().await?;
    queue::fail(&mut *tx, lease, error, true, None).await?;
    let task = store::lock_task(&mut *tx, task_id).await?;
    store::close_lost_runs(&mut *tx, task_id).await?;
    store::transition(&mut *tx, &task, Transition::GiveUp, Change { error: Some(error), ..Change::default() }).await?;
    tx.commit().await?;
    Ok(())
}

/// The rescuer's hook for `sandbox.run`: a run whose worker was lost is closed as `lost`;
/// the task goes back to `queued` when the job will run again, or fails when its attempts
/// are spent.
pub async fn on_run_rescued(tx: &mut Transaction<'_, Postgres>, r: &Rescued) -> Result<(), SandboxError> {
    let Some(id) = task_id_of(&r.job.payload) else { return Ok(()) };
    let task = store::lock_task(&mut **tx, id).await?;
    let (t, error) = match (task.state, r.outcome) {
        (TaskState::Running, RescueOutcome::Retried) => (Transition::Requeue, None),
        (TaskState::Running | TaskState::Queued, RescueOutcome::Failed) => {
            (Transition::GiveUp, Some("the worker running it was lost and its run attempts are spent"))
        }
        _ => return Ok(()),
    };
    store::close_lost_runs(&mut **tx, id).await?;
    store::transition(&mut **tx, &task, t, Change { error, ..Change::default() }).await?;
    tracing::warn!(task.id = %id, outcome = ?r.outcome, "sandbox run rescued after a lost worker");
    Ok(())
}

/// The rescuer's hook for `sandbox.select`: a selection whose attempts are spent fails the
/// task (a retried one just runs again: selection has no effect).
pub async fn on_select_rescued(tx: &mut Transaction<'_, Postgres>, r: &Rescued) -> Result<(), SandboxError> {
    let Some(id) = task_id_of(&r.job.payload) else { return Ok(()) };
    if r.outcome != RescueOutcome::Failed {
        return Ok(());
    }
    let task = store::lock_task(&mut **tx, id).await?;
    if task.state == TaskState::Selecting {
        let change = Change { error: Some("selection attempts are spent"), ..Change::default() };
        store::transition(&mut **tx, &task, Transition::GiveUp, change).await?;
    }
    Ok(())
}
