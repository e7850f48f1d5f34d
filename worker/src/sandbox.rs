//! The sandbox job kinds: `sandbox.select` (decide a task's tier) and `sandbox.run` (run
//! it through a provider and record the outcome).
//!
//! A select is one transaction (decision, task move, next job, job completion): a worker
//! lost before its commit leaves nothing, and the rescuer runs it again. A run commits its
//! start, runs the command with no transaction open (the runtime's heartbeats keep the
//! lease), then commits the outcome with the job's completion. A worker lost in between
//! leaves the job to the rescuer, which reruns it per its effect class (`pure` or
//! `idempotent`, as the task declared); the run it lost is closed as `lost`.

use std::sync::Arc;
use std::time::Duration;

use airlock_core::config::Config;
use airlock_core::config::sandbox::Isolation;
use airlock_core::secret::Keyring;
use airlock_queue::{EffectClass, Rescued};
use airlock_sandbox::SandboxError;
use airlock_sandbox::context;
use airlock_sandbox::local::LocalProvider;
use airlock_sandbox::provider::{BoxFuture as ProviderFuture, Provider, ProviderError, RunOutcome, RunSpec};
use airlock_sandbox::service::{self, RunStart};
use airlock_sandbox::store;
use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use crate::handler::{BoxFuture, Handler, HandlerError, JobContext, Outcome, Registry};

/// Whether this worker claims sandbox jobs (`worker.queues` empty, or naming `sandbox`).
pub fn serves_sandbox(cfg: &Config) -> bool {
    cfg.worker.queues.is_empty() || cfg.worker.queues.iter().any(|q| q == service::QUEUE)
}

/// Registers both kinds with the built-in `local` provider and the host keyring. A worker
/// that runs sandbox jobs first checks that this machine isolates runs as configured, and
/// refuses to start (the error names the cause and the setting) when it does not. A
/// worker that does not claim them registers the kinds only for the rescuer's hooks.
pub fn register(r: &mut Registry, cfg: &Arc<Config>, worker_id: &str) -> anyhow::Result<()> {
    let keyring = airlock_core::secret::host_keyring(&cfg.capsules);
    let provider: Arc<dyn Provider> = if serves_sandbox(cfg) {
        let protected = airlock_sandbox::network::protected_endpoints(cfg);
        let p = LocalProvider::from_config(&cfg.sandbox, protected).map_err(|e| anyhow::anyhow!("{e}"))?;
        tracing::info!(isolation = p.isolation().as_str(), "sandbox runs ready");
        Arc::new(p)
    } else {
        Arc::new(NotServed)
    };
    register_with(r, cfg, worker_id, provider, keyring);
    Ok(())
}

/// The provider of a worker that does not claim sandbox jobs: it never runs one.
struct NotServed;

impl Provider for NotServed {
    fn name(&self) -> &'static str {
        "none"
    }

    fn run(
        &self,
        _spec: RunSpec,
        _cancel: tokio_util::sync::CancellationToken,
    ) -> ProviderFuture<'static, Result<RunOutcome, ProviderError>> {
        Box::pin(async { Err(ProviderError::Refused("this worker does not serve the sandbox queue".into())) })
    }
}

/// Registers both kinds with a given provider and keyring.
pub fn register_with(
    r: &mut Registry,
    cfg: &Arc<Config>,
    worker_id: &str,
    provider: Arc<dyn Provider>,
    keyring: Arc<dyn Keyring>,
) {
    r.register(service::SELECT_JOB, SelectHandler { config: cfg.clone() });
    r.register(
        service::RUN_JOB,
        RunHandler { config: cfg.clone(), worker_id: worker_id.to_string(), provider, keyring },
    );
}

/// A database or lease problem is worth another attempt; anything else is not.
fn handler_error(e: SandboxError) -> HandlerError {
    match e {
        SandboxError::Db(_) | SandboxError::Queue(_) => HandlerError::retry(e.to_string()),
        other => HandlerError::permanent(other.to_string()),
    }
}

/// Ends the task when its job is about to fail for good (a permanent error, or the last
/// attempt), so no task waits forever behind a failed job. Not when the worker is stopping
/// or the lease is lost: then the job runs again elsewhere.
async fn settle_failure(ctx: &JobContext, task_id: Uuid, e: HandlerError) -> Result<Outcome, HandlerError> {
    let last = e.permanent || ctx.job.attempt >= ctx.job.max_attempts;
    if !last || ctx.cancel.is_cancelled() {
        return Err(e);
    }
    match service::give_up(&ctx.pool, ctx.lease(), task_id, &e.message).await {
        Ok(()) => {
            tracing::warn!(task.id = %task_id, error = %e.message, "sandbox task given up");
            Ok(Outcome::Finalized)
        }
        Err(g) => {
            tracing::warn!(task.id = %task_id, error = %g, "could not give the task up");
            Err(e)
        }
    }
}

/// Decides tiers.
pub struct SelectHandler {
    pub config: Arc<Config>,
}

impl Handler for SelectHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let config = self.config.clone();
        Box::pin(async move {
            let task_id = service::job_task_id(&ctx.job.payload).map_err(handler_error)?;
            match service::select(&ctx.pool, &config.sandbox, ctx.lease(), task_id).await {
                Ok(_) => Ok(Outcome::Finalized),
                Err(e) => settle_failure(&ctx, task_id, handler_error(e)).await,
            }
        })
    }

    fn on_rescued<'a>(
        &'a self,
        tx: &'a mut Transaction<'static, Postgres>,
        rescued: &'a Rescued,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move { settle_rescued(service::on_select_rescued(tx, rescued).await, rescued) })
    }
}

fn settle_rescued(r: Result<(), SandboxError>, rescued: &Rescued) -> Result<(), sqlx::Error> {
    match r {
        Ok(()) => Ok(()),
        Err(SandboxError::Db(e)) => Err(e),
        Err(e) => {
            tracing::error!(job.id = %rescued.job.id, error = %e, "could not settle a rescued sandbox job");
            Ok(())
        }
    }
}

/// Runs tasks in their chosen tier.
pub struct RunHandler {
    pub config: Arc<Config>,
    pub worker_id: String,
    pub provider: Arc<dyn Provider>,
    pub keyring: Arc<dyn Keyring>,
}

impl Handler for RunHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let config = self.config.clone();
        let worker = self.worker_id.clone();
        let provider = self.provider.clone();
        let keyring = self.keyring.clone();
        Box::pin(async move {
            let task_id = service::job_task_id(&ctx.job.payload).map_err(handler_error)?;
            match run_task(&ctx, &config, &worker, provider.as_ref(), keyring.as_ref(), task_id).await {
                Ok(o) => Ok(o),
                Err(e) => settle_failure(&ctx, task_id, e).await,
            }
        })
    }

    fn on_rescued<'a>(
        &'a self,
        tx: &'a mut Transaction<'static, Postgres>,
        rescued: &'a Rescued,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move { settle_rescued(service::on_run_rescued(tx, rescued).await, rescued) })
    }
}

/// One run: secrets and context, the recorded start, the command, the recorded outcome.
async fn run_task(
    ctx: &JobContext,
    config: &Config,
    worker: &str,
    provider: &dyn Provider,
    keyring: &dyn Keyring,
    task_id: Uuid,
) -> Result<Outcome, HandlerError> {
    let lease = ctx.lease();
    // A task's spec never changes after submission, so its secrets and context are gathered
    // before the start is recorded: after that, only the sandbox itself can fail.
    let task = store::get_task(&ctx.pool, task_id)
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?
        .ok_or_else(|| HandlerError::permanent(format!("task {task_id} not found")))?;
    let mut secrets = Vec::with_capacity(task.secrets.len());
    for name in &task.secrets {
        match keyring.get(name) {
            Some(v) => secrets.push((name.clone(), v)),
            None => return Err(HandlerError::permanent(format!("secret `{name}` is not in this worker's keyring"))),
        }
    }
    let files = context::load(&ctx.pool, &task.context).await.map_err(|e| HandlerError::retry(e.to_string()))?;
    let plan = match service::begin_run(&ctx.pool, lease, worker, task_id).await.map_err(handler_error)? {
        RunStart::Run(plan) => plan,
        RunStart::Nothing => return Ok(Outcome::Finalized),
    };
    let task = &plan.task;
    let spec = RunSpec {
        task_id,
        run: task.run_count,
        command: task.command.clone(),
        env: task.env.0.clone(),
        secrets,
        context: files,
        tier: plan.tier.clone(),
        idempotency_key: (task.effect == EffectClass::Idempotent).then(|| task_id.to_string()),
        max_output_bytes: config.sandbox.max_output_bytes,
    };
    tracing::info!(task.id = %task_id, tier = %plan.tier.name, run = task.run_count, provider = provider.name(), "sandbox run starting");
    let outcome = match provider.run(spec, ctx.cancel.clone()).await {
        Ok(o) => o,
        Err(ProviderError::Cancelled) => return Err(HandlerError::retry("the run was cancelled")),
        Err(ProviderError::Refused(reason)) => return Err(HandlerError::permanent(reason)),
        Err(e) => return Err(HandlerError::retry(e.to_string()).with_delay(Duration::from_secs(1))),
    };
    tracing::info!(
        task.id = %task_id, exit_code = outcome.exit_code, duration_ms = outcome.duration_ms,
        peak_rss_kib = outcome.peak_rss_kib, killed_for = outcome.killed_for.map(|k| k.as_str()),
        "sandbox run ended"
    );
    if config.sandbox.isolation == Isolation::None {
        tracing::warn!(
            task.id = %task_id, limits = %outcome.limits.join(","),
            "sandbox run was not isolated (sandbox.isolation = \"none\"): it ran as this worker's user"
        );
    }
    // The outcome is in memory only until this commits: keep trying while the lease is held
    // (once it is lost, the rescuer reruns the task).
    loop {
        match service::finish_run(&ctx.pool, lease, &plan, &outcome).await {
            Ok(t) => {
                tracing::info!(task.id = %task_id, state = t.state.as_str(), "sandbox outcome recorded");
                return Ok(Outcome::Finalized);
            }
            Err(SandboxError::Db(e)) => {
                tracing::warn!(task.id = %task_id, error = %e, "recording the outcome failed; retrying");
                tokio::select! {
                    _ = ctx.cancel.cancelled() => return Err(HandlerError::retry("cancelled while recording")),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
            Err(e) => return Err(handler_error(e)),
        }
    }
}
