//! Lease heartbeats: every lease/3 (or every heartbeat interval, if that is shorter) one
//! statement extends the leases of every job the worker holds, and the worker's row is
//! refreshed.
//!
//! Invariants:
//! - Every held job is heartbeated, running or waiting for a slot, until it ends; the
//!   heartbeat outlives the shutdown drain.
//! - A lease is taken as lost, and its job cancelled, only when two passes in a row did not
//!   find it held while its job was still in flight (see [`Heartbeat::run_once`]); each
//!   lost lease is counted once, however long its job stays held after it was cancelled.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use airlock_queue::{self as queue, Lease, QueueError};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::in_flight::InFlight;
use super::{WorkerStats, bump, next_tick, ticker};

/// What one heartbeat pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeartbeatCounts {
    /// Leases found held and extended.
    pub extended: usize,
    /// Leases not found held for the first time, whose jobs were still in flight (and not
    /// cancelled): the next pass decides.
    pub missed: usize,
    /// Leases not found held at this pass and the one before: their jobs were cancelled.
    pub lost: usize,
}

/// The heartbeat of one worker's leases, and what it remembers between passes.
pub struct Heartbeat {
    pool: PgPool,
    /// The worker whose row each pass refreshes.
    worker_id: String,
    /// How far each pass extends the leases.
    lease: Duration,
    in_flight: InFlight,
    stats: Arc<WorkerStats>,
    /// Leases the last pass did not find held. A handler that ends its job in its own
    /// transaction is still in flight for a moment after that commit, so a lease is only
    /// taken as lost when the next heartbeat finds its job still in flight: cancelling at
    /// the first miss would interrupt handlers that had just finished.
    missed: HashSet<Lease>,
}

impl Heartbeat {
    pub fn new(pool: PgPool, worker_id: String, lease: Duration, in_flight: InFlight, stats: Arc<WorkerStats>) -> Self {
        Self { pool, worker_id, lease, in_flight, stats, missed: HashSet::new() }
    }

    /// One pass: extends every held lease by the lease length, cancels the jobs whose
    /// leases were missed twice in a row (counting each in `lease_lost`), and refreshes the
    /// worker's row with the number of jobs held. Fails when the lease statement fails
    /// (the leases missed before are then kept for the next pass); a failed refresh of the
    /// worker's row is only logged.
    pub async fn run_once(&mut self) -> Result<HeartbeatCounts, QueueError> {
        let leases: Vec<Lease> = self.in_flight.leases();
        let counts = match queue::heartbeat_many(&self.pool, &leases, self.lease).await {
            Ok(held) => Ok(self.take_in(&leases, held)),
            Err(e) => Err(e),
        };
        let n = self.in_flight.len() as i32;
        if let Err(e) = airlock_queue::fleet::heartbeat(&self.pool, &self.worker_id, n).await {
            tracing::warn!(error = %e, "worker heartbeat failed");
        }
        counts
    }

    /// Compares the leases sent with those found `held`, and cancels the jobs missed twice.
    fn take_in(&mut self, leases: &[Lease], held: Vec<Lease>) -> HeartbeatCounts {
        let held: HashSet<Lease> = held.into_iter().collect();
        let mut counts = HeartbeatCounts { extended: held.len(), ..Default::default() };
        let map = self.in_flight.lock();
        let mut still_missed = HashSet::new();
        for lease in leases.iter().filter(|l| !held.contains(l)) {
            let Some(h) = map.get(&lease.id()).filter(|h| h.lease == *lease) else { continue };
            if h.cancel.is_cancelled() {
                // Lost at an earlier pass (or cancelled by a hard stop) and not let go yet: a
                // job waiting for a slot stays held until one frees up. Counted once.
                continue;
            }
            if self.missed.contains(lease) {
                bump(&self.stats.lease_lost);
                tracing::warn!(job.id = %lease.id(), job.attempt = lease.attempt(), "lease lost: cancelling the job");
                h.cancel.cancel();
                counts.lost += 1;
            } else {
                still_missed.insert(*lease);
            }
        }
        counts.missed = still_missed.len();
        self.missed = still_missed;
        counts
    }

    /// Runs a pass every lease/3, or every `heartbeat_interval` if that is shorter (but no
    /// more often than every 200 ms), until `stop` fires.
    pub(super) async fn run(mut self, heartbeat_interval: Duration, stop: CancellationToken) {
        let every = (self.lease / 3).min(heartbeat_interval).max(Duration::from_millis(200));
        let mut tick = ticker(every);
        while next_tick(&mut tick, &stop).await {
            if let Err(e) = self.run_once().await {
                tracing::warn!(error = %e, "lease heartbeat failed");
            }
        }
    }
}
