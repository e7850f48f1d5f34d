//! Settling what a human must settle: a parked send (confirmed sent, resent, or cancelled)
//! and a delivery withdrawn before it is sent.

use airlock_core::config::Config;
use airlock_core::ids::DeliveryId;
use airlock_core::principals::Principal;
use airlock_queue::{self as queue, JobState};
use serde_json::json;
use sqlx::PgPool;

use super::{
    PipelineError, audit_delivery, non_empty, require_state, reviewer_actor, send_job_for, send_key, stored_limits,
};
use crate::actor::Actor;
use crate::artifact::{Artifact, Channel};
use crate::policy;
use crate::state::{Action, DeliveryState};
use crate::store::{self, Delivery, NewReceipt};

/// How a human settles a parked delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// The human checked (e.g. by Message-ID at the relay) that it went out: `sent`, with a
    /// receipt attested by them.
    ConfirmedSent,
    /// The human authorises a possible duplicate: back to `approved`, sent again.
    Resend,
    Cancel,
}

impl Resolution {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "confirmed_sent" => Some(Resolution::ConfirmedSent),
            "resend" => Some(Resolution::Resend),
            "cancel" => Some(Resolution::Cancel),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::ConfirmedSent => "confirmed_sent",
            Resolution::Resend => "resend",
            Resolution::Cancel => "cancel",
        }
    }
}

/// Settles a `parked` delivery.
pub async fn resolve(
    pool: &PgPool,
    cfg: &Config,
    who: &Principal,
    id: DeliveryId,
    resolution: Resolution,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = non_empty(note, "note")?;
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    require_state(&d, &[DeliveryState::Parked], "resolved")?;
    let job = queue::find_live(&mut *tx, &send_key(id)).await?;
    let actor = reviewer_actor(who);
    let data = json!({"resolution": resolution.as_str()});
    match resolution {
        Resolution::ConfirmedSent => {
            let attempts = store::attempts(&mut *tx, id).await?;
            let last = attempts.last();
            let message_id = match d.channel {
                Channel::Email => {
                    let body = store::get_artifact(&mut *tx, &d.artifact_sha256).await?;
                    match body.map(|b| Artifact::from_json(&b, &stored_limits())).transpose()? {
                        Some(Artifact::Email { email }) => Some(policy::message_id(&d.idempotency_key, &email.from)),
                        _ => None,
                    }
                }
                Channel::Webhook => None,
            };
            store::insert_receipt(
                &mut *tx,
                &NewReceipt {
                    delivery_id: id,
                    attempt_id: last.map(|a| a.id),
                    channel: d.channel,
                    message_id: message_id.as_deref(),
                    provider_response: Some(&format!("confirmed by {}: {note}", who.name)),
                    payload_sha256: &d.artifact_sha256,
                    attempt: last.map_or(0, |a| a.lease_attempt),
                    worker: last.map(|a| a.worker.as_str()),
                    attested_by: Some(&who.name),
                },
            )
            .await?;
            store::transition(&mut tx, &d, Action::ResolveConfirmedSent, &actor, Some(&note), data.clone()).await?;
            if let Some((job_id, _)) = job {
                queue::settle_parked(&mut *tx, job_id, JobState::Completed, &note).await?;
            }
        }
        Resolution::Resend => {
            store::transition(&mut tx, &d, Action::ResolveResend, &actor, Some(&note), data.clone()).await?;
            match job {
                Some((job_id, JobState::Parked)) => queue::retry_now(&mut *tx, job_id).await?,
                Some(_) => {}
                None => {
                    queue::enqueue(&mut tx, &send_job_for(cfg, &d)).await?;
                }
            }
        }
        Resolution::Cancel => {
            store::transition(&mut tx, &d, Action::ResolveCancel, &actor, Some(&note), data.clone()).await?;
            if let Some((job_id, _)) = job {
                queue::settle_parked(&mut *tx, job_id, JobState::Cancelled, &note).await?;
            }
        }
    }
    audit_delivery(&mut tx, who, "delivery.resolve", &d, Some(&note), data).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// Cancels a delivery that has not started sending (by its agent or an operator).
pub async fn cancel(
    pool: &PgPool,
    actor: &Actor,
    who: Option<&Principal>,
    id: DeliveryId,
    reason: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let reason = non_empty(reason, "reason")?;
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    if !d.state.can_cancel() {
        return Err(PipelineError::InvalidTransition(format!(
            "a delivery in state {} cannot be cancelled",
            d.state.as_str()
        )));
    }
    store::transition(&mut tx, &d, Action::Cancel, actor, Some(&reason), json!({})).await?;
    if let Some((job_id, JobState::Available)) = queue::find_live(&mut *tx, &send_key(id)).await? {
        queue::cancel(&mut *tx, job_id, "delivery cancelled").await?;
    }
    if let Some(p) = who {
        audit_delivery(&mut tx, p, "delivery.cancel", &d, Some(&reason), json!({})).await?;
    }
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}
