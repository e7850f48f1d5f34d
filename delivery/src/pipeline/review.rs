//! A human's review: accept, edit (a new artifact version, recorded), approve (bound to the
//! artifact hash the approver saw, with optional four-eyes) and reject. Each is one
//! transaction, audited.

use airlock_core::config::Config;
use airlock_core::ids::DeliveryId;
use airlock_core::principals::Principal;
use airlock_queue as queue;
use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};

use super::{
    PipelineError, audit_delivery, check_policy, limits, non_empty, require_state, reviewer_actor, send_job_for,
};
use crate::artifact::Artifact;
use crate::state::{Action, DeliveryState};
use crate::store::{self, Delivery};

/// `in_review` → `awaiting_approval`.
pub async fn accept(
    pool: &PgPool,
    who: &Principal,
    id: DeliveryId,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = Some(non_empty(note, "note")?);
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    require_state(&d, &[DeliveryState::InReview], "accepted")?;
    store::transition(&mut tx, &d, Action::Accept, &reviewer_actor(who), note.as_deref(), json!({})).await?;
    store::insert_review(&mut *tx, id, "accept", &who.name, note.as_deref(), &d.artifact_sha256, &d.artifact_sha256)
        .await?;
    audit_delivery(&mut tx, who, "delivery.accept", &d, note.as_deref(), json!({})).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// Replaces the artifact with a reviewer's version (recorded) → `awaiting_approval`.
pub async fn edit(
    pool: &PgPool,
    cfg: &Config,
    who: &Principal,
    id: DeliveryId,
    artifact: &serde_json::Value,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = Some(non_empty(note, "note")?);
    let artifact = Artifact::from_json(artifact, &limits(cfg))?;
    check_policy(cfg, &artifact)?;
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    require_state(&d, &[DeliveryState::InReview, DeliveryState::AwaitingApproval], "edited")?;
    if artifact.channel() != d.channel {
        return Err(PipelineError::Invalid(format!("artifact: the channel must stay {}", d.channel.as_str())));
    }
    let new_sha = store::put_artifact(&mut *tx, &artifact).await?;
    let data = json!({"from_sha256": d.artifact_sha256, "to_sha256": new_sha});
    store::transition(&mut tx, &d, Action::Edit, &reviewer_actor(who), note.as_deref(), data.clone()).await?;
    store::set_artifact(&mut *tx, id, &new_sha).await?;
    store::insert_review(&mut *tx, id, "edit", &who.name, note.as_deref(), &d.artifact_sha256, &new_sha).await?;
    audit_delivery(&mut tx, who, "delivery.edit", &d, note.as_deref(), data).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// `awaiting_approval` → `approved`, bound to the artifact hash the approver saw; enqueues
/// the send (which waits while the switch is off).
pub async fn approve(
    pool: &PgPool,
    cfg: &Config,
    who: &Principal,
    id: DeliveryId,
    artifact_sha256: &str,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = Some(non_empty(note, "note")?);
    let mut tx = pool.begin().await?;
    approve_in(&mut tx, cfg, who, id, artifact_sha256, note.as_deref()).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// The most deliveries one batch approval may hold.
pub const MAX_BATCH: usize = 100;

/// Approves several deliveries, each bound to the hash its approver saw: all or nothing.
pub async fn approve_batch(
    pool: &PgPool,
    cfg: &Config,
    who: &Principal,
    items: &[(DeliveryId, String)],
    note: Option<&str>,
) -> Result<Vec<Delivery>, PipelineError> {
    let note = Some(non_empty(note, "note")?);
    if items.is_empty() || items.len() > MAX_BATCH {
        return Err(PipelineError::Invalid(format!("items: approve 1 to {MAX_BATCH} deliveries at once")));
    }
    let mut seen = std::collections::HashSet::new();
    if !items.iter().all(|(id, _)| seen.insert(*id)) {
        return Err(PipelineError::Invalid("items: a delivery is listed twice".into()));
    }
    // Lock in id order so two overlapping batches cannot deadlock.
    let mut ordered: Vec<&(DeliveryId, String)> = items.iter().collect();
    ordered.sort_by_key(|(id, _)| *id);
    let mut tx = pool.begin().await?;
    for (id, sha) in &ordered {
        approve_in(&mut tx, cfg, who, *id, sha, note.as_deref()).await?;
    }
    let mut out = Vec::with_capacity(items.len());
    for (id, _) in items {
        out.push(store::lock(&mut *tx, *id).await?);
    }
    tx.commit().await?;
    Ok(out)
}

/// The checks and writes of one approval, in the caller's transaction.
async fn approve_in(
    tx: &mut Transaction<'_, Postgres>,
    cfg: &Config,
    who: &Principal,
    id: DeliveryId,
    artifact_sha256: &str,
    note: Option<&str>,
) -> Result<(), PipelineError> {
    let d = store::lock(&mut **tx, id).await?;
    require_state(&d, &[DeliveryState::AwaitingApproval], "approved")?;
    if d.artifact_sha256 != artifact_sha256 {
        return Err(PipelineError::StaleArtifact { current: d.artifact_sha256 });
    }
    if cfg.review.four_eyes && store::edited_by(&mut **tx, id, &d.artifact_sha256).await?.as_deref() == Some(&who.name)
    {
        return Err(PipelineError::Forbidden("four-eyes review: whoever edited this version cannot approve it".into()));
    }
    store::insert_approval(&mut **tx, id, artifact_sha256, Some(&who.name), None, note).await?;
    let data = json!({"artifact_sha256": artifact_sha256});
    store::transition(tx, &d, Action::Approve, &reviewer_actor(who), note, data.clone()).await?;
    queue::enqueue(tx, &send_job_for(cfg, &d)).await?;
    audit_delivery(tx, who, "delivery.approve", &d, note, data).await?;
    Ok(())
}

/// `in_review` or `awaiting_approval` → `rejected`.
pub async fn reject(
    pool: &PgPool,
    who: &Principal,
    id: DeliveryId,
    reason: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let reason = non_empty(reason, "reason")?;
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    require_state(&d, &[DeliveryState::InReview, DeliveryState::AwaitingApproval], "rejected")?;
    store::transition(&mut tx, &d, Action::Reject, &reviewer_actor(who), Some(&reason), json!({})).await?;
    store::insert_review(&mut *tx, id, "reject", &who.name, Some(&reason), &d.artifact_sha256, &d.artifact_sha256)
        .await?;
    audit_delivery(&mut tx, who, "delivery.reject", &d, Some(&reason), json!({})).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}
