//! The `agent.turn` job kind: one execution drives a turn as far as it goes (see
//! [`airlock_agent::engine`]). The engine completes the job itself when the turn pauses for
//! a human (in the transaction that pauses it), so a decision that comes right after always
//! finds the job done and queues a new one.

use std::sync::{Arc, OnceLock};

use airlock_agent::catalogue::Catalogue;
use airlock_agent::tools::Transport;
use airlock_agent::{Drove, Engine, EngineError, TURN_JOB};
use airlock_capsule::archive::DirArchive;
use airlock_core::config::Config;
use airlock_core::ids::TurnId;
use airlock_queue::Waker;

use crate::handler::{BoxFuture, Handler, HandlerError, JobContext, Outcome, Registry};

/// How soon a turn waiting for another turn of its run looks again.
const BUSY_AGAIN: std::time::Duration = std::time::Duration::from_millis(250);

/// Declared HTTP tools reached through the webhook transport: the same allow-list,
/// signatures and limits as a webhook delivery.
pub struct WebhookTransport(pub airlock_channels::webhook::WebhookSender);

impl Transport for WebhookTransport {
    fn post<'a>(
        &'a self,
        url: &'a str,
        body: &'a serde_json::Value,
        idempotency_key: &'a str,
    ) -> airlock_agent::tools::BoxFuture<'a, Result<serde_json::Value, String>> {
        Box::pin(self.0.call_json(url, body, idempotency_key))
    }
}

/// Registers the kind. The catalogue and the models are checked now, so a worker with a
/// tool or model it cannot serve refuses to start.
pub fn register(r: &mut Registry, cfg: &Arc<Config>, transport: Option<Arc<dyn Transport>>) -> anyhow::Result<()> {
    Catalogue::from_config(cfg).map_err(|m| anyhow::anyhow!("tools: {m}"))?;
    for (name, m) in &cfg.models {
        airlock_agent::provider::Provider::new(m).map_err(|e| anyhow::anyhow!("models.{name}: {e}"))?;
    }
    r.register(TURN_JOB, TurnHandler { config: cfg.clone(), transport, engine: Arc::new(OnceLock::new()) });
    Ok(())
}

/// Drives turns; the engine is made on the pool of the first job.
pub struct TurnHandler {
    config: Arc<Config>,
    transport: Option<Arc<dyn Transport>>,
    engine: Arc<OnceLock<Result<Arc<Engine>, String>>>,
}

impl Handler for TurnHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let (config, transport, engine) = (self.config.clone(), self.transport.clone(), self.engine.clone());
        Box::pin(async move {
            let id: TurnId = ctx.job.payload["turn_id"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| HandlerError::permanent("payload.turn_id: not a turn id"))?;
            let engine = engine
                .get_or_init(|| {
                    let archive = Arc::new(DirArchive::new(&config.capsules.store_dir));
                    Engine::new(ctx.pool.clone(), config.clone(), Waker::new(ctx.pool.clone()), archive, transport)
                        .map(Arc::new)
                })
                .clone()
                .map_err(HandlerError::permanent)?;
            match engine.drive(id, ctx.lease(), &ctx.cancel).await {
                Ok(Drove::Ended(_) | Drove::NotMine) => Ok(Outcome::Completed),
                Ok(Drove::Paused | Drove::Waiting) => Ok(Outcome::Finalized),
                // Another turn of the run is being driven: look again shortly, no attempt spent.
                Ok(Drove::Busy) => Ok(Outcome::Snooze(BUSY_AGAIN)),
                Err(EngineError::Stopped) => Err(HandlerError::retry("the worker stopped mid-turn")),
                Err(EngineError::Retry(m)) => {
                    let last = ctx.job.attempt >= ctx.job.max_attempts;
                    if last && !ctx.cancel.is_cancelled() {
                        tracing::warn!(turn.id = %id, error = %m, "turn given up after its job's last attempt");
                        if let Err(e) = engine.give_up(id, &m).await {
                            tracing::warn!(turn.id = %id, error = %e, "could not end the turn");
                        }
                    }
                    Err(HandlerError::retry(m))
                }
            }
        })
    }
}
