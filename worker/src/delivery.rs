//! The delivery pipeline's job kinds: `delivery.score` and `delivery.send`.
//!
//! A send runs transaction A (attempt committed, effect marked started), performs the
//! effect with no transaction open, then transaction B (outcome, receipt, job end). A fault
//! point that errors between them leaves the job as a crash would: held until its lease
//! expires, then settled by the rescuer.

use std::sync::{Arc, OnceLock};

use airlock_core::artifact::Artifact;
use airlock_core::channels::EffectOutcome;
use airlock_core::channels::email::{SmtpSender, build_message};
use airlock_core::channels::webhook::WebhookSender;
use airlock_core::config::Config;
use airlock_core::delivery::pipeline::{self, PipelineError, SendStart};
use airlock_core::fault;
use airlock_core::policy;
use airlock_core::queue::{self, Lease, Rescued};
use airlock_core::scoring::Scorer;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::handler::{BoxFuture, Handler, HandlerError, JobContext, Outcome};

fn delivery_id(ctx: &JobContext) -> Result<Uuid, HandlerError> {
    ctx.job
        .payload
        .get("delivery_id")
        .and_then(|v| v.as_str())
        .and_then(|s| Uuid::parse_str(s).ok())
        .ok_or_else(|| HandlerError::permanent("payload has no delivery_id"))
}

fn retry(e: PipelineError) -> HandlerError {
    match e {
        PipelineError::Db(_) => HandlerError::retry(e.to_string()),
        other => HandlerError::permanent(other.to_string()),
    }
}

/// Scores persisted deliveries. The score jobs this process runs at the same time are
/// scored together, in one transaction (see [`pipeline::score_many`]): a batch takes what
/// is waiting when a batch slot frees up, so a job that comes alone is scored at once.
pub struct ScoreHandler {
    config: Arc<Config>,
    scorer: Arc<dyn Scorer>,
    batches: OnceLock<mpsc::UnboundedSender<ScoreRequest>>,
}

/// Score batches in flight at once in one process.
const SCORE_BATCHES: usize = 2;

/// A score job waiting for its batch. Every job of one process is in the same database,
/// so a batch runs on the pool of its first job.
struct ScoreRequest {
    pool: PgPool,
    lease: Lease,
    delivery_id: Uuid,
    reply: oneshot::Sender<Result<(), PipelineError>>,
}

impl ScoreHandler {
    pub fn new(config: Arc<Config>, scorer: Arc<dyn Scorer>) -> Self {
        Self { config, scorer, batches: OnceLock::new() }
    }

    fn batches(&self) -> &mpsc::UnboundedSender<ScoreRequest> {
        self.batches.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(score_batches(self.config.clone(), self.scorer.clone(), rx));
            tx
        })
    }
}

/// Gathers score jobs into batches, up to [`SCORE_BATCHES`] at once; ends when the
/// handler is gone and every batch has answered.
async fn score_batches(config: Arc<Config>, scorer: Arc<dyn Scorer>, mut rx: mpsc::UnboundedReceiver<ScoreRequest>) {
    let mut running: JoinSet<()> = JoinSet::new();
    let mut open = true;
    while open || !running.is_empty() {
        tokio::select! {
            first = rx.recv(), if open && running.len() < SCORE_BATCHES => {
                let Some(first) = first else {
                    open = false;
                    continue;
                };
                let mut batch = vec![first];
                while batch.len() < pipeline::MAX_SCORE_BATCH {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                let (config, scorer) = (config.clone(), scorer.clone());
                running.spawn(async move {
                    let items: Vec<(Lease, Uuid)> = batch.iter().map(|r| (r.lease, r.delivery_id)).collect();
                    let results = pipeline::score_many(&batch[0].pool, &config, scorer.as_ref(), &items).await;
                    for (r, result) in batch.into_iter().zip(results) {
                        let _ = r.reply.send(result);
                    }
                });
            }
            Some(_) = running.join_next() => {}
        }
    }
}

impl Handler for ScoreHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let batches = self.batches().clone();
        Box::pin(async move {
            let delivery_id = delivery_id(&ctx)?;
            let (reply, answer) = oneshot::channel();
            let request = ScoreRequest { pool: ctx.pool.clone(), lease: ctx.lease(), delivery_id, reply };
            batches.send(request).map_err(|_| HandlerError::retry("the scorer has stopped"))?;
            let result = answer.await.map_err(|_| HandlerError::retry("the scorer has stopped"))?;
            match result {
                Ok(()) => {
                    let _ = fault::hit("score.after_commit").await;
                    Ok(Outcome::Finalized)
                }
                Err(PipelineError::Queue(e)) => Err(HandlerError::retry(e.to_string())),
                Err(e) => Err(retry(e)),
            }
        })
    }
}

/// Sends approved deliveries.
pub struct SendHandler {
    pub config: Arc<Config>,
    pub worker_id: String,
    pub smtp: Option<SmtpSender>,
    pub webhook: Option<WebhookSender>,
}

impl Handler for SendHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let config = self.config.clone();
        let worker = self.worker_id.clone();
        let smtp = self.smtp.clone();
        let webhook = self.webhook.clone();
        Box::pin(async move {
            let id = delivery_id(&ctx)?;
            let lease = ctx.lease();
            let (d, artifact, attempt_id) = match pipeline::begin_send(&ctx.pool, &config, lease, &worker, id).await {
                Ok(SendStart::Started { delivery, artifact, attempt_id }) => (delivery, artifact, attempt_id),
                // Waits in the paused queue until the switch is on again.
                Ok(SendStart::SwitchOff) => return Ok(Outcome::Snooze(std::time::Duration::from_secs(1))),
                Ok(SendStart::Nothing) | Ok(SendStart::Refused(_)) => return Ok(Outcome::Finalized),
                Err(PipelineError::Queue(e)) => return Err(HandlerError::retry(e.to_string())),
                // The COMMIT of transaction A may have gone through although its answer was
                // lost: failing the job then would leave the delivery in `sending` with no job.
                // Retry only when the job shows no effect started under this lease; otherwise
                // the rescuer settles job and delivery together once the lease expires.
                Err(PipelineError::Db(e)) => {
                    return match queue::get(&ctx.pool, lease.id).await {
                        Ok(job) if job.attempt == lease.attempt && job.effect_started_at.is_none() => {
                            Err(HandlerError::retry(e.to_string()))
                        }
                        _ => {
                            tracing::warn!(delivery.id = %id, error = %e, "the attempt may be on record: left to the rescuer");
                            Ok(Outcome::Finalized)
                        }
                    };
                }
                Err(e) => return Err(retry(e)),
            };
            if fault::hit("send.after_attempt_commit").await.is_err() {
                return Ok(Outcome::Finalized);
            }
            // A stall since transaction A (a paused process, a frozen VM) may have outlived the
            // lease, and the rescuer may have settled the delivery meanwhile: the effect starts
            // only under a lease the database clock says is still held. Nothing went out, so a
            // failed check is recorded as not delivered (refused, fenced, when the lease is lost).
            let outcome = match queue::ensure_held(&ctx.pool, lease).await {
                Err(e) => EffectOutcome::NotDelivered {
                    detail: format!("not sent: the lease could not be confirmed before the effect: {e}"),
                    retry_after: None,
                },
                Ok(()) => match &artifact {
                    Artifact::Email { email } => {
                        let message_id = policy::message_id(&d.idempotency_key, &email.from);
                        match (smtp, build_message(email, &message_id)) {
                            (Some(smtp), Ok((envelope, bytes))) => match smtp.send(&envelope, &bytes).await {
                                EffectOutcome::Sent { response, .. } => {
                                    EffectOutcome::Sent { message_id: Some(message_id), response }
                                }
                                other => other,
                            },
                            (None, _) => EffectOutcome::NotDelivered {
                                detail: "no SMTP relay configured".into(),
                                retry_after: None,
                            },
                            (_, Err(e)) => EffectOutcome::Permanent { detail: e.to_string() },
                        }
                    }
                    Artifact::Webhook { webhook: hook } => match webhook {
                        Some(w) => w.send(hook, &d.idempotency_key).await,
                        None => EffectOutcome::NotDelivered {
                            detail: "no webhook signing secret configured".into(),
                            retry_after: None,
                        },
                    },
                },
            };
            tracing::info!(delivery.id = %d.id, outcome = outcome.label(), detail = outcome.detail(), "send attempted");
            if fault::hit("send.after_effect").await.is_err() {
                return Ok(Outcome::Finalized);
            }
            match pipeline::record_outcome_until_done(&ctx.pool, lease, &worker, &d, attempt_id, &outcome, &ctx.cancel)
                .await
            {
                Ok(state) => tracing::info!(delivery.id = %d.id, state = state.as_str(), "send recorded"),
                Err(e) => {
                    // The lease is gone: the rescuer has settled (or will settle) the delivery.
                    tracing::error!(delivery.id = %d.id, error = %e, outcome = outcome.label(), "send outcome not recorded");
                }
            }
            let _ = fault::hit("send.after_receipt_commit").await;
            Ok(Outcome::Finalized)
        })
    }

    fn on_rescued<'a>(
        &'a self,
        tx: &'a mut Transaction<'static, Postgres>,
        rescued: &'a Rescued,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            match pipeline::on_send_rescued(tx, rescued).await {
                Ok(()) => Ok(()),
                Err(PipelineError::Db(e)) => Err(e),
                Err(e) => {
                    tracing::error!(job.id = %rescued.job.id, error = %e, "could not settle a rescued send");
                    Ok(())
                }
            }
        })
    }
}
