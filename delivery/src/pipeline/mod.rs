//! The pipeline's operations, each one transaction: what the services and the jobs do to
//! deliveries.
//!
//! - [`submit`]: an agent's submission, persisted with its scoring job in one statement.
//! - [`score`]: scoring and routing to review or approval (a matching grant approves).
//! - [`review`]: a human's accept, edit, approve (bound to the artifact hash) and reject.
//! - [`send`]: the send gate and transaction A (the attempt committed before the effect),
//!   and the global send switch.
//! - [`record`]: transaction B (the outcome, the receipt and the job's end together), and
//!   what follows when the rescuer takes a send job from a holder that vanished.
//! - [`resolve`]: a human's settlement of a parked send, and cancellation.
//!
//! Invariants:
//! - Nothing is written for a refused request (validation happens before the transaction,
//!   and every check inside it aborts the whole transaction).
//! - Each decision is taken in one place for one delivery or many: a single score, start
//!   or record is a batch of one.
//! - A send starts only inside transaction A, after the one send gate ([`send::gate`]):
//!   the switch (read under a share lock), the approval's artifact hash, the sender and the
//!   transport. Transaction B records the outcome, the receipt and the job's end together,
//!   fenced on the lease.

pub mod record;
pub mod resolve;
pub mod review;
pub mod score;
pub mod send;
pub mod submit;

pub use record::{SendOutcome, on_send_rescued, record_many, record_outcome, record_outcome_until_done};
pub use resolve::{Resolution, cancel, resolve};
pub use review::{MAX_BATCH, accept, approve, approve_batch, edit, reject};
pub use score::{MAX_SCORE_BATCH, score, score_many};
pub use send::{MAX_SEND_BATCH, SendStart, begin_send, begin_send_many, set_send_enabled, set_send_enabled_as};
pub use submit::{Submission, submit};

use airlock_core::audit;
use airlock_core::config::Config;
use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::ids::{DeliveryId, RunId};
use airlock_core::principals::Principal;
use airlock_queue::{NewJob, QueueError};
use serde_json::json;
use sqlx::{Postgres, Transaction};

use crate::actor::Actor;
use crate::artifact::{Artifact, Limits, ValidationError};
use crate::policy;
use crate::state::DeliveryState;
use crate::store::{Delivery, DeliveryError};

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
    IdempotencyConflict { run_id: RunId, step_id: String },
    #[error("the run's step budget is spent")]
    BudgetExhausted,
    #[error(transparent)]
    Run(#[from] airlock_runs::RunError),
    #[error("{0}")]
    Forbidden(String),
    /// A recipient nothing may be sent to (see [`crate::suppressions`]).
    #[error("{0}")]
    Suppressed(String),
    /// A limit of `limits.*` is reached; it frees up after `retry_after`.
    #[error("{message}")]
    RateLimited { message: String, retry_after: std::time::Duration },
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
            PipelineError::Run(e) => e.kind(),
            PipelineError::Forbidden(_) => ErrorKind::Forbidden,
            PipelineError::Suppressed(_) => ErrorKind::RecipientSuppressed,
            PipelineError::RateLimited { .. } => ErrorKind::RateLimited,
            PipelineError::Db(_) => ErrorKind::Internal,
        }
    }

    fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            PipelineError::RateLimited { retry_after, .. } => Some(*retry_after),
            PipelineError::Run(e) => e.retry_after(),
            _ => None,
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

impl PipelineError {
    /// The same error for another item of a batch (a shared transaction's failure).
    fn for_each(&self) -> PipelineError {
        match self {
            PipelineError::Db(e) => PipelineError::Db(sqlx::Error::Io(std::io::Error::other(e.to_string()))),
            other => PipelineError::Invalid(other.to_string()),
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

/// Checks an artifact against the sender and origin policy of `cfg`: at submission, at
/// edit time, and again at send time (in the send gate), so a sender or origin removed
/// from the configuration after approval is refused there.
pub fn check_policy(cfg: &Config, artifact: &Artifact) -> Result<(), PipelineError> {
    match artifact {
        Artifact::Email { email } => policy::check_sender(&cfg.delivery.senders, &email.from)
            .map_err(|e| PipelineError::Invalid(format!("email.from: {e}"))),
        Artifact::Webhook { webhook } => policy::check_webhook_url(
            &cfg.delivery.allowed_webhook_origins(),
            &webhook.url,
            cfg.delivery.webhook_allow_plaintext_loopback,
        )
        .map_err(|e| PipelineError::Invalid(format!("webhook.url: {e}"))),
    }
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

/// A human's note or reason ([`airlock_core::text::human_note`]).
fn non_empty(v: Option<&str>, field: &str) -> Result<String, PipelineError> {
    airlock_core::text::human_note(v, field).map(str::to_string).map_err(PipelineError::Invalid)
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

/// The unique key of a delivery's send job: one live send job per delivery.
fn send_key(id: DeliveryId) -> String {
    format!("send:{id}")
}
