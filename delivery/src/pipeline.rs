//! The pipeline's operations, each one transaction: submit, score, review, approve,
//! reject, resolve, cancel, the send switch, and the two transactions around a send.
//!
//! Invariants:
//! - Nothing is written for a refused request (validation happens before the transaction,
//!   and every check inside it aborts the whole transaction).
//! - A send starts only inside transaction A, which re-checks the switch (under a share
//!   lock), the approval's artifact hash, the sender and the transport, records the attempt
//!   and marks the job's effect as started. Transaction B records the outcome, the receipt
//!   and the job's end together, fenced on the lease.

use std::time::Duration;

use serde_json::json;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::artifact::{Artifact, Channel, Limits, ValidationError};
use crate::grants;
use crate::outcome::EffectOutcome;
use crate::policy;
use crate::scoring::Scorer;
use crate::state::{Action, DeliveryState};
use crate::store::{self, Actor, Delivery, DeliveryError, NewDelivery, NewReceipt, Step};
use airlock_core::audit;
use airlock_core::config::Config;
use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::principals::Principal;
use airlock_queue::{self as queue, Lease, NewJob, QueueError, RescueOutcome, Rescued, Waker};

/// Job kinds of the pipeline.
pub const SCORE_JOB: &str = "delivery.score";
pub const SEND_JOB: &str = "delivery.send";
/// The queue of send jobs; paused while the send switch is off.
pub const SEND_QUEUE: &str = "send";

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{0}")]
    InvalidTransition(String),
    #[error("the artifact changed since it was shown: approve the current version ({current})")]
    StaleArtifact { current: String },
    #[error("run {run_id} step {step_id} was already submitted with a different artifact")]
    IdempotencyConflict { run_id: Uuid, step_id: String },
    #[error("the run's step budget is spent")]
    BudgetExhausted,
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    Queue(QueueError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for PipelineError {
    fn kind(&self) -> ErrorKind {
        match self {
            PipelineError::Validation(v) if v.too_large() => ErrorKind::PayloadTooLarge,
            PipelineError::Validation(_) | PipelineError::Invalid(_) => ErrorKind::Validation,
            PipelineError::NotFound(_) => ErrorKind::NotFound,
            PipelineError::InvalidTransition(_) | PipelineError::Queue(_) => ErrorKind::InvalidTransition,
            PipelineError::StaleArtifact { .. } => ErrorKind::StaleArtifact,
            PipelineError::IdempotencyConflict { .. } => ErrorKind::IdempotencyConflict,
            PipelineError::BudgetExhausted => ErrorKind::BudgetExhausted,
            PipelineError::Forbidden(_) => ErrorKind::Forbidden,
            PipelineError::Db(_) => ErrorKind::Internal,
        }
    }
}

impl From<DeliveryError> for PipelineError {
    fn from(e: DeliveryError) -> Self {
        match e {
            DeliveryError::NotFound(_) => PipelineError::NotFound("delivery"),
            DeliveryError::InvalidTransition { .. } => PipelineError::InvalidTransition(e.to_string()),
            DeliveryError::Db(e) => PipelineError::Db(e),
        }
    }
}

impl From<QueueError> for PipelineError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Db(e) => PipelineError::Db(e),
            other => PipelineError::Queue(other),
        }
    }
}

/// The size limits of artifacts, from configuration.
pub fn limits(cfg: &Config) -> Limits {
    Limits {
        max_artifact_bytes: cfg.delivery.max_artifact_bytes,
        max_recipients: cfg.delivery.max_recipients,
        ..Limits::default()
    }
}

/// Generous limits for reading back what was already accepted.
fn stored_limits() -> Limits {
    Limits { max_artifact_bytes: usize::MAX, max_recipients: usize::MAX, ..Limits::default() }
}

/// Checks an artifact against the sender and origin policy (at submission and edit time;
/// the same checks run again at send time).
pub fn check_policy(cfg: &Config, artifact: &Artifact) -> Result<(), PipelineError> {
    match artifact {
        Artifact::Email { email } => policy::check_sender(&cfg.delivery.senders, &email.from)
            .map_err(|e| PipelineError::Invalid(format!("email.from: {e}"))),
        Artifact::Webhook { webhook } => policy::check_webhook_url(
            &cfg.delivery.webhook_origins,
            &webhook.url,
            cfg.delivery.webhook_allow_plaintext_loopback,
        )
        .map_err(|e| PipelineError::Invalid(format!("webhook.url: {e}"))),
    }
}

/// What an agent submits.
#[derive(Debug, Clone)]
pub struct Submission {
    pub run_id: Uuid,
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
            .and_then(|s| Uuid::parse_str(s).ok())
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
    let id = Uuid::now_v7();
    let new = NewDelivery {
        id,
        run_id,
        step_id,
        agent,
        artifact: &s.artifact,
        idempotency_key: &policy::idempotency_key(&run_id, step_id),
        actor: &Actor::new("agent", agent),
    };
    let job = NewJob::new(SCORE_JOB, json!({"delivery_id": id})).unique_key(format!("score:{id}")).priority(50);
    if let Some(d) = store::submit(pool, &new, &job).await? {
        waker.wake(&job.queue);
        tracing::info!(delivery.id = %d.id, run.id = %run_id, "delivery persisted");
        return Ok((d, true));
    }
    // Nothing was written. Said in the order a submission is judged: whose run it is,
    // whether the step has its delivery already, whether a step is left to spend.
    airlock_runs::store::get(pool, run_id.into(), agent).await?.ok_or(PipelineError::NotFound("run"))?;
    match store::find_by_step(pool, run_id, step_id).await? {
        Some(existing) if existing.submitted_sha256 == s.artifact.sha256_hex() => Ok((existing, false)),
        Some(_) => Err(PipelineError::IdempotencyConflict { run_id, step_id: s.step_id }),
        None => Err(PipelineError::BudgetExhausted),
    }
}

/// Scores a persisted delivery and routes it to review or approval; completes the job in
/// the same transaction. A delivery already past `persisted` just completes the job.
pub async fn score(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    lease: Lease,
    delivery_id: Uuid,
) -> Result<(), PipelineError> {
    // A grant that ran out (or was revoked) between choosing it and counting its use is
    // passed over, and the delivery scored again without it.
    let mut passed_over = Vec::new();
    while let Some(grant_id) = score_once(pool, cfg, waker, scorer, lease, delivery_id, &passed_over).await? {
        passed_over.push(grant_id);
    }
    Ok(())
}

/// How scoring routes one delivery: to review below the threshold, else to approval.
struct Routed {
    score: crate::scoring::Score,
    route: Action,
    why: String,
}

fn route(cfg: &Config, scorer: &dyn Scorer, artifact: &Artifact) -> Routed {
    let score = scorer.score(artifact);
    let threshold = cfg.scoring.review_threshold;
    let (route, why) = if score.value < threshold {
        (Action::RouteToReview, format!("score {} is below the review threshold {threshold}", score.value))
    } else {
        (Action::RouteToApproval, format!("score {} is at or above the review threshold {threshold}", score.value))
    };
    Routed { score, route, why }
}

/// The grant that approves a routed delivery, if one matches (never for review).
async fn matching_grant(
    tx: &mut Transaction<'_, Postgres>,
    d: &Delivery,
    artifact: &Artifact,
    r: &Routed,
    passed_over: &[Uuid],
) -> Result<Option<Uuid>, sqlx::Error> {
    match r.route {
        Action::RouteToApproval => grants::find_match(&mut **tx, &d.agent, artifact, r.score.value, passed_over).await,
        _ => Ok(None),
    }
}

/// The moves of one scored delivery: scored, routed, and approved when a grant matched.
fn score_steps<'a>(r: &'a Routed, actor: &'a Actor, grant: Option<(Uuid, &'a Actor)>, sha: &str) -> Vec<Step<'a>> {
    let mut steps = vec![
        Step {
            action: Action::Score,
            actor,
            reason: None,
            data: json!({"score": r.score.value, "reasons": r.score.reasons}),
        },
        Step { action: r.route, actor, reason: Some(&r.why), data: json!({}) },
    ];
    if let Some((grant_id, grant_actor)) = grant {
        steps.push(Step {
            action: Action::Approve,
            actor: grant_actor,
            reason: Some("matched a standing grant"),
            data: json!({"artifact_sha256": sha, "grant_id": grant_id}),
        });
    }
    steps
}

/// One attempt of [`score`]: `Some(grant)` when that grant could not be used after all and
/// nothing was committed.
async fn score_once(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    lease: Lease,
    delivery_id: Uuid,
    passed_over: &[Uuid],
) -> Result<Option<Uuid>, PipelineError> {
    let mut tx = pool.begin().await?;
    let (d, body) = store::lock_with_artifact(&mut *tx, delivery_id).await?;
    if d.state != DeliveryState::Persisted {
        queue::complete(&mut *tx, lease).await?;
        tx.commit().await?;
        return Ok(None);
    }
    let artifact = Artifact::from_json(&body, &stored_limits())?;
    let r = route(cfg, scorer, &artifact);
    let grant = matching_grant(&mut tx, &d, &artifact, &r, passed_over).await?;
    let threshold = cfg.scoring.review_threshold;
    store::insert_score(&mut *tx, d.id, &d.artifact_sha256, r.score.value, &r.score.reasons, scorer.name(), threshold)
        .await?;
    let actor = Actor::system(&format!("scorer.{}", scorer.name()));
    let grant_actor = grant.map(|g| Actor::new("grant", g.to_string()));
    if let Some(grant_id) = grant {
        store::insert_approval(&mut *tx, d.id, &d.artifact_sha256, None, Some(grant_id), None).await?;
    }
    let steps = score_steps(&r, &actor, grant.zip(grant_actor.as_ref()), &d.artifact_sha256);
    let moved = store::advance(&mut tx, &d, &steps).await?;
    if grant.is_some() {
        queue::enqueue_many_quiet(&mut tx, &[send_job_for(cfg, &moved)]).await?;
    }
    queue::complete(&mut *tx, lease).await?;
    // Last, so the grant's row stays locked only for the commit: every delivery it approves
    // counts its use on that one row.
    if let Some(grant_id) = grant
        && !grants::consume(&mut *tx, grant_id).await?
    {
        tx.rollback().await?;
        return Ok(Some(grant_id));
    }
    airlock_core::fault::hit("score.before_commit").await.map_err(|e| PipelineError::Invalid(e.to_string()))?;
    tx.commit().await?;
    if grant.is_some() {
        waker.wake(SEND_QUEUE);
    }
    Ok(None)
}

/// The most deliveries [`score_many`] scores in one transaction.
pub const MAX_SCORE_BATCH: usize = 32;

/// Scores several deliveries, each under its own job's lease: one transaction for all of
/// them when it can commit as a whole (every lease still held, every grant with uses
/// enough for all the deliveries it approves), else one [`score`] each. A grant's uses are
/// then counted once per transaction, not once per delivery, so deliveries approved by one
/// grant no longer queue on its row one commit at a time. Results are in input order.
pub async fn score_many(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    items: &[(Lease, Uuid)],
) -> Vec<Result<(), PipelineError>> {
    if items.len() > 1 {
        match score_together(pool, cfg, waker, scorer, items).await {
            Ok(true) => return items.iter().map(|_| Ok(())).collect(),
            Ok(false) => tracing::debug!(jobs = items.len(), "scoring together refused; scoring one by one"),
            Err(e) => tracing::debug!(jobs = items.len(), error = %e, "scoring together failed; scoring one by one"),
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for (lease, id) in items {
        out.push(score(pool, cfg, waker, scorer, *lease, *id).await);
    }
    out
}

/// The one transaction of [`score_many`]; false (nothing committed) when it cannot hold
/// for every delivery.
async fn score_together(
    pool: &PgPool,
    cfg: &Config,
    waker: &Waker,
    scorer: &dyn Scorer,
    items: &[(Lease, Uuid)],
) -> Result<bool, PipelineError> {
    let ids: Vec<Uuid> = items.iter().map(|(_, id)| *id).collect();
    let mut tx = pool.begin().await?;
    let locked = store::lock_many_with_artifact(&mut *tx, &ids).await?;
    if locked.len() != items.len() {
        return Ok(false);
    }
    let mut scored = Vec::with_capacity(locked.len());
    for (d, body) in &locked {
        if d.state != DeliveryState::Persisted {
            continue;
        }
        let artifact = Artifact::from_json(body, &stored_limits())?;
        let r = route(cfg, scorer, &artifact);
        let grant = matching_grant(&mut tx, d, &artifact, &r, &[]).await?;
        scored.push((d, r, grant.map(|g| (g, Actor::new("grant", g.to_string())))));
    }
    let threshold = cfg.scoring.review_threshold;
    let scores: Vec<store::NewScore> = scored
        .iter()
        .map(|(d, r, _)| store::NewScore {
            delivery_id: d.id,
            artifact_sha256: &d.artifact_sha256,
            value: r.score.value,
            reasons: &r.score.reasons,
            scorer: scorer.name(),
            threshold,
        })
        .collect();
    store::insert_scores(&mut *tx, &scores).await?;
    let approvals: Vec<store::NewApproval> = scored
        .iter()
        .filter_map(|(d, _, g)| g.as_ref().map(|(grant_id, _)| (d, *grant_id)))
        .map(|(d, grant_id)| store::NewApproval {
            delivery_id: d.id,
            artifact_sha256: &d.artifact_sha256,
            approver: None,
            grant_id: Some(grant_id),
            note: None,
        })
        .collect();
    store::insert_approvals(&mut *tx, &approvals).await?;
    let actor = Actor::system(&format!("scorer.{}", scorer.name()));
    let steps: Vec<Vec<Step>> = scored
        .iter()
        .map(|(d, r, g)| score_steps(r, &actor, g.as_ref().map(|(id, a)| (*id, a)), &d.artifact_sha256))
        .collect();
    let moves: Vec<(&Delivery, &[Step])> = scored.iter().zip(&steps).map(|((d, _, _), s)| (*d, s.as_slice())).collect();
    let moved = store::advance_many(&mut tx, &moves).await?;
    let sends: Vec<NewJob> =
        moved.iter().zip(&scored).filter(|(_, (_, _, g))| g.is_some()).map(|(d, _)| send_job_for(cfg, d)).collect();
    queue::enqueue_many_quiet(&mut tx, &sends).await?;
    let leases: Vec<Lease> = items.iter().map(|(lease, _)| *lease).collect();
    if queue::complete_many(&mut *tx, &leases).await?.len() != leases.len() {
        return Ok(false);
    }
    // Last, in id order, as in [`score_once`]: each grant's row is locked only for the commit.
    let mut uses = std::collections::BTreeMap::<Uuid, i32>::new();
    for (grant_id, _) in scored.iter().filter_map(|(_, _, g)| g.as_ref()) {
        *uses.entry(*grant_id).or_default() += 1;
    }
    for (grant_id, n) in uses {
        if !grants::consume_many(&mut *tx, grant_id, n).await? {
            return Ok(false);
        }
    }
    airlock_core::fault::hit("score.before_commit").await.map_err(|e| PipelineError::Invalid(e.to_string()))?;
    tx.commit().await?;
    if !sends.is_empty() {
        waker.wake(SEND_QUEUE);
    }
    Ok(true)
}

fn reviewer_actor(p: &Principal) -> Actor {
    Actor::new(p.role.as_str(), p.name.clone())
}

fn require_state(d: &Delivery, allowed: &[DeliveryState], what: &str) -> Result<(), PipelineError> {
    if allowed.contains(&d.state) {
        Ok(())
    } else {
        Err(PipelineError::InvalidTransition(format!("a delivery in state {} cannot be {what}", d.state.as_str())))
    }
}

fn non_empty(v: Option<&str>, field: &str) -> Result<String, PipelineError> {
    match v.map(str::trim) {
        Some(s) if !s.is_empty() && s.len() <= 2000 => Ok(s.to_string()),
        _ => Err(PipelineError::Invalid(format!("{field}: a reason of 1 to 2000 characters is required"))),
    }
}

fn optional_note(v: Option<&str>) -> Result<Option<String>, PipelineError> {
    match v.map(str::trim) {
        Some(s) if s.len() > 2000 => Err(PipelineError::Invalid("note: at most 2000 characters".into())),
        Some("") | None => Ok(None),
        Some(s) => Ok(Some(s.to_string())),
    }
}

async fn audit_delivery(
    tx: &mut Transaction<'_, Postgres>,
    who: &Principal,
    action: &str,
    d: &Delivery,
    reason: Option<&str>,
    data: serde_json::Value,
) -> Result<(), sqlx::Error> {
    audit::record(tx, who, audit::Action { action, target_kind: "delivery", target_id: d.id.to_string(), reason, data })
        .await
}

/// `in_review` → `awaiting_approval`.
pub async fn accept(pool: &PgPool, who: &Principal, id: Uuid, note: Option<&str>) -> Result<Delivery, PipelineError> {
    let note = optional_note(note)?;
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
    id: Uuid,
    artifact: &serde_json::Value,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = optional_note(note)?;
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
    id: Uuid,
    artifact_sha256: &str,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = optional_note(note)?;
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
    items: &[(Uuid, String)],
    note: Option<&str>,
) -> Result<Vec<Delivery>, PipelineError> {
    let note = optional_note(note)?;
    if items.is_empty() || items.len() > MAX_BATCH {
        return Err(PipelineError::Invalid(format!("items: approve 1 to {MAX_BATCH} deliveries at once")));
    }
    let mut seen = std::collections::HashSet::new();
    if !items.iter().all(|(id, _)| seen.insert(*id)) {
        return Err(PipelineError::Invalid("items: a delivery is listed twice".into()));
    }
    // Lock in id order so two overlapping batches cannot deadlock.
    let mut ordered: Vec<&(Uuid, String)> = items.iter().collect();
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
    id: Uuid,
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
    enqueue_send(tx, cfg, &d).await?;
    audit_delivery(tx, who, "delivery.approve", &d, note, data).await?;
    Ok(())
}

async fn enqueue_send(tx: &mut Transaction<'_, Postgres>, cfg: &Config, d: &Delivery) -> Result<(), QueueError> {
    queue::enqueue(tx, &send_job_for(cfg, d)).await?;
    Ok(())
}

/// The send job of an approved delivery.
fn send_job_for(cfg: &Config, d: &Delivery) -> NewJob {
    NewJob::new(SEND_JOB, json!({"delivery_id": d.id}))
        .queue(SEND_QUEUE)
        .effect_class(d.effect_class)
        .max_attempts(cfg.delivery.max_send_attempts)
        .unique_key(send_key(d.id))
        // Ahead of scoring: what is approved goes out before new work is taken on, so a
        // backlog of submissions does not hold back the sends behind it.
        .priority(40)
}

fn send_key(id: Uuid) -> String {
    format!("send:{id}")
}

/// `in_review` or `awaiting_approval` → `rejected`.
pub async fn reject(pool: &PgPool, who: &Principal, id: Uuid, reason: Option<&str>) -> Result<Delivery, PipelineError> {
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

/// The live send job of a delivery, if any.
async fn send_job(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
) -> Result<Option<(Uuid, queue::JobState)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, state FROM jobs WHERE unique_key = $1 AND state IN ('available', 'running', 'parked') LIMIT 1",
    )
    .bind(send_key(id))
    .fetch_optional(&mut **tx)
    .await
}

/// Settles a `parked` delivery.
pub async fn resolve(
    pool: &PgPool,
    cfg: &Config,
    who: &Principal,
    id: Uuid,
    resolution: Resolution,
    note: Option<&str>,
) -> Result<Delivery, PipelineError> {
    let note = non_empty(note, "note")?;
    let mut tx = pool.begin().await?;
    let d = store::lock(&mut *tx, id).await?;
    require_state(&d, &[DeliveryState::Parked], "resolved")?;
    let job = send_job(&mut tx, id).await?;
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
                settle_parked_job(&mut tx, job_id, "completed", &note).await?;
            }
        }
        Resolution::Resend => {
            store::transition(&mut tx, &d, Action::ResolveResend, &actor, Some(&note), data.clone()).await?;
            match job {
                Some((job_id, queue::JobState::Parked)) => queue::retry_now(&mut *tx, job_id).await?,
                Some(_) => {}
                None => enqueue_send(&mut tx, cfg, &d).await?,
            }
        }
        Resolution::Cancel => {
            store::transition(&mut tx, &d, Action::ResolveCancel, &actor, Some(&note), data.clone()).await?;
            if let Some((job_id, _)) = job {
                settle_parked_job(&mut tx, job_id, "cancelled", &note).await?;
            }
        }
    }
    audit_delivery(&mut tx, who, "delivery.resolve", &d, Some(&note), data).await?;
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// Ends a parked job by a human's decision.
async fn settle_parked_job(
    tx: &mut Transaction<'_, Postgres>,
    job_id: Uuid,
    state: &str,
    note: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"UPDATE jobs SET state = $2::job_state, finished_at = now(), effect_started_at = NULL, last_error = $3
           WHERE id = $1 AND state = 'parked'"#,
    )
    .bind(job_id)
    .bind(state)
    .bind(format!("settled by a human: {note}"))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Cancels a delivery that has not started sending (by its agent or an operator).
pub async fn cancel(
    pool: &PgPool,
    actor: &Actor,
    who: Option<&Principal>,
    id: Uuid,
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
    if let Some((job_id, queue::JobState::Available)) = send_job(&mut tx, id).await? {
        queue::cancel(&mut *tx, job_id, "delivery cancelled").await?;
    }
    if let Some(p) = who {
        audit_delivery(&mut tx, p, "delivery.cancel", &d, Some(&reason), json!({})).await?;
    }
    let d = store::lock(&mut *tx, id).await?;
    tx.commit().await?;
    Ok(d)
}

/// Flips the global send switch (audited). Off pauses the send queue in the same
/// transaction; a send whose transaction A has not committed yet will see the flip.
pub async fn set_send_enabled(
    pool: &PgPool,
    who: &Principal,
    enabled: bool,
    reason: Option<&str>,
) -> Result<store::SendSwitch, PipelineError> {
    let reason = non_empty(reason, "reason")?;
    let mut tx = pool.begin().await?;
    let s = store::set_send_switch(&mut *tx, enabled, &who.name, &reason).await?;
    if enabled {
        queue::resume_queue(&mut *tx, SEND_QUEUE).await?;
    } else {
        queue::pause_queue(&mut *tx, SEND_QUEUE, "send switch off").await?;
    }
    audit::record(
        &mut tx,
        who,
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
    tracing::warn!(enabled, by = %who.name, "send switch flipped");
    Ok(s)
}

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

/// Transaction A of a send.
pub async fn begin_send(
    pool: &PgPool,
    cfg: &Config,
    lease: Lease,
    worker: &str,
    delivery_id: Uuid,
) -> Result<SendStart, PipelineError> {
    let mut tx = pool.begin().await?;
    let Some(read) = store::read_for_send(&mut *tx, delivery_id).await? else {
        return if store::send_enabled_locked(&mut *tx).await? {
            Err(PipelineError::NotFound("delivery"))
        } else {
            Ok(SendStart::SwitchOff)
        };
    };
    if !read.send_enabled {
        return Ok(SendStart::SwitchOff);
    }
    let (d, approved) = (read.delivery, read.approved_sha256);
    let actor = Actor::new("worker", worker);
    if d.state != DeliveryState::Approved {
        queue::complete(&mut *tx, lease).await?;
        tx.commit().await?;
        return Ok(SendStart::Nothing);
    }
    let artifact = Artifact::from_json(&read.artifact_body, &stored_limits())?;
    let refusal = if approved.as_deref() != Some(d.artifact_sha256.as_str()) {
        Some("no approval matches the current artifact".to_string())
    } else {
        check_policy(cfg, &artifact).err().map(|e| e.to_string())
    };
    if let Some(why) = refusal {
        queue::fail(&mut *tx, lease, &why, true, None).await?;
        store::transition(&mut tx, &d, Action::FailPermanent, &actor, Some(&why), json!({})).await?;
        tx.commit().await?;
        tracing::warn!(delivery.id = %d.id, reason = %why, "send refused at send time");
        return Ok(SendStart::Refused(why));
    }
    let attempt_id = store::start_attempt(&mut *tx, d.id, lease, worker, &d.artifact_sha256)
        .await?
        .ok_or(QueueError::lost(lease))?;
    let delivery =
        store::transition(&mut tx, &d, Action::StartSend, &actor, None, started_data(attempt_id, lease)).await?;
    tx.commit().await?;
    Ok(SendStart::Started { delivery, artifact, attempt_id })
}

/// What the event of a started send carries.
fn started_data(attempt_id: Uuid, lease: Lease) -> serde_json::Value {
    json!({"attempt_id": attempt_id, "job_attempt": lease.attempt})
}

/// The most sends [`begin_send_many`] or [`record_sent_many`] take in one transaction.
pub const MAX_SEND_BATCH: usize = 32;

/// [`begin_send`] for several sends, each under its own job's lease: one transaction A for
/// all of them in the common case (the switch on, every delivery approved as it stands and
/// allowed by policy, every lease held), else one [`begin_send`] each, which decides every
/// other case. Results are in input order.
pub async fn begin_send_many(
    pool: &PgPool,
    cfg: &Config,
    worker: &str,
    items: &[(Lease, Uuid)],
) -> Vec<Result<SendStart, PipelineError>> {
    if items.len() > 1 {
        match begin_sends_together(pool, cfg, worker, items).await {
            Ok(Some(started)) => return started.into_iter().map(Ok).collect(),
            Ok(None) => tracing::debug!(jobs = items.len(), "sends not started together; one by one"),
            // The COMMIT failed, or its answer was lost: the attempts may be on record, so
            // starting them again one by one could send twice. Each caller gets the error, as
            // from its own transaction A, and checks its job before retrying.
            Err(e) => {
                let e = e.to_string();
                return items
                    .iter()
                    .map(|_| Err(PipelineError::Db(sqlx::Error::Io(std::io::Error::other(e.clone())))))
                    .collect();
            }
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for (lease, id) in items {
        out.push(begin_send(pool, cfg, *lease, worker, *id).await);
    }
    out
}

/// The one transaction A of [`begin_send_many`]: `None` when nothing was committed (outside
/// the common case, or a failure before the COMMIT); an error only from the COMMIT itself.
async fn begin_sends_together(
    pool: &PgPool,
    cfg: &Config,
    worker: &str,
    items: &[(Lease, Uuid)],
) -> Result<Option<Vec<SendStart>>, PipelineError> {
    let Ok(mut tx) = pool.begin().await else {
        return Ok(None);
    };
    match start_in(&mut tx, cfg, worker, items).await {
        Ok(Some(started)) => {
            tx.commit().await?;
            Ok(Some(started))
        }
        Ok(None) => Ok(None),
        Err(e) => {
            tracing::debug!(jobs = items.len(), error = %e, "starting sends together failed");
            Ok(None)
        }
    }
}

/// The checks and writes of [`begin_sends_together`], in its transaction.
async fn start_in(
    tx: &mut Transaction<'_, Postgres>,
    cfg: &Config,
    worker: &str,
    items: &[(Lease, Uuid)],
) -> Result<Option<Vec<SendStart>>, PipelineError> {
    let ids: Vec<Uuid> = items.iter().map(|(_, id)| *id).collect();
    let mut reads: std::collections::HashMap<Uuid, store::ForSend> =
        store::read_for_send_many(&mut **tx, &ids).await?.into_iter().map(|r| (r.delivery.id, r)).collect();
    let mut ready = Vec::with_capacity(items.len());
    for (lease, id) in items {
        let Some(read) = reads.remove(id) else {
            return Ok(None);
        };
        let d = read.delivery;
        if !read.send_enabled
            || d.state != DeliveryState::Approved
            || read.approved_sha256.as_deref() != Some(d.artifact_sha256.as_str())
        {
            return Ok(None);
        }
        let artifact = Artifact::from_json(&read.artifact_body, &stored_limits())?;
        if check_policy(cfg, &artifact).is_err() {
            return Ok(None);
        }
        ready.push((*lease, d, artifact, Uuid::now_v7()));
    }
    let attempts: Vec<store::NewAttempt> = ready
        .iter()
        .map(|(lease, d, _, attempt_id)| store::NewAttempt {
            id: *attempt_id,
            delivery_id: d.id,
            lease: *lease,
            artifact_sha256: &d.artifact_sha256,
        })
        .collect();
    if store::start_attempts(&mut **tx, worker, &attempts).await? != attempts.len() {
        return Ok(None);
    }
    let actor = Actor::new("worker", worker);
    let steps: Vec<[Step; 1]> = ready
        .iter()
        .map(|(lease, _, _, attempt_id)| {
            [Step { action: Action::StartSend, actor: &actor, reason: None, data: started_data(*attempt_id, *lease) }]
        })
        .collect();
    let moves: Vec<(&Delivery, &[Step])> =
        ready.iter().zip(&steps).map(|((_, d, _, _), s)| (d, s.as_slice())).collect();
    let moved = store::advance_many(tx, &moves).await?;
    Ok(Some(
        moved
            .into_iter()
            .zip(ready)
            .map(|(delivery, (_, _, artifact, attempt_id))| SendStart::Started { delivery, artifact, attempt_id })
            .collect(),
    ))
}

/// One send whose outcome is to be recorded: as [`record_outcome`] takes it.
#[derive(Debug, Clone)]
pub struct SendOutcome {
    pub lease: Lease,
    pub delivery: Delivery,
    pub attempt_id: Uuid,
    pub outcome: EffectOutcome,
}

/// [`record_outcome`] for several sends: one transaction B for all of them when every one
/// went out and every lease is still held, else one [`record_outcome`] each. Results are
/// in input order.
pub async fn record_sent_many(
    pool: &PgPool,
    worker: &str,
    items: &[SendOutcome],
) -> Vec<Result<DeliveryState, PipelineError>> {
    if items.len() > 1 {
        match record_sent_together(pool, worker, items).await {
            Ok(true) => return items.iter().map(|_| Ok(DeliveryState::Sent)).collect(),
            Ok(false) => tracing::debug!(jobs = items.len(), "outcomes not recorded together; one by one"),
            Err(e) => tracing::debug!(jobs = items.len(), error = %e, "recording outcomes together failed; one by one"),
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for s in items {
        out.push(record_outcome(pool, s.lease, worker, &s.delivery, s.attempt_id, &s.outcome).await);
    }
    out
}

/// The one transaction B of [`record_sent_many`]; false (nothing committed) unless every
/// send went out and every lease held.
async fn record_sent_together(pool: &PgPool, worker: &str, items: &[SendOutcome]) -> Result<bool, PipelineError> {
    let mut sent = Vec::with_capacity(items.len());
    for s in items {
        let EffectOutcome::Sent { message_id, response } = &s.outcome else {
            return Ok(false);
        };
        let receipt = sent_receipt(s.lease, worker, &s.delivery, s.attempt_id, message_id.as_deref(), response);
        sent.push((s.lease, receipt, s.outcome.detail()));
    }
    // Jobs first, then deliveries, as one transaction B at a time takes them.
    let mut tx = pool.begin().await?;
    if store::complete_sent_many(&mut *tx, &sent).await? != sent.len() {
        return Ok(false);
    }
    let actor = Actor::new("worker", worker);
    let mut by_id: Vec<&SendOutcome> = items.iter().collect();
    by_id.sort_by_key(|s| s.delivery.id);
    let steps: Vec<[Step; 1]> = by_id
        .iter()
        .map(|s| {
            [Step {
                action: Action::ConfirmSent,
                actor: &actor,
                reason: None,
                data: json!({"attempt_id": s.attempt_id}),
            }]
        })
        .collect();
    let moves: Vec<(&Delivery, &[Step])> =
        by_id.iter().zip(&steps).map(|(s, st)| (&s.delivery, st.as_slice())).collect();
    store::advance_many(&mut tx, &moves).await?;
    tx.commit().await?;
    for s in items {
        count_recorded(&s.delivery, &s.outcome, DeliveryState::Sent);
    }
    Ok(true)
}

/// Transaction B of a send: the attempt's outcome, the receipt and the job's end,
/// together. Fenced on the lease: a holder that lost it changes nothing.
pub async fn record_outcome(
    pool: &PgPool,
    lease: Lease,
    worker: &str,
    d: &Delivery,
    attempt_id: Uuid,
    outcome: &EffectOutcome,
) -> Result<DeliveryState, PipelineError> {
    let mut tx = pool.begin().await?;
    let actor = Actor::new("worker", worker);
    let detail = outcome.detail();
    let (action, reason): (Action, Option<String>) = match outcome {
        EffectOutcome::Sent { message_id, response } => {
            let receipt = sent_receipt(lease, worker, d, attempt_id, message_id.as_deref(), response);
            if !store::complete_sent(&mut *tx, lease, &receipt, detail).await? {
                return Err(QueueError::lost(lease).into());
            }
            (Action::ConfirmSent, None)
        }
        EffectOutcome::NotDelivered { detail, retry_after } => {
            match queue::fail(&mut *tx, lease, detail, false, *retry_after).await? {
                queue::FailOutcome::Retry => (Action::RetryLater, Some(format!("not delivered, will retry: {detail}"))),
                queue::FailOutcome::Failed => {
                    (Action::FailPermanent, Some(format!("not delivered, attempts exhausted: {detail}")))
                }
            }
        }
        EffectOutcome::Permanent { detail } => {
            queue::fail(&mut *tx, lease, detail, true, None).await?;
            (Action::FailPermanent, Some(format!("refused for good: {detail}")))
        }
        EffectOutcome::Ambiguous { detail } => {
            queue::park(&mut *tx, lease, detail).await?;
            (Action::Park, Some(format!("may or may not have been delivered: {detail}")))
        }
    };
    // A sent delivery's attempt was closed by `complete_sent`, with its receipt.
    if !matches!(outcome, EffectOutcome::Sent { .. }) {
        store::finish_attempt(&mut *tx, attempt_id, outcome.label(), Some(detail)).await?;
    }
    // `d` is the delivery as transaction A left it; the transition's guard refuses it if it
    // changed since (and the lease fence above refuses a holder that lost the job first).
    let state = store::transition(&mut tx, d, action, &actor, reason.as_deref(), json!({"attempt_id": attempt_id}))
        .await?
        .state;
    tx.commit().await?;
    count_recorded(d, outcome, state);
    Ok(state)
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
        attempt: lease.attempt,
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
    let Some(id) = r.job.payload.get("delivery_id").and_then(|v| v.as_str()).and_then(|s| Uuid::parse_str(s).ok())
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
