//! The worker runtime: claims jobs in batches, runs their handlers with bounded
//! concurrency, keeps leases alive, rescues expired leases, prunes old jobs, and shuts
//! down gracefully.
//!
//! Its parts, by responsibility:
//! - this module: [`Worker`], its settings and counters; `run` wires the parts together
//!   and holds the shutdown sequence.
//! - `claim`: the claim loop (when to claim and how many: per-slot, prefetching or
//!   free-slot claims; completions riding on claims), and the caches of the paused queues
//!   and of where claims start.
//! - `execute`: the slots, a job's execution and the settling of its task.
//! - `complete`: the completion loop, which batches completions, and their accounting.
//! - `listen`: LISTEN/NOTIFY wake-ups.
//! - [`in_flight`]: the jobs the worker holds, which the heartbeat extends.
//! - [`heartbeat`], [`rescue`], [`retention`], [`statistics`], [`partitions`], [`ring`]: the
//!   maintenance loops, each a tick and a `run_once` that tests call directly.
//!
//! Invariants:
//! - Jobs are claimed for free slots. Only a prefetching worker (`claim_batch` above
//!   `concurrency`) keeps jobs waiting beyond them, at most two batches, heartbeated like
//!   running ones and given back on stop.
//! - Every write for a claimed job is fenced on its lease; a lost lease cancels the job's
//!   handler and its result is dropped.
//! - On shutdown: stop claiming, let in-flight jobs finish within the grace period, then
//!   cancel the rest and release those whose effect has not started (the rescuer decides
//!   about the others once their lease expires).
//! - Every loop selects on its cancellation token; no bare sleep (but for the bounded
//!   retries of a failed completion statement, which finish even during a stop).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use airlock_queue::ClaimFilter;
use sqlx::PgPool;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::handler::Registry;

mod claim;
mod complete;
mod execute;
pub mod heartbeat;
pub mod in_flight;
mod listen;
pub mod partitions;
pub mod rescue;
pub mod retention;
pub mod ring;
pub mod statistics;

pub use heartbeat::{Heartbeat, HeartbeatCounts};
pub use in_flight::InFlight;
pub use rescue::rescue_once;

use claim::{ClaimCtx, ClaimCursor, ClaimLoop, Pauses};
use complete::{COMPLETION_STATEMENTS, hand_over};
use execute::{ExecCtx, Slots};

/// What a worker needs to know beyond its handlers.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// Identifies this process in leases and in the `workers` table.
    pub id: String,
    pub concurrency: usize,
    /// Most jobs one claim statement takes; above `concurrency` the extra wait, leased, in
    /// a local buffer (fewer, larger claims).
    pub claim_batch: usize,
    /// Most completions one statement records; 1 completes each job on its own.
    pub complete_batch: usize,
    pub lease: Duration,
    /// `None`: claim from every queue.
    pub queues: Option<Vec<String>>,
    /// Fallback poll, for when a notification is missed.
    pub poll_interval: Duration,
    pub shutdown_grace: Duration,
    pub rescue_interval: Duration,
    pub heartbeat_interval: Duration,
    /// Delete completed/cancelled jobs older than this; `None` keeps them.
    pub retention: Option<Duration>,
    /// Completions delete the job's row at once (see [`airlock_queue::set_delete_completed`]).
    pub delete_completed: bool,
    pub retention_interval: Duration,
    pub retention_batch: i64,
    /// Analyze a table never analyzed once this many of its rows are written; `None`
    /// leaves it to autovacuum.
    pub first_analyze: Option<i64>,
    pub first_analyze_interval: Duration,
    /// The event log's partitions and archive.
    pub log: partitions::LogSettings,
    /// How the queue's ring of live partitions turns.
    pub ring: ring::RingSettings,
    /// A connection kept between claims this long is checked before use
    /// (`database.check_after_idle_ms`).
    pub check_after_idle: Duration,
}

impl WorkerSettings {
    pub fn from_config(cfg: &airlock_core::config::Config, id: String) -> Self {
        let w = &cfg.worker;
        Self {
            id,
            concurrency: w.concurrency,
            claim_batch: if w.claim_batch == 0 { w.concurrency } else { w.claim_batch },
            complete_batch: w.complete_batch.max(1),
            lease: Duration::from_secs(w.lease_seconds),
            queues: if w.queues.is_empty() { None } else { Some(w.queues.clone()) },
            poll_interval: Duration::from_millis(w.poll_interval_ms),
            shutdown_grace: Duration::from_secs(w.shutdown_grace_seconds),
            rescue_interval: Duration::from_secs(w.rescue_interval_seconds.max(1)),
            heartbeat_interval: Duration::from_secs(w.heartbeat_seconds.max(1)),
            retention: match cfg.retention.completed_jobs_hours {
                0 => None,
                h => Some(Duration::from_secs(h * 3600)),
            },
            delete_completed: cfg.retention.delete_completed_jobs,
            retention_interval: Duration::from_secs(cfg.retention.interval_seconds.max(1)),
            retention_batch: cfg.retention.batch_size,
            first_analyze: Some(w.first_analyze_rows).filter(|&n| n > 0),
            first_analyze_interval: Duration::from_millis(w.first_analyze_interval_ms.max(100)),
            log: partitions::LogSettings::from_config(&cfg.retention),
            ring: ring::RingSettings::from_config(w),
            check_after_idle: Duration::from_millis(cfg.database.check_after_idle_ms),
        }
    }

    /// A fresh worker id: host, process id and a random suffix.
    pub fn new_id() -> String {
        format!("{}-{}-{}", hostname(), std::process::id(), &uuid::Uuid::new_v4().simple().to_string()[..8])
    }
}

/// The host name, for the fleet view.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Counters a test or the metrics endpoint can read while the worker runs.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub claimed: AtomicU64,
    pub completed: AtomicU64,
    pub retried: AtomicU64,
    pub failed: AtomicU64,
    pub parked: AtomicU64,
    pub lease_lost: AtomicU64,
    pub released: AtomicU64,
    pub rescued: AtomicU64,
    pub pruned: AtomicU64,
    /// Tables this worker analyzed because they had no statistics yet.
    pub analyzed: AtomicU64,
    /// Wake-ups caused by a NOTIFY.
    pub notify_wakeups: AtomicU64,
    /// Claims that returned jobs right after a NOTIFY wake-up (not after a poll tick).
    pub claims_after_notify: AtomicU64,
    /// Claims that returned jobs after the poll interval elapsed.
    pub claims_after_poll: AtomicU64,
    /// Claims that started from the claim cursor instead of the front of the claim index.
    pub bounded_claims: AtomicU64,
    /// Claims that failed (the worker backs off and claims again).
    pub failed_claims: AtomicU64,
    /// Whether the LISTEN connection is up.
    pub listening: std::sync::atomic::AtomicBool,
}

impl WorkerStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

pub struct Worker {
    pool: PgPool,
    registry: Arc<Registry>,
    settings: WorkerSettings,
    stats: Arc<WorkerStats>,
}

impl Worker {
    pub fn new(pool: PgPool, registry: Registry, settings: WorkerSettings) -> Self {
        Self { pool, registry: Arc::new(registry), settings, stats: Arc::new(WorkerStats::default()) }
    }

    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    pub fn id(&self) -> &str {
        &self.settings.id
    }

    /// Runs until `shutdown` fires, then drains and returns.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let s = &self.settings;
        airlock_queue::set_delete_completed(s.delete_completed);
        airlock_queue::fleet::register(&self.pool, &s.id, &hostname(), s.queues.as_deref(), s.concurrency as i32)
            .await?;
        tracing::info!(worker.id = %s.id, concurrency = s.concurrency, "worker started");
        match airlock_core::db::autovacuum_off(&self.pool, "jobs_long").await {
            Ok(false) => {}
            Ok(true) => tracing::warn!(
                "autovacuum is off for jobs_long (the server's autovacuum or track_counts, or the table's \
                 autovacuum_enabled): the queue's ring is reclaimed by truncation, but nothing removes the row \
                 versions of the jobs that outlive their slot (parked, paused, long-running), and claims slow as \
                 they pile up there; turn it on, or vacuum jobs_long and jobs_done on a schedule"
            ),
            Err(e) => tracing::warn!(error = %e, "could not read whether autovacuum runs for jobs_long"),
        }

        let in_flight = InFlight::default();
        let wake = Arc::new(Notify::new());
        let pauses = Arc::new(Pauses::default());
        let cursor = Arc::new(ClaimCursor::default());
        // Background loops live until the drain is over (heartbeats must outlive it).
        let background = CancellationToken::new();
        let mut loops = JoinSet::new();
        loops.spawn(listen::listen_loop(
            self.pool.clone(),
            wake.clone(),
            pauses.clone(),
            cursor.clone(),
            self.stats.clone(),
            background.clone(),
        ));
        let heartbeat = Heartbeat::new(self.pool.clone(), s.id.clone(), s.lease, in_flight.clone(), self.stats.clone());
        loops.spawn(heartbeat.run(s.heartbeat_interval, background.clone()));
        loops.spawn(rescue::rescue_loop(
            self.pool.clone(),
            self.registry.clone(),
            s.rescue_interval,
            self.stats.clone(),
            background.clone(),
        ));
        if let Some(age) = s.retention {
            loops.spawn(retention::retention_loop(
                self.pool.clone(),
                age,
                s.retention_interval,
                s.retention_batch,
                self.stats.clone(),
                background.clone(),
            ));
        }
        loops.spawn(partitions::partitions_loop(self.pool.clone(), s.log, s.retention_interval, background.clone()));
        loops.spawn(ring::ring_loop(self.pool.clone(), s.ring, background.clone()));
        if let Some(min_changes) = s.first_analyze {
            loops.spawn(statistics::statistics_loop(
                self.pool.clone(),
                min_changes,
                s.first_analyze_interval,
                self.stats.clone(),
                background.clone(),
            ));
        }

        // Completions leave the job's slot at once: a finished handler frees its slot, and
        // its completion joins the next statement (many share one commit under load).
        let (completer, completions) = mpsc::channel(4 * s.complete_batch.max(s.concurrency));
        let parallel = if s.complete_batch <= 1 { s.concurrency } else { COMPLETION_STATEMENTS };
        // Claims and completions: at most one statement per slot, plus the completer's.
        let queue_pool =
            airlock_core::db::queue_plans(&self.pool, (s.concurrency + parallel) as u32, &airlock_queue::QUEUE_TYPES);
        loops.spawn(complete::completion_loop(
            queue_pool.clone(),
            completions,
            s.complete_batch.max(1),
            parallel,
            self.stats.clone(),
        ));
        // One claim per free slot: a finished job's completion and its slot's next claim are
        // one statement.
        let exchange = s.claim_batch.max(1) < s.concurrency && s.complete_batch <= 1;
        let mut slots = Slots::new(
            ExecCtx {
                pool: self.pool.clone(),
                registry: self.registry.clone(),
                lease_len: s.lease,
                in_flight: in_flight.clone(),
                stats: self.stats.clone(),
                completer: completer.clone(),
                exchange,
            },
            s.concurrency,
        );
        let mut claiming = ClaimLoop::new(
            ClaimCtx {
                pool: queue_pool.clone(),
                conns: Arc::new(claim::KeptConns::new(s.check_after_idle)),
                owner: s.id.clone(),
                filter: ClaimFilter { queues: s.queues.clone() },
                lease: s.lease,
                pauses: pauses.clone(),
                cursor,
                ring: Arc::new(claim::RingSeen::default()),
                stats: self.stats.clone(),
                completer: completer.clone(),
            },
            s.claim_batch,
            s.concurrency,
            s.poll_interval,
        );
        claiming.run(&mut slots, &wake, &shutdown).await;
        // Completions still waiting go on their own; claims still in flight: their jobs join
        // the buffer.
        claiming.stop(&mut slots).await;

        // Claimed into a free slot: those are in flight, and run like the others. Claimed
        // beyond the free slots (a batched claim's buffer): give them back at once.
        slots.start_ready();
        slots.release_waiting().await;
        // Soft stop: no new claims; let in-flight jobs finish within the grace period.
        tracing::info!(worker.id = %s.id, in_flight = slots.running(), "stopping: draining in-flight jobs");
        let deadline = tokio::time::Instant::now() + s.shutdown_grace;
        while slots.running() > 0 {
            match tokio::time::timeout_at(deadline, slots.join_next()).await {
                Ok(Some(done)) => {
                    if let Some(c) = slots.reap(done).await {
                        hand_over(&completer, c);
                    }
                }
                Ok(None) => break,
                Err(_) => break,
            }
        }
        // Hard stop: cancel what is left, then give back what had not started its effect.
        if slots.running() > 0 {
            tracing::warn!(worker.id = %s.id, left = slots.running(), "grace period over: cancelling jobs");
            slots.cancel_all();
            while let Some(done) = slots.join_next().await {
                if let Some(c) = slots.reap(done).await {
                    hand_over(&completer, c);
                }
            }
        }
        // The completion loop ends once every sender is gone (the slots', the claim
        // loop's, gone with it, and this one) and its last statement has returned.
        drop(slots);
        drop(completer);
        background.cancel();
        while loops.join_next().await.is_some() {}
        queue_pool.close().await;
        if let Err(e) = airlock_queue::fleet::mark_stopped(&self.pool, &s.id).await {
            tracing::warn!(error = %e, "could not mark the worker stopped");
        }
        tracing::info!(worker.id = %s.id, "worker stopped");
        Ok(())
    }
}

/// A ticker that skips missed ticks instead of bursting after a stall.
fn ticker(every: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// Waits for the next tick; false once `stop` fires.
async fn next_tick(tick: &mut tokio::time::Interval, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tick.tick() => true,
    }
}
