//! Completing jobs whose handlers succeeded: the completion loop, which batches them into
//! few statements, and the accounting of what each statement completed.
//!
//! A finished handler frees its slot at once; its completion waits here (or, in exchange
//! mode, rides on its slot's next claim, see `claim`) for the statement that records it.
//!
//! Invariants:
//! - Every completion is fenced on its lease: a job whose lease was lost is not completed,
//!   and counts as lease lost, never as completed.
//! - Each completion is counted exactly once, once the statement that carried it returned.
//! - A failed completion statement is tried again for about 1.5 s with bare sleeps (the
//!   one exception to cancellable waits: the tries finish even during a stop); after that
//!   the jobs stay `running` and the rescuer retries them once their leases expire.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use airlock_core::fault;
use airlock_queue::{self as queue, Lease};
use sqlx::PgPool;
use tokio::sync::mpsc;

use super::{WorkerStats, bump};

/// A job whose handler succeeded, waiting for the statement that completes it.
pub(super) struct Completion {
    pub(super) lease: Lease,
    /// For the `JOBS_ENDED` metric's label.
    pub(super) kind: String,
}

/// The longest pause between two tries of a failed completion statement (about 1.5 s of
/// tries in all).
const COMPLETION_RETRY_MAX: Duration = Duration::from_millis(800);

/// Completion statements in flight at once when completions are batched.
pub(super) const COMPLETION_STATEMENTS: usize = 2;

/// Gives a completion to the completer without waiting (a full channel gets a task of
/// its own to wait in).
pub(super) fn hand_over(completer: &mpsc::Sender<Completion>, c: Completion) {
    if let Err(mpsc::error::TrySendError::Full(c)) = completer.try_send(c) {
        let completer = completer.clone();
        tokio::spawn(async move {
            let _ = completer.send(c).await;
        });
    }
}

/// Completes jobs: takes what is queued (up to `max`) and completes it in one statement,
/// with up to `parallel` statements in flight, so under load many completions share one
/// commit; alone, a completion goes out at once. Ends when every sender is gone and
/// every statement has returned.
pub(super) async fn completion_loop(
    pool: PgPool,
    rx: mpsc::Receiver<Completion>,
    max: usize,
    parallel: usize,
    stats: Arc<WorkerStats>,
) {
    crate::batch::gather(rx, max, parallel, move |batch| complete_batch(pool.clone(), batch, stats.clone())).await;
}

/// Completes one batch, fenced on each lease, and accounts for every job in it.
async fn complete_batch(pool: PgPool, batch: Vec<Completion>, stats: Arc<WorkerStats>) {
    let leases: Vec<Lease> = batch.iter().map(|c| c.lease).collect();
    // A lost connection or a restarting database fails the statement: try again for a
    // while, since the statement is fenced on each lease (applying it twice changes
    // nothing; a job completed by an attempt whose answer was lost counts as lease lost).
    let mut wait = Duration::from_millis(50);
    let done: HashSet<Lease> = loop {
        match queue::complete_many(&pool, &leases).await {
            Ok(done) => break done.into_iter().collect(),
            Err(e) if wait <= COMPLETION_RETRY_MAX => {
                tracing::warn!(error = %e, jobs = batch.len(), "could not record job completions; retrying");
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            Err(e) => {
                // Still running in the database: the rescuer retries them when their leases
                // expire (their handlers succeeded, so they are pure or idempotent here).
                tracing::error!(error = %e, jobs = batch.len(), "could not record job completions");
                return;
            }
        }
    };
    account(batch, &done, &stats).await;
}

/// Counts the completions of `batch`: those in `done` were completed, the others had lost
/// their leases.
pub(super) async fn account(batch: Vec<Completion>, done: &HashSet<Lease>, stats: &WorkerStats) {
    for c in batch {
        let outcome = if done.contains(&c.lease) {
            bump(&stats.completed);
            "completed"
        } else {
            bump(&stats.lease_lost);
            tracing::warn!(job.id = %c.lease.id(), job.attempt = c.lease.attempt(), "lease lost: result dropped");
            "lease_lost"
        };
        metrics::counter!(airlock_core::metrics::JOBS_ENDED, "kind" => c.kind, "outcome" => outcome).increment(1);
    }
    if !done.is_empty() {
        let _ = fault::hit("job.after_complete").await;
    }
}
