//! The delivery pipeline's job kinds: `delivery.score` and `delivery.send`.
//!
//! A send runs transaction A (attempt committed, effect marked started), performs the
//! effect with no transaction open, then transaction B (outcome, receipt, job end). A fault
//! point that errors between them leaves the job as a crash would: held until its lease
//! expires, then settled by the rescuer.

use std::sync::Arc;

use airlock_channels::email::{SmtpSender, build_message};
use airlock_channels::webhook::WebhookSender;
use airlock_core::config::Config;
use airlock_core::fault;
use airlock_core::ids::DeliveryId;
use airlock_delivery::artifact::Artifact;
use airlock_delivery::outcome::EffectOutcome;
use airlock_delivery::pipeline::{self, PipelineError, SendOutcome, SendStart};
use airlock_delivery::policy;
use airlock_delivery::scoring::{Judge, Scorer};
use airlock_delivery::state::DeliveryState;
use airlock_queue::{self as queue, Lease, Rescued, Waker};
use sqlx::{PgPool, Postgres, Transaction};

use crate::batch::{BatchFn, Batcher};
use crate::handler::{BoxFuture, Handler, HandlerError, JobContext, Outcome};

fn delivery_id(ctx: &JobContext) -> Result<DeliveryId, HandlerError> {
    ctx.job
        .payload
        .get("delivery_id")
        .and_then(|v| v.as_str())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HandlerError::permanent("payload has no delivery_id"))
}

fn retry(e: PipelineError) -> HandlerError {
    match e {
        PipelineError::Db(_) => HandlerError::retry(e.to_string()),
        other => HandlerError::permanent(other.to_string()),
    }
}

/// Scores persisted deliveries. The score jobs this process runs at the same time are
/// scored together, in one transaction (see [`pipeline::score_many`] and [`Batcher`]).
pub struct ScoreHandler {
    scores: Batcher<(PgPool, Lease, DeliveryId), Result<(), PipelineError>>,
}

/// Batches of one kind in flight at once in one process. One: what arrives while a batch
/// is in flight waits for it and goes in the next, so under load the batches grow and the
/// statements and commits per delivery shrink (with two in flight, most sends went one at
/// a time); alone, a delivery still goes at once.
const BATCHES: usize = 1;

impl ScoreHandler {
    /// Scores with `scorer`, and with `judge` too when one is configured (`scoring.model`).
    pub fn new(config: Arc<Config>, scorer: Arc<dyn Scorer>, judge: Option<Arc<dyn Judge>>) -> Self {
        // Every job of one process is in the same database: a batch runs on the pool of
        // its first job, and the sends it enqueues are announced by one waker on the pool
        // of the first batch.
        let waker = Arc::new(std::sync::OnceLock::<Waker>::new());
        let serve: BatchFn<(PgPool, Lease, DeliveryId), Result<(), PipelineError>> = Arc::new(move |batch| {
            let (config, scorer, judge, waker) = (config.clone(), scorer.clone(), judge.clone(), waker.clone());
            Box::pin(async move {
                let pool = &batch[0].0;
                let waker = waker.get_or_init(|| Waker::new(pool.clone()));
                let items: Vec<(Lease, DeliveryId)> = batch.iter().map(|(_, lease, id)| (*lease, *id)).collect();
                pipeline::score_many(pool, &config, waker, scorer.as_ref(), judge.as_deref(), &items).await
            })
        });
        Self { scores: Batcher::new(pipeline::MAX_SCORE_BATCH, BATCHES, serve) }
    }
}

impl Handler for ScoreHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let scores = self.scores.sender();
        Box::pin(async move {
            let id = delivery_id(&ctx)?;
            let result = scores.call((ctx.pool.clone(), ctx.lease(), id)).await.ok_or_else(stopped)?;
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

fn stopped() -> HandlerError {
    HandlerError::retry("the batcher stopped before answering")
}

/// Sends approved deliveries. The transactions A and B of the sends this process runs at
/// the same time are shared (see [`pipeline::begin_send_many`], [`pipeline::record_many`]).
pub struct SendHandler {
    worker_id: String,
    smtp: Option<SmtpSender>,
    webhook: Option<WebhookSender>,
    starts: Batcher<(PgPool, Lease, DeliveryId), Result<SendStart, PipelineError>>,
    records: Batcher<(PgPool, SendOutcome), Result<DeliveryState, PipelineError>>,
}

impl SendHandler {
    pub fn new(
        config: Arc<Config>,
        worker_id: String,
        smtp: Option<SmtpSender>,
        webhook: Option<WebhookSender>,
    ) -> Self {
        let worker = worker_id.clone();
        let start: BatchFn<(PgPool, Lease, DeliveryId), Result<SendStart, PipelineError>> = Arc::new(move |batch| {
            let (cfg, worker) = (config.clone(), worker.clone());
            Box::pin(async move {
                let items: Vec<(Lease, DeliveryId)> = batch.iter().map(|(_, lease, id)| (*lease, *id)).collect();
                pipeline::begin_send_many(&batch[0].0, &cfg, &worker, &items).await
            })
        });
        let worker = worker_id.clone();
        let record: BatchFn<(PgPool, SendOutcome), Result<DeliveryState, PipelineError>> = Arc::new(move |batch| {
            let worker = worker.clone();
            Box::pin(async move {
                let pool = batch[0].0.clone();
                let items: Vec<SendOutcome> = batch.into_iter().map(|(_, s)| s).collect();
                pipeline::record_many(&pool, &worker, &items).await
            })
        });
        Self {
            worker_id,
            smtp,
            webhook,
            starts: Batcher::new(pipeline::MAX_SEND_BATCH, BATCHES, start),
            records: Batcher::new(pipeline::MAX_SEND_BATCH, BATCHES, record),
        }
    }
}

impl Handler for SendHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let worker = self.worker_id.clone();
        let smtp = self.smtp.clone();
        let webhook = self.webhook.clone();
        let (starts, records) = (self.starts.sender(), self.records.sender());
        Box::pin(async move {
            let id = delivery_id(&ctx)?;
            let lease = ctx.lease();
            let start = starts.call((ctx.pool.clone(), lease, id)).await.ok_or_else(stopped)?;
            let (d, artifact, attempt_id) = match start {
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
                    return match queue::get(&ctx.pool, lease.id()).await {
                        Ok(job) if job.attempt == lease.attempt() && job.effect_started_at.is_none() => {
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
            // Recorded together with the others being recorded at the time; a database error
            // goes through the retrying path alone.
            let s = SendOutcome { lease, delivery: d.clone(), attempt_id, outcome: outcome.clone() };
            let together = records.call((ctx.pool.clone(), s)).await;
            let recorded = match together {
                Some(Err(PipelineError::Db(_))) | None => {
                    pipeline::record_outcome_until_done(
                        &ctx.pool,
                        lease,
                        &worker,
                        &d,
                        attempt_id,
                        &outcome,
                        &ctx.cancel,
                    )
                    .await
                }
                Some(done) => done,
            };
            match recorded {
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
