//! Running claimed jobs: the worker's slots (bounded concurrency, and the buffer of jobs
//! claimed ahead of them), a job's execution and the application of its outcome, and the
//! settling of each finished task.
//!
//! Invariants:
//! - At most `concurrency` handlers run at once; claimed jobs beyond that wait in the
//!   buffer, held (heartbeated) like running ones.
//! - Every outcome is written fenced on the job's lease; a lost lease drops the result.
//! - A handler cancelled before it wrote a result (lost lease, hard stop) is abandoned and
//!   its job released, unless its effect has started: then the rescuer decides.
//! - A panicking handler fails its job (retried) instead of leaving it running.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_core::fault;
use airlock_queue::{self as queue, Job, Lease, QueueError};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::complete::Completion;
use super::in_flight::InFlight;
use super::{WorkerStats, bump};
use crate::handler::{HandlerError, JobContext, Outcome, Registry};

/// What every job execution needs from its worker.
#[derive(Clone)]
pub(super) struct ExecCtx {
    pub(super) pool: PgPool,
    pub(super) registry: Arc<Registry>,
    /// Given to handlers, which pace their own work by it.
    pub(super) lease_len: Duration,
    pub(super) in_flight: InFlight,
    pub(super) stats: Arc<WorkerStats>,
    /// Takes successful jobs' completions off their slots.
    pub(super) completer: mpsc::Sender<Completion>,
    /// Successful jobs hand their completion back to the worker, which completes it in the
    /// statement that claims the freed slot's next job (one claim per slot).
    pub(super) exchange: bool,
}

/// How an execution ended, for the shutdown path.
pub(super) enum Ended {
    Finished,
    /// The handler succeeded; its completion rides on the worker's next claim.
    Completed(Completion),
    /// The handler was cancelled before it wrote a result.
    Abandoned(Lease),
}

/// A finished execution task, as [`Slots::join_next`] returns it.
pub(super) type Done = Result<(tokio::task::Id, Ended), tokio::task::JoinError>;

/// The worker's slots: the handlers running, and the claimed jobs waiting for one.
pub(super) struct Slots {
    ctx: ExecCtx,
    concurrency: usize,
    tasks: JoinSet<Ended>,
    /// Each task's lease, so that a task that panicked (and returned nothing) can still
    /// have its job failed.
    task_leases: HashMap<tokio::task::Id, Lease>,
    /// Claimed jobs waiting for a free slot (only when a claim brings more than the free
    /// slots); their leases are heartbeated like running ones and released on shutdown.
    ready: VecDeque<(Job, CancellationToken)>,
}

impl Slots {
    pub(super) fn new(ctx: ExecCtx, concurrency: usize) -> Self {
        Self { ctx, concurrency, tasks: JoinSet::new(), task_leases: HashMap::new(), ready: VecDeque::new() }
    }

    /// Handlers running now.
    pub(super) fn running(&self) -> usize {
        self.tasks.len()
    }

    /// Claimed jobs waiting for a slot.
    pub(super) fn waiting(&self) -> usize {
        self.ready.len()
    }

    /// Takes a claimed job into the buffer; from now on its lease is heartbeated, and a lost
    /// lease cancels it.
    pub(super) fn hold(&mut self, job: Job) {
        let cancel = self.ctx.in_flight.hold(job.lease());
        self.ready.push_back((job, cancel));
    }

    /// Starts buffered jobs while there are free slots; drops those whose lease was lost
    /// while they waited.
    pub(super) fn start_ready(&mut self) {
        while self.tasks.len() < self.concurrency {
            let Some((job, cancel)) = self.ready.pop_front() else { return };
            if cancel.is_cancelled() {
                self.ctx.in_flight.remove(job.id);
                continue;
            }
            let lease = job.lease();
            let handle = self.tasks.spawn(execute(self.ctx.clone(), job, cancel));
            self.task_leases.insert(handle.id(), lease);
        }
    }

    /// The next task to finish; `None` when none is running.
    pub(super) async fn join_next(&mut self) -> Option<Done> {
        self.tasks.join_next_with_id().await
    }

    /// Settles a finished task: releases an abandoned job, fails a panicked one. Returns the
    /// completion of a job whose completion rides on a claim (exchange mode).
    pub(super) async fn reap(&mut self, done: Done) -> Option<Completion> {
        let ExecCtx { pool, in_flight, stats, .. } = &self.ctx;
        match done {
            Ok((id, Ended::Finished)) => {
                self.task_leases.remove(&id);
            }
            Ok((id, Ended::Completed(c))) => {
                self.task_leases.remove(&id);
                return Some(c);
            }
            Ok((id, Ended::Abandoned(lease))) => {
                self.task_leases.remove(&id);
                match queue::release(pool, lease).await {
                    Ok(()) => bump(&stats.released),
                    Err(QueueError::LeaseLost { .. }) => {
                        // Lost, finished elsewhere, or its effect started: the rescuer decides.
                    }
                    Err(e) => tracing::warn!(job.id = %lease.id(), error = %e, "could not release job"),
                }
            }
            Err(e) => {
                let lease = self.task_leases.remove(&e.id())?;
                in_flight.remove(lease.id());
                tracing::error!(job.id = %lease.id(), error = %e, "job handler panicked");
                match queue::fail(pool, lease, "handler panicked", false, None).await {
                    Ok(_) => bump(&stats.retried),
                    Err(e) => tracing::warn!(job.id = %lease.id(), error = %e, "could not fail panicked job"),
                }
            }
        }
        None
    }

    /// Gives back every job still waiting for a slot (on stop: none of them started).
    pub(super) async fn release_waiting(&mut self) {
        for (job, _) in self.ready.drain(..) {
            self.ctx.in_flight.remove(job.id);
            match queue::release(&self.ctx.pool, job.lease()).await {
                Ok(()) => bump(&self.ctx.stats.released),
                Err(e) => tracing::warn!(job.id = %job.id, error = %e, "could not release an unstarted job"),
            }
        }
    }

    /// Cancels every held job's handler (the hard stop).
    pub(super) fn cancel_all(&self) {
        self.ctx.in_flight.cancel_all();
    }
}

/// Runs one claimed job's handler and applies its outcome, fenced on the lease.
async fn execute(ctx: ExecCtx, job: Job, cancel: CancellationToken) -> Ended {
    let ExecCtx { pool, registry, lease_len, in_flight, stats, .. } = ctx.clone();
    let lease = job.lease();
    let kind = job.kind.clone();
    let ended = |outcome: &'static str| {
        metrics::counter!(airlock_core::metrics::JOBS_ENDED, "kind" => kind.clone(), "outcome" => outcome).increment(1);
    };
    let span = tracing::info_span!(
        "job",
        job.id = %job.id,
        job.kind = %job.kind,
        job.attempt = job.attempt,
        delivery.id = job.payload.get("delivery_id").and_then(|v| v.as_str()).unwrap_or(""),
    );
    let started = Instant::now();
    let result = tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        r = run_handler(&pool, &registry, &job, cancel.clone(), lease_len).instrument(span.clone()) => Some(r),
    };
    in_flight.remove(job.id);
    metrics::histogram!(airlock_core::metrics::JOB_SECONDS, "kind" => job.kind.clone())
        .record(started.elapsed().as_secs_f64());
    let Some(result) = result else {
        ended("abandoned");
        return Ended::Abandoned(lease);
    };
    if fault::hit("job.before_complete").await.is_err() {
        return Ended::Abandoned(lease);
    }
    let applied = match result {
        Ok(Outcome::Completed) => {
            let completion = Completion { lease, kind: job.kind.clone() };
            if ctx.exchange {
                return Ended::Completed(completion);
            }
            if ctx.completer.send(completion).await.is_ok() {
                // The completer accounts for it once its statement commits.
                return Ended::Finished;
            }
            queue::complete(&pool, lease).await.map(|_| {
                bump(&stats.completed);
                ended("completed");
            })
        }
        Ok(Outcome::Finalized) => {
            bump(&stats.completed);
            ended("finalized");
            Ok(())
        }
        Ok(Outcome::Snooze(d)) => queue::snooze(&pool, lease, d).await.map(|_| ended("snoozed")),
        Ok(Outcome::Parked(reason)) => queue::park(&pool, lease, &reason).await.map(|_| {
            bump(&stats.parked);
            ended("parked");
        }),
        Err(HandlerError { message, permanent, delay }) => {
            match queue::fail(&pool, lease, &message, permanent, delay).await {
                Ok(queue::FailOutcome::Retry) => {
                    bump(&stats.retried);
                    ended("retried");
                    tracing::info!(parent: &span, error = %message, "job failed; will retry");
                    Ok(())
                }
                Ok(queue::FailOutcome::Failed) => {
                    bump(&stats.failed);
                    ended("failed");
                    tracing::warn!(parent: &span, error = %message, "job failed for good");
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
    };
    match applied {
        Ok(()) => {
            tracing::debug!(parent: &span, elapsed_ms = started.elapsed().as_millis() as u64, "job done");
            let _ = fault::hit("job.after_complete").await;
        }
        Err(QueueError::LeaseLost { .. }) => {
            bump(&stats.lease_lost);
            ended("lease_lost");
            tracing::warn!(parent: &span, "lease lost: result dropped");
        }
        Err(e) => tracing::error!(parent: &span, error = %e, "could not record job outcome"),
    }
    Ended::Finished
}

async fn run_handler(
    pool: &PgPool,
    registry: &Registry,
    job: &Job,
    cancel: CancellationToken,
    lease_len: Duration,
) -> Result<Outcome, HandlerError> {
    fault::hit("job.after_claim").await.map_err(|e| HandlerError::retry(e.to_string()))?;
    let Some(handler) = registry.get(&job.kind) else {
        return Err(HandlerError::permanent(format!("no handler for job kind `{}`", job.kind)));
    };
    let ctx = JobContext { job: job.clone(), pool: pool.clone(), cancel, lease_len };
    handler.run(ctx).await
}
