//! The `capsule.migrate` job: moves a running agent to another node by a fenced two-phase
//! commit, and never lets two nodes run it.
//!
//! Steps (each followed by a phase write in Postgres, fenced on the job's lease, so another
//! worker resumes where this one stopped):
//! 1. freeze the source at its epoch (it checkpoints to the store) → `frozen`
//! 2. propose the fresh epoch to the target → `proposed`
//! 3. send only the blobs the target lacks (it checks each hash) → `transferred`
//! 4. the target prepares (verifies, renders the journal, resolves the environment) → `prepared`
//! 5. record `activating`: the point of no return; then activate on the target → `activated`
//! 6. retire the source → `retired` → `completed` (Postgres names the new holder).
//!
//! Any failure before step 5 aborts: the target discards its staging and the source resumes
//! at its old epoch. When activate's answer is lost (or a worker resumes a migration found in
//! `activating`), the target is asked which epoch it holds: the new one → retire the source;
//! another → abort the target, resume the source; no answer → stay frozen and ask again
//! later. Availability may be lost; correctness never is.

use std::sync::Arc;
use std::time::Duration;

use airlock_capsule::archive::{Archive, DirArchive};
use airlock_capsule::protocol::{CallError, HolderState, NodeApi, NodeDirectory, PrepareRequest};
use airlock_capsule::relocation::{self, Changes, Phase, Relocation, RelocationError};
use airlock_capsule::{AgentId, CapsuleFiles, agents};
use airlock_core::config::Config;
use serde_json::json;
use uuid::Uuid;

use crate::handler::{BoxFuture, Handler, HandlerError, JobContext, Outcome, Registry};

pub use airlock_capsule::relocation::MIGRATE_JOB;

/// Test hooks: no-ops unless a test installs them.
#[derive(Default)]
pub struct MigrateHooks {
    /// Stop dead (as if the worker were killed) right after recording this phase.
    pub halt_after: std::sync::Mutex<Option<Phase>>,
    /// Fires when the handler halts.
    pub halted: tokio::sync::Notify,
}

impl MigrateHooks {
    /// Every phase the handler can halt after: each one it records and then goes on from.
    /// (`created` is recorded by the admin route; `completed` and `aborted` end the job.)
    pub const POINTS: [Phase; 8] = [
        Phase::Frozen,
        Phase::Proposed,
        Phase::Transferred,
        Phase::Prepared,
        Phase::Activating,
        Phase::Activated,
        Phase::Retired,
        Phase::Aborting,
    ];

    pub fn halt_after(&self, phase: Option<Phase>) {
        *self.halt_after.lock().unwrap_or_else(|e| e.into_inner()) = phase;
    }
    fn should_halt(&self, phase: Phase) -> bool {
        *self.halt_after.lock().unwrap_or_else(|e| e.into_inner()) == Some(phase)
    }
}

/// Drives `capsule.migrate` jobs.
#[derive(Clone)]
pub struct MigrateHandler {
    pub nodes: NodeDirectory,
    pub store: Arc<dyn Archive>,
    pub worker_id: String,
    /// How long to wait before asking an unresponsive node again after the point of no
    /// return.
    pub retry: Duration,
    pub hooks: Arc<MigrateHooks>,
    /// `capsules.trusted_keys`: an agent placed from the store must have been imported
    /// signed by one of them (or allowed unsigned by the operator).
    pub trusted_keys: Vec<String>,
}

/// Registers the handler when the configuration names peer nodes; refuses to start when
/// the fleet secret they need is missing.
pub fn register(r: &mut Registry, cfg: &Config, worker_id: &str) -> anyhow::Result<()> {
    if cfg.nodes.is_empty() {
        return Ok(());
    }
    let secret = airlock_core::secret::from_env(&cfg.capsules.fleet_secret_env).ok_or_else(|| {
        anyhow::anyhow!("nodes are configured but the fleet secret `{}` is not set", cfg.capsules.fleet_secret_env)
    })?;
    let handler = MigrateHandler {
        nodes: NodeDirectory::from_config(cfg, secret)?,
        store: Arc::new(DirArchive::new(&cfg.capsules.store_dir)),
        worker_id: worker_id.to_string(),
        retry: Duration::from_millis(cfg.capsules.migrate_retry_ms),
        hooks: Arc::default(),
        trusted_keys: cfg.capsules.trusted_keys.clone(),
    };
    r.register(MIGRATE_JOB, handler);
    Ok(())
}

/// What one step did.
enum Step {
    /// Recorded this phase; go on.
    Advanced(Phase),
    /// The job ended in the same transaction as the migration.
    Finalized,
    /// A node does not answer where guessing is not allowed: ask again later.
    Wait(String),
}

#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Migration(#[from] RelocationError),
    #[error(transparent)]
    Agent(#[from] agents::AgentError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Queue(#[from] airlock_queue::QueueError),
    #[error("{0}")]
    Permanent(String),
}

impl Handler for MigrateHandler {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        let this = self.clone();
        Box::pin(async move { this.drive(ctx).await })
    }
}

fn reason_of(call: &str, e: &CallError) -> String {
    format!("{call}: {e}")
}

impl MigrateHandler {
    async fn drive(&self, ctx: JobContext) -> Result<Outcome, HandlerError> {
        let id: Uuid = ctx
            .job
            .payload
            .get("migration_id")
            .and_then(|v| v.as_str())
            .and_then(|s| Uuid::parse_str(s).ok())
            .ok_or_else(|| HandlerError::permanent("payload has no migration_id"))?;
        // Whether this run recorded `activating` itself (then it may send activate once).
        let mut crossed_here = false;
        loop {
            if ctx.cancel.is_cancelled() {
                return Err(HandlerError::retry("cancelled"));
            }
            let m = relocation::get(&ctx.pool, id)
                .await
                .map_err(|e| HandlerError::retry(e.to_string()))?
                .ok_or_else(|| HandlerError::permanent(format!("migration {id} not found")))?;
            if m.phase.is_terminal() {
                return Ok(Outcome::Completed);
            }
            let span =
                tracing::info_span!("migrate", migration.id = %id, agent.id = %m.agent_id, phase = m.phase.as_str());
            let _e = span.enter();
            let step = match self.step(&ctx, &m, crossed_here).await {
                Ok(s) => s,
                Err(StepError::Permanent(msg)) => return Err(HandlerError::permanent(msg)),
                Err(e) => return Err(HandlerError::retry(e.to_string())),
            };
            match step {
                Step::Advanced(p) => {
                    tracing::info!(to = p.as_str(), "migration phase recorded");
                    crossed_here = p == Phase::Activating;
                    if self.hooks.should_halt(p) {
                        self.hooks.halted.notify_one();
                        std::future::pending::<()>().await;
                    }
                }
                Step::Finalized => return Ok(Outcome::Finalized),
                Step::Wait(reason) => {
                    tracing::warn!(%reason, "migration waits");
                    relocation::note_waiting(&ctx.pool, ctx.lease(), id, m.phase, &reason)
                        .await
                        .map_err(|e| HandlerError::retry(e.to_string()))?;
                    return Ok(Outcome::Snooze(self.retry));
                }
            }
        }
    }

    fn node(&self, id: &str) -> Result<Arc<dyn NodeApi>, StepError> {
        self.nodes
            .get(id)
            .ok_or_else(|| StepError::Permanent(format!("node `{id}` is not configured (nodes.{id}.url)")))
    }

    async fn advance(
        &self,
        ctx: &JobContext,
        m: &Relocation,
        to: Phase,
        changes: Changes,
        detail: serde_json::Value,
    ) -> Result<Step, StepError> {
        let mut tx = ctx.pool.begin().await?;
        relocation::advance(&mut tx, ctx.lease(), m.id, m.phase, to, &self.worker_id, changes, detail).await?;
        tx.commit().await?;
        Ok(Step::Advanced(to))
    }

    async fn abort(&self, ctx: &JobContext, m: &Relocation, reason: String) -> Result<Step, StepError> {
        tracing::warn!(%reason, "aborting migration");
        let changes = Changes { reason: Some(reason.clone()), ..Changes::default() };
        self.advance(ctx, m, Phase::Aborting, changes, json!({"reason": reason})).await
    }

    /// The checkpoint being moved, as fixed at `frozen`.
    fn checkpoint(&self, m: &Relocation, agent: &AgentId) -> Result<Option<CapsuleFiles>, StepError> {
        let cap = self.store.get_checkpoint(agent).map_err(|e| StepError::Permanent(e.to_string()))?;
        Ok(cap.filter(|c| Some(c.manifest_sha256()) == m.manifest_sha256))
    }

    async fn step(&self, ctx: &JobContext, m: &Relocation, crossed_here: bool) -> Result<Step, StepError> {
        let agent = m.agent()?;
        let nodes = self
            .node(&m.target_node)
            .and_then(|t| Ok((t, m.source_node.as_deref().map(|s| self.node(s)).transpose()?)));
        let (target, source) = match nodes {
            Ok(n) => n,
            // A node missing from this worker's configuration: give up while that is safe.
            Err(e) if m.phase.past_point_of_no_return() || m.phase == Phase::Aborting => {
                return Ok(Step::Wait(e.to_string()));
            }
            Err(e) => return self.abort(ctx, m, e.to_string()).await,
        };
        match m.phase {
            Phase::Created => {
                let frozen_sha = match &source {
                    Some(src) => match src.freeze(&agent, m.from_epoch).await {
                        Ok(r) => Some(r.manifest_sha256),
                        Err(e) => return self.abort(ctx, m, reason_of("freeze", &e)).await,
                    },
                    None => {
                        // Placed from the store: activating an imported capsule. Its import's
                        // trust must still hold.
                        let row = agents::get(&ctx.pool, &agent).await?;
                        let refused = match &row {
                            Some(a) => a.untrusted_import(&self.trusted_keys),
                            None => Some(format!("agent {agent} is not in Postgres")),
                        };
                        if let Some(why) = refused {
                            return self.abort(ctx, m, why).await;
                        }
                        None
                    }
                };
                let cap = match self.store.get_checkpoint(&agent) {
                    Ok(Some(c)) => c,
                    Ok(None) => return self.abort(ctx, m, "the store has no checkpoint of the agent".into()).await,
                    Err(e) => return self.abort(ctx, m, format!("store: {e}")).await,
                };
                let sha = cap.manifest_sha256();
                if frozen_sha.as_ref().is_some_and(|f| *f != sha) {
                    return self.abort(ctx, m, "the store does not hold the frozen checkpoint".into()).await;
                }
                if cap.agent_id() != &agent {
                    return self.abort(ctx, m, format!("the checkpoint names agent {}", cap.agent_id())).await;
                }
                let changes = Changes { manifest_sha256: Some(sha.clone()), ..Changes::default() };
                self.advance(ctx, m, Phase::Frozen, changes, json!({"manifest_sha256": sha})).await
            }
            Phase::Frozen => match target.propose(&agent, m.epoch).await {
                Ok(_) => self.advance(ctx, m, Phase::Proposed, Changes::default(), json!({"epoch": m.epoch})).await,
                Err(e) => self.abort(ctx, m, reason_of("propose", &e)).await,
            },
            Phase::Proposed => {
                let Some(cap) = self.checkpoint(m, &agent)? else {
                    return self.abort(ctx, m, "the frozen checkpoint is no longer in the store".into()).await;
                };
                let hashes = cap.blob_hashes();
                let missing = match target.have_blobs(&agent, m.epoch, hashes.clone()).await {
                    Ok(r) => r.missing,
                    Err(e) => return self.abort(ctx, m, reason_of("have_blobs", &e)).await,
                };
                let mut bytes = 0i64;
                for sha in &missing {
                    if !hashes.contains(sha) {
                        return self.abort(ctx, m, format!("target asked for blob {sha} the capsule lacks")).await;
                    }
                    let body = match self.store.get_blob(sha) {
                        Ok(b) => b,
                        Err(e) => return self.abort(ctx, m, format!("store: {e}")).await,
                    };
                    bytes += body.len() as i64;
                    if let Err(e) = target.put_blob(&agent, m.epoch, sha, body).await {
                        return self.abort(ctx, m, reason_of("put_blob", &e)).await;
                    }
                }
                let (total, sent) = (hashes.len() as i32, missing.len() as i32);
                let changes = Changes { blobs: Some((total, sent, total - sent, bytes)), ..Changes::default() };
                let detail = json!({"blobs_total": total, "blobs_sent": sent, "blobs_skipped": total - sent, "bytes_sent": bytes});
                self.advance(ctx, m, Phase::Transferred, changes, detail).await
            }
            Phase::Transferred => {
                let Some(cap) = self.checkpoint(m, &agent)? else {
                    return self.abort(ctx, m, "the frozen checkpoint is no longer in the store".into()).await;
                };
                let req = PrepareRequest { epoch: m.epoch, files: cap.files_base64(), manifest: cap.manifest };
                match target.prepare(&agent, req).await {
                    Ok(_) => self.advance(ctx, m, Phase::Prepared, Changes::default(), json!({})).await,
                    Err(e) => self.abort(ctx, m, reason_of("prepare", &e)).await,
                }
            }
            // The point of no return: recorded before activate is sent.
            Phase::Prepared => {
                self.advance(ctx, m, Phase::Activating, Changes::default(), json!({"epoch": m.epoch})).await
            }
            Phase::Activating => {
                if crossed_here {
                    match target.activate(&agent, m.epoch).await {
                        Ok(s) if s.is_active_at(m.epoch) => {
                            return self
                                .advance(ctx, m, Phase::Activated, Changes::default(), json!({"answer": "activate"}))
                                .await;
                        }
                        Ok(s) => tracing::warn!(?s, "activate answered without the new epoch"),
                        Err(e) => tracing::warn!(error = %e, "activate failed; asking the target"),
                    }
                }
                // Ambiguous: ask the target which epoch it holds.
                match target.status(&agent).await {
                    Ok(s) if s.is_active_at(m.epoch) => {
                        self.advance(ctx, m, Phase::Activated, Changes::default(), json!({"answer": "status"})).await
                    }
                    Ok(s) => {
                        let held = format!(
                            "target holds {} at epoch {}{}",
                            s.state.map_or("nothing", HolderState::as_str),
                            s.epoch,
                            if s.reconciled { "" } else { " (unreconciled)" }
                        );
                        self.abort(ctx, m, format!("activate did not take: {held}")).await
                    }
                    Err(e) => Ok(Step::Wait(format!(
                        "activate is ambiguous and the target does not answer ({e}); the source stays frozen"
                    ))),
                }
            }
            Phase::Activated => {
                if let Some(src) = &source {
                    match src.retire(&agent, m.from_epoch).await {
                        Ok(_) => {}
                        Err(e @ CallError::Unreachable(_)) => return Ok(Step::Wait(reason_of("retire", &e))),
                        Err(e) => match src.status(&agent).await {
                            Ok(s) if s.state == Some(HolderState::Retired) => {}
                            _ => return Ok(Step::Wait(reason_of("retire", &e))),
                        },
                    }
                }
                self.advance(ctx, m, Phase::Retired, Changes::default(), json!({})).await
            }
            Phase::Retired => {
                let mut tx = ctx.pool.begin().await?;
                let done = relocation::advance(
                    &mut tx,
                    ctx.lease(),
                    m.id,
                    Phase::Retired,
                    Phase::Completed,
                    &self.worker_id,
                    Changes::default(),
                    json!({"holder": m.target_node, "epoch": m.epoch}),
                )
                .await?;
                agents::finish_migration(&mut *tx, &agent, &done.target_node, done.epoch, None).await?;
                airlock_queue::complete(&mut *tx, ctx.lease()).await?;
                tx.commit().await?;
                tracing::info!(holder = %m.target_node, epoch = m.epoch, "migration completed");
                Ok(Step::Finalized)
            }
            Phase::Aborting => {
                match target.abort(&agent, m.epoch).await {
                    Ok(_) => {}
                    Err(e) => return Ok(Step::Wait(reason_of("abort", &e))),
                }
                if let Some(src) = &source {
                    match src.resume(&agent, m.from_epoch).await {
                        Ok(_) => {}
                        Err(e @ CallError::Unreachable(_)) => return Ok(Step::Wait(reason_of("resume", &e))),
                        // It lost its record and runs nothing; once this migration is over,
                        // reconciliation restores it from Postgres (which names it again).
                        Err(e) if e.code() == Some("UNRECONCILED") => {
                            tracing::warn!(error = %e, "the source waits to be reconciled");
                        }
                        Err(e) => match src.status(&agent).await {
                            Ok(s) if s.is_active_at(m.from_epoch) => {}
                            _ => return Ok(Step::Wait(reason_of("resume", &e))),
                        },
                    }
                }
                let mut tx = ctx.pool.begin().await?;
                relocation::advance(
                    &mut tx,
                    ctx.lease(),
                    m.id,
                    Phase::Aborting,
                    Phase::Aborted,
                    &self.worker_id,
                    Changes::default(),
                    json!({"holder": m.source_node, "epoch": m.from_epoch}),
                )
                .await?;
                agents::abort_migration(&mut *tx, &agent).await?;
                airlock_queue::complete(&mut *tx, ctx.lease()).await?;
                tx.commit().await?;
                tracing::info!("migration aborted; the source runs at its old epoch");
                Ok(Step::Finalized)
            }
            Phase::Completed | Phase::Aborted => Ok(Step::Finalized),
        }
    }
}
