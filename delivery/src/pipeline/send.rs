//! Transaction A of a send, and the send switch.
//!
//! [`gate`] is the one decision of whether a send may start: the switch (read under a share
//! lock), the delivery still `approved`, an approval bound to the current artifact hash,
//! the sender and transport policy of the configuration as it is now, and no recipient
//! suppressed. Single and batched starts both take it: [`begin_send`] is
//! [`begin_send_many`] of one.

use std::collections::{HashMap, HashSet};

use airlock_core::audit;
use airlock_core::config::Config;
use airlock_core::ids::{DeliveryId, JobId};
use airlock_core::principals::Principal;
use airlock_queue::{self as queue, Lease, QueueError};
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::{PipelineError, SEND_QUEUE, check_policy, non_empty, stored_limits};
use crate::actor::Actor;
use crate::artifact::Artifact;
use crate::state::{Action, DeliveryState};
use crate::store::suppressions::{Suppression, SuppressionKind};
use crate::store::{self, Delivery, ForSend, NewAttempt, Step};
use crate::suppressions;

/// The most sends [`begin_send_many`] (or [`super::record_many`]) takes in one transaction.
pub const MAX_SEND_BATCH: usize = 32;

/// What transaction A decided.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // made once per send and moved once; boxing buys nothing
pub enum SendStart {
    /// The attempt is committed; perform the effect.
    Started { delivery: Delivery, artifact: Artifact, attempt_id: Uuid },
    /// The switch is off: nothing started; the job should wait.
    SwitchOff,
    /// Nothing to send (the delivery was cancelled, or already settled); the job is done.
    Nothing,
    /// Refused by policy at send time; the delivery failed and the job is done.
    Refused(String),
}

/// What the send gate decides for one send.
#[derive(Debug)]
pub enum Gate {
    /// The switch is off: nothing starts, and the job waits.
    SwitchOff,
    /// The delivery is no longer `approved` (cancelled, or settled already).
    Nothing,
    /// Refused at send time, for this reason: the delivery fails.
    Refused(String),
    /// The send may start, with this artifact.
    Go(Artifact),
}

/// The send gate: whether the send of `read.delivery` may start now, under `cfg` and with
/// the live suppressions `suppressed` (those matching the batch's recipients, read in
/// transaction A under the list's share lock).
pub fn gate(cfg: &Config, read: &ForSend, suppressed: &[Suppression]) -> Result<Gate, PipelineError> {
    if !read.send_enabled {
        return Ok(Gate::SwitchOff);
    }
    let d = &read.delivery;
    if d.state != DeliveryState::Approved {
        return Ok(Gate::Nothing);
    }
    let artifact = Artifact::from_json(&read.artifact_body, &stored_limits())?;
    if read.approved_sha256.as_deref() != Some(d.artifact_sha256.as_str()) {
        return Ok(Gate::Refused("no approval matches the current artifact".into()));
    }
    if let Err(e) = check_policy(cfg, &artifact) {
        return Ok(Gate::Refused(e.to_string()));
    }
    let (addresses, domains) = suppressions::lookup_keys(&artifact);
    let hit = suppressed.iter().find(|s| match s.kind {
        SuppressionKind::Address => addresses.contains(&s.value),
        SuppressionKind::Domain => domains.contains(&s.value),
    });
    if let Some(s) = hit {
        return Ok(Gate::Refused(suppressions::describe(s)));
    }
    Ok(Gate::Go(artifact))
}

/// Transaction A of one send.
pub async fn begin_send(
    pool: &PgPool,
    cfg: &Config,
    lease: Lease,
    worker: &str,
    delivery_id: DeliveryId,
) -> Result<SendStart, PipelineError> {
    let mut out = begin_send_many(pool, cfg, worker, &[(lease, delivery_id)]).await;
    out.pop().unwrap_or(Err(PipelineError::NotFound("delivery")))
}

/// Transaction A of several sends, each under its own job's lease, in one transaction:
/// each send passes [`gate`] or not on its own; a lost lease gets
/// [`QueueError::LeaseLost`] and nothing is written for it. If the COMMIT fails (or its
/// answer is lost) every send gets the error: the attempts may be on record, so each
/// caller checks its own job before trying again. Results are in input order.
pub async fn begin_send_many(
    pool: &PgPool,
    cfg: &Config,
    worker: &str,
    items: &[(Lease, DeliveryId)],
) -> Vec<Result<SendStart, PipelineError>> {
    match start_all(pool, cfg, worker, items).await {
        Ok(out) => out,
        Err(e) => {
            let mut out: Vec<_> = items.iter().skip(1).map(|_| Err(e.for_each())).collect();
            out.insert(0, Err(e));
            out
        }
    }
}

/// What one send's job is to do in transaction A.
enum JobWrite {
    Complete,
    Fail(String),
    Start(Artifact, Uuid),
}

async fn start_all(
    pool: &PgPool,
    cfg: &Config,
    worker: &str,
    items: &[(Lease, DeliveryId)],
) -> Result<Vec<Result<SendStart, PipelineError>>, PipelineError> {
    let ids: Vec<DeliveryId> = items.iter().map(|(_, id)| *id).collect();
    let mut tx = pool.begin().await?;
    // The switch under a share lock and the deliveries locked in id order, in one read.
    let mut reads: HashMap<DeliveryId, ForSend> =
        store::read_for_send_many(&mut *tx, &ids).await?.into_iter().map(|r| (r.delivery.id, r)).collect();
    let suppressed = suppressions_of(&mut tx, reads.values()).await?;
    let mut switch = reads.values().next().map(|r| r.send_enabled);
    let mut out: Vec<Option<Result<SendStart, PipelineError>>> = items.iter().map(|_| None).collect();
    let mut writes: Vec<(usize, ForSend, JobWrite)> = Vec::new();
    for (i, (_, id)) in items.iter().enumerate() {
        let Some(read) = reads.remove(id) else {
            let on = match switch {
                Some(on) => on,
                None => *switch.insert(store::send_enabled_locked(&mut *tx).await?),
            };
            out[i] = Some(if on { Err(PipelineError::NotFound("delivery")) } else { Ok(SendStart::SwitchOff) });
            continue;
        };
        match gate(cfg, &read, &suppressed) {
            Ok(Gate::SwitchOff) => out[i] = Some(Ok(SendStart::SwitchOff)),
            Ok(Gate::Nothing) => writes.push((i, read, JobWrite::Complete)),
            Ok(Gate::Refused(why)) => writes.push((i, read, JobWrite::Fail(why))),
            Ok(Gate::Go(artifact)) => writes.push((i, read, JobWrite::Start(artifact, Uuid::now_v7()))),
            Err(e) => out[i] = Some(Err(e)),
        }
    }
    // The jobs, in id order (as every statement over several held jobs takes them); the
    // sends that start together are marked and recorded by one statement.
    writes.sort_by_key(|(i, _, _)| items[*i].0.id());
    let mut held: HashSet<(JobId, i32)> = HashSet::new();
    let mut starts: Vec<NewAttempt> = Vec::new();
    for (i, read, write) in &writes {
        let lease = items[*i].0;
        let done = match write {
            JobWrite::Start(_, attempt_id) => {
                starts.push(NewAttempt {
                    id: *attempt_id,
                    delivery_id: read.delivery.id,
                    lease,
                    artifact_sha256: &read.delivery.artifact_sha256,
                });
                continue;
            }
            JobWrite::Complete | JobWrite::Fail(_) if !starts.is_empty() => {
                held.extend(store::start_attempts(&mut *tx, worker, &std::mem::take(&mut starts)).await?);
                job_write(&mut tx, lease, write).await
            }
            _ => job_write(&mut tx, lease, write).await,
        };
        match done {
            Ok(()) => {
                held.insert((lease.id(), lease.attempt()));
            }
            Err(QueueError::LeaseLost { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    held.extend(store::start_attempts(&mut *tx, worker, &starts).await?);
    drop(starts);
    // The deliveries (locked already, in id order), in one statement.
    let actor = Actor::new("worker", worker);
    let mut moving: Vec<(usize, &ForSend, &JobWrite, [Step; 1])> = Vec::new();
    for (i, read, write) in &writes {
        let lease = items[*i].0;
        if !held.contains(&(lease.id(), lease.attempt())) {
            out[*i] = Some(Err(QueueError::lost(lease).into()));
            continue;
        }
        let step = match write {
            JobWrite::Complete => {
                out[*i] = Some(Ok(SendStart::Nothing));
                continue;
            }
            JobWrite::Fail(why) => {
                Step { action: Action::FailPermanent, actor: &actor, reason: Some(why), data: json!({}) }
            }
            JobWrite::Start(_, attempt_id) => {
                Step { action: Action::StartSend, actor: &actor, reason: None, data: started_data(*attempt_id, lease) }
            }
        };
        moving.push((*i, read, write, [step]));
    }
    moving.sort_by_key(|(_, read, _, _)| read.delivery.id);
    let moves: Vec<(&Delivery, &[Step])> = moving.iter().map(|(_, r, _, s)| (&r.delivery, s.as_slice())).collect();
    let moved = store::advance_many(&mut tx, &moves).await?;
    tx.commit().await?;
    for ((i, read, write, _), delivery) in moving.into_iter().zip(moved) {
        out[i] = Some(Ok(match write {
            JobWrite::Fail(why) => {
                tracing::warn!(delivery.id = %read.delivery.id, reason = %why, "send refused at send time");
                SendStart::Refused(why.clone())
            }
            JobWrite::Start(artifact, attempt_id) => {
                SendStart::Started { delivery, artifact: artifact.clone(), attempt_id: *attempt_id }
            }
            JobWrite::Complete => SendStart::Nothing,
        }));
    }
    Ok(out.into_iter().map(|r| r.unwrap_or(Err(PipelineError::NotFound("delivery")))).collect())
}

/// The live suppressions matching any recipient of `reads`, under the list's share lock
/// (so none is added before this transaction ends). Nothing is read for a batch of
/// webhooks.
async fn suppressions_of<'a>(
    tx: &mut Transaction<'_, Postgres>,
    reads: impl Iterator<Item = &'a ForSend>,
) -> Result<Vec<Suppression>, PipelineError> {
    let (mut addresses, mut domains) = (Vec::new(), Vec::new());
    for read in reads {
        if let Ok(artifact) = Artifact::from_json(&read.artifact_body, &stored_limits()) {
            let (a, d) = suppressions::lookup_keys(&artifact);
            addresses.extend(a);
            domains.extend(d);
        }
    }
    if addresses.is_empty() {
        return Ok(Vec::new());
    }
    addresses.sort();
    addresses.dedup();
    domains.sort();
    domains.dedup();
    store::suppressions::lock_suppressions_shared(&mut **tx).await?;
    Ok(store::suppressions::matching_suppressions(&mut **tx, &addresses, &domains).await?)
}

/// The job write of a send that does not start: done, or failed for good.
async fn job_write(tx: &mut Transaction<'_, Postgres>, lease: Lease, write: &JobWrite) -> Result<(), QueueError> {
    match write {
        JobWrite::Complete => queue::complete(&mut **tx, lease).await,
        JobWrite::Fail(why) => queue::fail(&mut **tx, lease, why, true, None).await.map(|_| ()),
        JobWrite::Start(..) => Ok(()),
    }
}

/// What the event of a started send carries.
fn started_data(attempt_id: Uuid, lease: Lease) -> serde_json::Value {
    json!({"attempt_id": attempt_id, "job_attempt": lease.attempt()})
}

/// Flips the global send switch (audited). Off pauses the send queue in the same
/// transaction; a send whose transaction A has not committed yet will see the flip.
pub async fn set_send_enabled(
    pool: &PgPool,
    who: &Principal,
    enabled: bool,
    reason: Option<&str>,
) -> Result<store::SendSwitch, PipelineError> {
    set_send_enabled_as(pool, &who.name, who.role.as_str(), enabled, reason).await
}

/// [`set_send_enabled`] by a named actor with a role (the command line's operating-system
/// user, audited as such).
pub async fn set_send_enabled_as(
    pool: &PgPool,
    actor: &str,
    role: &str,
    enabled: bool,
    reason: Option<&str>,
) -> Result<store::SendSwitch, PipelineError> {
    let reason = non_empty(reason, "reason")?;
    let mut tx = pool.begin().await?;
    let s = store::set_send_switch(&mut *tx, enabled, actor, &reason).await?;
    if enabled {
        queue::resume_queue(&mut *tx, SEND_QUEUE).await?;
    } else {
        queue::pause_queue(&mut *tx, SEND_QUEUE, "send switch off").await?;
    }
    audit::record_as(
        &mut tx,
        actor,
        role,
        audit::Action {
            action: "send_switch.set",
            target_kind: "settings",
            target_id: "send_enabled".into(),
            reason: Some(&reason),
            data: json!({"enabled": enabled}),
        },
    )
    .await?;
    tx.commit().await?;
    tracing::warn!(enabled, by = %actor, "send switch flipped");
    Ok(s)
}
