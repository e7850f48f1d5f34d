//! The rescuer: every worker looks for jobs whose lease expired (their holder crashed,
//! stalled or lost its connection) and settles them; SKIP LOCKED alone keeps several
//! workers from settling the same job.
//!
//! Invariants:
//! - `pure` and `idempotent` jobs go back to `available` with backoff (or `failed` when
//!   their attempts are exhausted); a `non_repeatable` job whose effect may have started is
//!   `parked` for a human to decide.
//! - Each kind's handler updates the rows its job serves in the transaction that moves the
//!   job, so a job and its rows never disagree.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use airlock_core::fault;
use airlock_queue::{self as queue, RescueCounts};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{WorkerStats, next_tick, ticker};
use crate::handler::Registry;

/// Jobs one rescuer transaction moves at most.
const RESCUE_BATCH: i64 = 100;

/// Runs the rescuer every `interval` until `stop` fires.
pub(super) async fn rescue_loop(
    pool: PgPool,
    registry: Arc<Registry>,
    interval: Duration,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        match rescue_once(&pool, &registry, RESCUE_BATCH).await {
            Ok(c) => {
                let n = (c.retried + c.failed + c.parked) as u64;
                if n > 0 {
                    stats.rescued.fetch_add(n, Ordering::Relaxed);
                    tracing::info!(retried = c.retried, failed = c.failed, parked = c.parked, "rescued expired leases");
                }
            }
            Err(e) => tracing::warn!(error = %e, "rescuer pass failed"),
        }
    }
}

/// One rescuer pass: moves expired jobs and lets each kind's handler update its own rows
/// in the same transaction. Repeats while full batches come back; returns what it moved
/// in all.
pub async fn rescue_once(pool: &PgPool, registry: &Registry, batch: i64) -> anyhow::Result<RescueCounts> {
    let mut total = RescueCounts::default();
    loop {
        let mut tx = pool.begin().await?;
        let rescued = queue::rescue_expired(&mut tx, batch).await?;
        for r in &rescued {
            if let Some(h) = registry.get(&r.job.kind) {
                h.on_rescued(&mut tx, r).await?;
            }
        }
        if !rescued.is_empty() {
            fault::hit("rescue.before_commit").await?;
        }
        tx.commit().await?;
        let c = RescueCounts::of(&rescued);
        for (outcome, n) in [("retried", c.retried), ("failed", c.failed), ("parked", c.parked)] {
            if n > 0 {
                metrics::counter!(airlock_core::metrics::LEASES_RESCUED, "outcome" => outcome).increment(n as u64);
            }
        }
        total.retried += c.retried;
        total.failed += c.failed;
        total.parked += c.parked;
        if (rescued.len() as i64) < batch {
            return Ok(total);
        }
    }
}
