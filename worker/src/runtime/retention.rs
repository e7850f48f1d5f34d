//! Retention: completed and cancelled jobs are deleted once they are older than the
//! configured age, in batches, so no statement holds many locks or runs long.
//!
//! Invariants:
//! - Only finished jobs that nobody holds are deleted (`completed`, `cancelled`), oldest
//!   first; SKIP LOCKED lets several workers prune at once.
//! - A pass stops early when its worker stops, between two batches.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use airlock_queue::{self as queue, QueueError};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{WorkerStats, next_tick, ticker};

/// What one retention pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Jobs deleted.
    pub deleted: u64,
    /// Delete statements run (the last one came back short, unless the pass was stopped).
    pub batches: u32,
}

/// One pass: deletes finished jobs older than `age`, `batch` at a time, while full batches
/// come back and `stop` has not fired. Adds each batch to `stats.pruned` as it commits, so
/// a pass that fails midway still counts what it deleted.
pub async fn run_once(
    pool: &PgPool,
    age: Duration,
    batch: i64,
    stats: &WorkerStats,
    stop: &CancellationToken,
) -> Result<Pruned, QueueError> {
    let mut pruned = Pruned::default();
    loop {
        let n = queue::prune_finished(pool, age, batch).await?;
        stats.pruned.fetch_add(n, Ordering::Relaxed);
        pruned.deleted += n;
        pruned.batches += 1;
        if (n as i64) < batch || stop.is_cancelled() {
            return Ok(pruned);
        }
    }
}

/// Runs a retention pass every `interval` until `stop` fires.
pub(super) async fn retention_loop(
    pool: PgPool,
    age: Duration,
    interval: Duration,
    batch: i64,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        if let Err(e) = run_once(&pool, age, batch, &stats, &stop).await {
            tracing::warn!(error = %e, "retention pass failed");
        }
    }
}
