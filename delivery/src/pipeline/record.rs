//! Transaction B of a send: the attempt's outcome, the receipt and the job's end, together,
//! fenced on the lease; and what follows when the rescuer takes a send job from a holder
//! that vanished.
//!
//! One path for one send or many: [`record_outcome`] is [`record_many`] of one. Sends
//! recorded at the same moment share one transaction B.

use std::collections::HashSet;
use std::time::Duration;

use airlock_core::ids::{DeliveryId, JobId};
use airlock_queue::{self as queue, FailOutcome, Lease, QueueError, RescueOutcome, Rescued};
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::PipelineError;
use crate::actor::Actor;
use crate::outcome::EffectOutcome;
use crate::state::{Action, DeliveryState};
use crate::store::{self, Delivery, NewReceipt, Step};

/// One send whose outcome is to be recorded: the lease its job is held under, the delivery
/// as transaction A left it, its attempt and what the transport said.
#[derive(Debug, Clone)]
pub struct SendOutcome {
    pub lease: Lease,
    pub delivery: Delivery,
    pub attempt_id: Uuid,
    pub outcome: EffectOutcome,
}

/// Transaction B of one send. Fenced on the lease: a holder that lost it changes nothing.
pub async fn record_outcome(
    pool: &PgPool,
    lease: Lease,
    worker: &str,
    d: &Delivery,
    attempt_id: Uuid,
    outcome: &EffectOutcome,
) -> Result<DeliveryState, PipelineError> {
    let one = SendOutcome { lease, delivery: d.clone(), attempt_id, outcome: outcome.clone() };
    let mut out = record_many(pool, worker, std::slice::from_ref(&one)).await;
    out.pop().unwrap_or(Err(PipelineError::NotFound("delivery")))
}

/// Transaction B of several sends, in one transaction: each job ends as its outcome says
/// (sent: completed with its receipt; not delivered: retried later or failed; refused for
/// good: failed; ambiguous: parked), fenced on its lease, and each delivery moves with it.
/// A lost lease gets [`QueueError::LeaseLost`] and nothing is written for it. Should the
/// deliveries' move be refused (one changed since transaction A), each send is recorded on
/// its own. Results are in input order.
pub async fn record_many(
    pool: &PgPool,
    worker: &str,
    items: &[SendOutcome],
) -> Vec<Result<DeliveryState, PipelineError>> {
    match record_all(pool, worker, items).await {
        Ok(out) => out,
        Err(PipelineError::InvalidTransition(_)) if items.len() > 1 => {
            let mut out = Vec::with_capacity(items.len());
            for s in items {
                out.extend(Box::pin(record_many(pool, worker, std::slice::from_ref(s))).await);
            }
            out
        }
        Err(e) => {
            let mut out: Vec<_> = items.iter().skip(1).map(|_| Err(e.for_each())).collect();
            out.insert(0, Err(e));
            out
        }
    }
}

async fn record_all(
    pool: &PgPool,
    worker: &str,
    items: &[SendOutcome],
) -> Result<Vec<Result<DeliveryState, PipelineError>>, PipelineError> {
    let receipts: Vec<(Lease, NewReceipt, &str)> = items
        .iter()
        .filter_map(|s| match &s.outcome {
            EffectOutcome::Sent { message_id, response } => Some((
                s.lease,
                sent_receipt(s.lease, worker, &s.delivery, s.attempt_id, message_id.as_deref(), response),
                s.outcome.detail(),
            )),
            _ => None,
        })
        .collect();
    // Jobs first, then deliveries, as every transaction B takes them.
    let mut tx = pool.begin().await?;
    let mut held: HashSet<(JobId, i32)> = store::record_sent(&mut *tx, &receipts).await?.into_iter().collect();
    let mut moves: Vec<(usize, Action, Option<String>)> = Vec::new();
    for (i, s) in items.iter().enumerate() {
        let moved = match &s.outcome {
            EffectOutcome::Sent { .. } => {
                if held.contains(&(s.lease.id(), s.lease.attempt())) {
                    moves.push((i, Action::ConfirmSent, None));
                }
                continue;
            }
            other => end_unsent(&mut tx, s, other).await,
        };
        match moved {
            Ok(m) => {
                held.insert((s.lease.id(), s.lease.attempt()));
                moves.push((i, m.0, m.1));
            }
            Err(QueueError::LeaseLost { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let actor = Actor::new("worker", worker);
    moves.sort_by_key(|(i, _, _)| items[*i].delivery.id);
    let steps: Vec<[Step; 1]> = moves
        .iter()
        .map(|(i, action, reason)| {
            [Step {
                action: *action,
                actor: &actor,
                reason: reason.as_deref(),
                data: json!({"attempt_id": items[*i].attempt_id}),
            }]
        })
        .collect();
    // `delivery` is as transaction A left it; the move's guard refuses it if it changed
    // since (and the lease fence above refuses a holder that lost the job first).
    let plan: Vec<(&Delivery, &[Step])> =
        moves.iter().zip(&steps).map(|((i, _, _), st)| (&items[*i].delivery, st.as_slice())).collect();
    let moved = store::advance_many(&mut tx, &plan).await?;
    tx.commit().await?;
    let mut out: Vec<Result<DeliveryState, PipelineError>> =
        items.iter().map(|s| Err(QueueError::lost(s.lease).into())).collect();
    for ((i, _, _), d) in moves.iter().zip(moved) {
        count_recorded(&items[*i].delivery, &items[*i].outcome, d.state);
        out[*i] = Ok(d.state);
    }
    Ok(out)
}

/// The job's end and the attempt's outcome of a send that did not go out; returns the
/// delivery's move and its reason.
async fn end_unsent(
    tx: &mut Transaction<'_, Postgres>,
    s: &SendOutcome,
    outcome: &EffectOutcome,
) -> Result<(Action, Option<String>), QueueError> {
    let detail = outcome.detail();
    let moved = match outcome {
        EffectOutcome::NotDelivered { detail, retry_after } => {
            match queue::fail(&mut **tx, s.lease, detail, false, *retry_after).await? {
                FailOutcome::Retry => (Action::RetryLater, Some(format!("not delivered, will retry: {detail}"))),
                FailOutcome::Failed => {
                    (Action::FailPermanent, Some(format!("not delivered, attempts exhausted: {detail}")))
                }
            }
        }
        EffectOutcome::Permanent { detail } => {
            queue::fail(&mut **tx, s.lease, detail, true, None).await?;
            (Action::FailPermanent, Some(format!("refused for good: {detail}")))
        }
        EffectOutcome::Ambiguous { detail } => {
            queue::park(&mut **tx, s.lease, detail).await?;
            (Action::Park, Some(format!("may or may not have been delivered: {detail}")))
        }
        EffectOutcome::Sent { .. } => return Err(QueueError::lost(s.lease)),
    };
    store::finish_attempt(&mut **tx, s.attempt_id, outcome.label(), Some(detail)).await?;
    Ok(moved)
}

/// The receipt of a send that went out under `lease`.
fn sent_receipt<'a>(
    lease: Lease,
    worker: &'a str,
    d: &'a Delivery,
    attempt_id: Uuid,
    message_id: Option<&'a str>,
    response: &'a str,
) -> NewReceipt<'a> {
    NewReceipt {
        delivery_id: d.id,
        attempt_id: Some(attempt_id),
        channel: d.channel,
        message_id,
        provider_response: Some(response),
        payload_sha256: &d.artifact_sha256,
        attempt: lease.attempt(),
        worker: Some(worker),
        attested_by: None,
    }
}

/// Counts a recorded send attempt, and its receipt when it left the delivery sent.
fn count_recorded(d: &Delivery, outcome: &EffectOutcome, state: DeliveryState) {
    metrics::counter!(airlock_core::metrics::SEND_ATTEMPTS, "channel" => d.channel.as_str(), "outcome" => outcome.label())
        .increment(1);
    if state == DeliveryState::Sent {
        metrics::counter!(airlock_core::metrics::RECEIPTS, "channel" => d.channel.as_str()).increment(1);
    }
}

/// Runs [`record_outcome`] until it is recorded, the lease is lost, or `give_up` fires.
/// The outcome is held in memory meanwhile: a send without a receipt is never reported
/// as sent.
pub async fn record_outcome_until_done(
    pool: &PgPool,
    lease: Lease,
    worker: &str,
    d: &Delivery,
    attempt_id: Uuid,
    outcome: &EffectOutcome,
    give_up: &tokio_util::sync::CancellationToken,
) -> Result<DeliveryState, PipelineError> {
    let mut wait = Duration::from_millis(100);
    loop {
        match record_outcome(pool, lease, worker, d, attempt_id, outcome).await {
            Ok(s) => return Ok(s),
            Err(PipelineError::Db(e)) => {
                tracing::warn!(delivery.id = %d.id, error = %e, outcome = outcome.label(), "recording the outcome failed; retrying");
            }
            Err(other) => return Err(other),
        }
        tokio::select! {
            _ = give_up.cancelled() => return Err(PipelineError::Invalid("gave up recording the outcome".into())),
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

/// Keeps a delivery in step with its send job after the rescuer moved the job (its holder
/// died or stalled): a started email is parked, a started webhook goes back to approved
/// (it is resent with the same key), an exhausted job fails the delivery.
pub async fn on_send_rescued(tx: &mut Transaction<'_, Postgres>, r: &Rescued) -> Result<(), PipelineError> {
    let Some(id) = r.job.payload.get("delivery_id").and_then(|v| v.as_str()).and_then(|s| s.parse::<DeliveryId>().ok())
    else {
        return Ok(());
    };
    let d = store::lock(&mut **tx, id).await?;
    let actor = Actor::system("rescuer");
    if r.effect_started {
        store::finish_open_attempts_of_job(&mut **tx, r.job.id, "lease_expired").await?;
    }
    let action = match (d.state, r.outcome) {
        (DeliveryState::Sending, RescueOutcome::Parked) => {
            Some((Action::Park, "the worker vanished after the send started; a human must decide"))
        }
        (DeliveryState::Sending, RescueOutcome::Retried) => Some((
            Action::Requeue,
            "the worker vanished after the send started; resending with the same idempotency key",
        )),
        (DeliveryState::Sending, RescueOutcome::Failed) | (DeliveryState::Approved, RescueOutcome::Failed) => {
            Some((Action::FailPermanent, "send attempts exhausted"))
        }
        _ => None,
    };
    if let Some((action, why)) = action {
        store::transition(tx, &d, action, &actor, Some(why), json!({"job_id": r.job.id, "job_attempt": r.job.attempt}))
            .await?;
    }
    Ok(())
}
