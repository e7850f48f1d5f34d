//! First statistics: a table never analyzed is analyzed as soon as it holds work, not when
//! autovacuum first reaches it. On a new installation autovacuum's first analysis of `jobs`
//! comes a naptime or more after the backlog does, and until then the statements the
//! worker keeps prepared (with generic plans, see `airlock_core::db::queue_plans`) are
//! planned without statistics; an ANALYZE invalidates those plans.
//!
//! Invariants:
//! - Only tables never analyzed are touched, each once (the function in
//!   `migrations/0025_first_statistics.sql` re-checks under its lock); after that
//!   autovacuum alone keeps the statistics.
//! - A failed check is logged and tried again at the next tick; it never stops the worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{WorkerStats, next_tick, ticker};

/// One check: analyzes the tables never analyzed that have had at least `min_changes` rows
/// written, adds them to `stats.analyzed`, and returns their names.
pub async fn run_once(pool: &PgPool, min_changes: i64, stats: &WorkerStats) -> Result<Vec<String>, sqlx::Error> {
    let analyzed = airlock_core::db::first_analyze(pool, min_changes).await?;
    if !analyzed.is_empty() {
        stats.analyzed.fetch_add(analyzed.len() as u64, Ordering::Relaxed);
        tracing::info!(tables = ?analyzed, "analyzed tables that had no statistics yet");
    }
    Ok(analyzed)
}

/// Checks every `interval` until `stop` fires.
pub(super) async fn statistics_loop(
    pool: PgPool,
    min_changes: i64,
    interval: Duration,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        if let Err(e) = run_once(&pool, min_changes, &stats).await {
            tracing::warn!(error = %e, "first statistics check failed");
        }
    }
}
