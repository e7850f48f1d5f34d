//! The event log's partitions: every pass makes the partitions of the next periods (so no
//! submission meets an id no partition covers) and, with an archive age set, moves the
//! partitions of finished periods to the archive and seals them
//! (`airlock_delivery::store::archive`).
//!
//! Invariants:
//! - Making partitions never stops writers (they are created apart and attached); a
//!   change that needs the hot log's lock waits at most the lock timeout, then is left for
//!   the next pass.
//! - A seal that finds a broken chain or a stray event is logged as an error; the
//!   partition stays archived (moving it back would not mend it) for a human to look at.
//! - A failed pass is logged and tried again at the next tick; it never stops the worker.

use std::time::Duration;

use airlock_delivery::store::archive::{self, Archived, Seal};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{next_tick, ticker};

/// How the event log is partitioned and archived (`retention.*`).
#[derive(Debug, Clone, Copy)]
pub struct LogSettings {
    pub period: Duration,
    pub ahead: u32,
    /// `None`: nothing is archived.
    pub archive_after: Option<Duration>,
    pub lock_timeout: Duration,
}

impl LogSettings {
    pub fn from_config(r: &airlock_core::config::RetentionConfig) -> Self {
        Self {
            period: Duration::from_secs(r.event_partition_seconds.max(1)),
            ahead: r.event_partitions_ahead.max(1),
            archive_after: Some(r.archive_events_after_seconds).filter(|&s| s > 0).map(Duration::from_secs),
            lock_timeout: Duration::from_millis(r.lock_timeout_ms.max(1)),
        }
    }
}

impl Default for LogSettings {
    /// The configuration's defaults.
    fn default() -> Self {
        Self::from_config(&airlock_core::config::RetentionConfig::default())
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default)]
pub struct Pass {
    pub created: Vec<String>,
    pub archived: Vec<Seal>,
    /// A partition due for the archive whose move could not have the hot log's lock in time.
    pub busy: Option<String>,
}

/// One pass: makes partitions ahead, then archives every due partition, oldest first, while
/// `stop` has not fired.
pub async fn run_once(pool: &PgPool, s: &LogSettings, stop: &CancellationToken) -> Result<Pass, sqlx::Error> {
    let mut pass =
        Pass { created: archive::ensure_partitions(pool, s.period, s.ahead, s.lock_timeout).await?, ..Pass::default() };
    if !pass.created.is_empty() {
        tracing::info!(partitions = ?pass.created, "event log partitions made ahead");
    }
    let Some(age) = s.archive_after else { return Ok(pass) };
    while !stop.is_cancelled() {
        match archive::archive_once(pool, age, s.lock_timeout).await? {
            Archived::Nothing => break,
            Archived::Busy(part) => {
                tracing::info!(partition = %part, "event log busy; archiving left for the next pass");
                pass.busy = Some(part);
                break;
            }
            Archived::Moved(seal) => {
                if seal.sound() {
                    tracing::info!(partition = %seal.partition, deliveries = seal.deliveries, events = seal.events,
                                   "event log partition archived and sealed");
                } else {
                    tracing::error!(partition = %seal.partition, broken = seal.broken, strays = seal.strays,
                                    "archived event log partition does not verify");
                }
                pass.archived.push(seal);
            }
        }
    }
    Ok(pass)
}

/// Runs a pass every `interval` (the first at once) until `stop` fires.
pub(super) async fn partitions_loop(pool: PgPool, s: LogSettings, interval: Duration, stop: CancellationToken) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        if let Err(e) = run_once(&pool, &s, &stop).await {
            tracing::warn!(error = %e, "event log partitioning pass failed");
        }
    }
}
