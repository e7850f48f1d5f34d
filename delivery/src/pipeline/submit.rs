//! An agent's submission: the intent and the artifact persisted, with the run's step spent
//! and the scoring job enqueued, in one statement.

use airlock_core::config::Config;
use airlock_core::ids::{DeliveryId, RunId};
use airlock_queue::{NewJob, Waker};
use serde_json::json;
use sqlx::PgPool;

use airlock_runs::RunError;
use airlock_runs::budget::Usage;
use airlock_runs::state::{Action, RunState};
use airlock_runs::steps::StepKind;

use super::{PipelineError, SCORE_JOB, check_policy};
use crate::actor::Actor;
use crate::artifact::{Artifact, Limits};
use crate::policy;
use crate::store::{self, Delivery, NewDelivery};
use crate::suppressions;

/// What an agent submits.
#[derive(Debug, Clone)]
pub struct Submission {
    pub run_id: RunId,
    pub step_id: String,
    pub artifact: Artifact,
}

impl Submission {
    /// Parses a request body: `run_id`, `step_id`, `channel` and its member; nothing else.
    pub fn parse(body: &serde_json::Value, limits: &Limits) -> Result<Self, PipelineError> {
        let map = body.as_object().ok_or_else(|| PipelineError::Invalid("body must be a JSON object".into()))?;
        for k in map.keys() {
            if !["run_id", "step_id", "channel", "email", "webhook"].contains(&k.as_str()) {
                return Err(PipelineError::Invalid(format!("{k}: unknown field")));
            }
        }
        let run_id = map
            .get("run_id")
            .and_then(|v| v.as_str())
            .and_then(|s| s.parse::<RunId>().ok())
            .ok_or_else(|| PipelineError::Invalid("run_id: must be a UUID".into()))?;
        let step_id = map
            .get("step_id")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty() && s.len() <= 200 && !s.chars().any(char::is_control))
            .ok_or_else(|| PipelineError::Invalid("step_id: must be a string of 1 to 200 characters".into()))?
            .to_string();
        let channel = map
            .get("channel")
            .and_then(|v| v.as_str())
            .ok_or_else(|| PipelineError::Invalid("channel: must be \"email\" or \"webhook\"".into()))?;
        let artifact = Artifact::from_parts(channel, map.get("email"), map.get("webhook"), limits)?;
        Ok(Self { run_id, step_id, artifact })
    }
}

/// Persists a submission: the same run and step with the same artifact returns the
/// existing delivery (`false`); with another artifact it is a conflict. A new delivery
/// spends one step of the run's budget and enqueues its scoring, in one statement
/// ([`store::submit`]); `waker` wakes the workers once it has committed.
pub async fn submit(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    agent: &str,
    s: Submission,
) -> Result<(Delivery, bool), PipelineError> {
    check_policy(cfg, &s.artifact)?;
    let (run_id, step_id) = (s.run_id, s.step_id.as_str());
    let id = DeliveryId::new();
    let new = NewDelivery {
        id,
        run_id,
        step_id,
        agent,
        artifact: &s.artifact,
        idempotency_key: &policy::idempotency_key(&run_id.uuid(), step_id),
        actor: &Actor::new("agent", agent),
    };
    let job = NewJob::new(SCORE_JOB, json!({"delivery_id": id})).unique_key(format!("score:{id}")).priority(50);
    let (addresses, domains) = suppressions::lookup_keys(&s.artifact);
    let limited = cfg.limits.deliveries_per_hour(agent) > 0 || cfg.limits.per_recipient_per_day > 0;
    let recipients: &[String] = if let Artifact::Email { .. } = &s.artifact { &addresses } else { &[] };
    let written = if limited {
        let mut tx = pool.begin().await?;
        check_recipients_and_limits(&mut tx, cfg, agent, &s).await?;
        let d = store::submit(&mut *tx, &new, &job, recipients, None).await?;
        tx.commit().await?;
        d
    } else {
        // Without limits: one statement, a transaction of its own, that writes nothing when
        // a live suppression matches a recipient (a suppression added while it runs is
        // caught at send time, in transaction A).
        let guard = (!addresses.is_empty()).then_some((&addresses[..], &domains[..]));
        store::submit(pool, &new, &job, recipients, guard).await?
    };
    if let Some(d) = written {
        waker.wake(&job.queue);
        tracing::info!(delivery.id = %d.id, run.id = %run_id, "delivery persisted");
        return Ok((d, true));
    }
    // Nothing was written. Said in the order a submission is judged: whose run it is,
    // whether the step has its delivery already (or is something else in the run's log),
    // whether a recipient is suppressed, whether the run takes steps, whether a step is
    // left to spend.
    let run = airlock_runs::run::get(pool, run_id, agent).await?.ok_or(PipelineError::NotFound("run"))?;
    match store::find_by_step(pool, run_id, step_id).await? {
        Some(existing) if existing.submitted_sha256 == s.artifact.sha256_hex() => return Ok((existing, false)),
        Some(_) => return Err(PipelineError::IdempotencyConflict { run_id, step_id: s.step_id }),
        None => {}
    }
    if let Some(step) = airlock_runs::steps::get(pool, run_id, step_id).await? {
        return Err(RunError::Diverged {
            step_id: s.step_id,
            recorded: step.kind.as_str().into(),
            given: StepKind::Delivery.as_str().into(),
        }
        .into());
    }
    if !limited && !addresses.is_empty() {
        let found = store::suppressions::matching_suppressions(pool, &addresses, &domains).await?;
        if let Some(first) = found.first() {
            return Err(PipelineError::Suppressed(suppressions::describe(first)));
        }
    }
    if run.state != RunState::Active {
        return Err(airlock_runs::run::not_allowed(run.state, Action::Exhaust).into());
    }
    match airlock_runs::run::exhaust_if_over(pool, run_id, Usage::default()).await? {
        Some(limit) => Err(RunError::BudgetExhausted { limit }.into()),
        None => {
            Err(PipelineError::InvalidTransition("the run changed while the delivery was submitted; try again".into()))
        }
    }
}

/// The checks a new submission passes inside its transaction, before anything is written:
/// no recipient is suppressed, the agent has a submission left in its rolling hour
/// (`limits.deliveries_per_hour`), and every recipient has an email left in its rolling
/// day (`limits.per_recipient_per_day`). A repeated submission of a step that has its
/// delivery already is not a new one: it passes, and the caller answers it as before.
///
/// The agent's and the recipients' submissions are serialised by advisory locks for the
/// rest of the transaction, so two racing submissions cannot both take the last place.
async fn check_recipients_and_limits(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    cfg: &Config,
    agent: &str,
    s: &Submission,
) -> Result<(), PipelineError> {
    let per_agent = cfg.limits.deliveries_per_hour(agent);
    let per_recipient = cfg.limits.per_recipient_per_day;
    let (addresses, domains) = suppressions::lookup_keys(&s.artifact);
    let limited: &[String] = if per_recipient > 0 { &addresses } else { &[] };
    store::suppressions::lock_submitters(&mut *tx, (per_agent > 0).then_some(agent), limited).await?;
    if store::find_by_step(&mut **tx, s.run_id, &s.step_id).await?.is_some() {
        return Ok(());
    }
    if !addresses.is_empty() {
        store::suppressions::lock_suppressions_shared(&mut **tx).await?;
        let found = store::suppressions::matching_suppressions(&mut **tx, &addresses, &domains).await?;
        if let Some(first) = found.first() {
            return Err(PipelineError::Suppressed(suppressions::describe(first)));
        }
    }
    if per_agent > 0
        && let Some(secs) = store::suppressions::agent_window_full(&mut **tx, agent, per_agent).await?
    {
        return Err(PipelineError::RateLimited {
            message: format!(
                "agent {agent} has made {per_agent} submissions in the last hour (limits.deliveries_per_hour)"
            ),
            retry_after: seconds(secs),
        });
    }
    if per_recipient > 0 {
        let full = store::suppressions::recipients_window_full(&mut **tx, &addresses, per_recipient).await?;
        if let Some((address, _)) = full.first() {
            let secs = full.iter().map(|(_, s)| *s).fold(0.0, f64::max);
            return Err(PipelineError::RateLimited {
                message: format!(
                    "{address} has been sent {per_recipient} emails in the last day (limits.per_recipient_per_day)"
                ),
                retry_after: seconds(secs),
            });
        }
    }
    Ok(())
}

/// A wait in seconds as a duration, at least one second.
fn seconds(secs: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(secs.clamp(1.0, 86_400.0))
}
