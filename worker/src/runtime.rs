//! The worker runtime: claims jobs in batches, runs their handlers with bounded
//! concurrency, keeps leases alive, rescues expired leases, prunes old jobs, and shuts
//! down gracefully.
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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_core::fault;
use airlock_core::sync::lock;
use airlock_queue::{self as queue, ClaimFilter, ClaimFrom, Job, Lease, QueueError, RescueCounts};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::handler::{HandlerError, JobContext, Outcome, Registry};

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
    pub retention_interval: Duration,
    pub retention_batch: i64,
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
            retention_interval: Duration::from_secs(cfg.retention.interval_seconds.max(1)),
            retention_batch: cfg.retention.batch_size,
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
    /// Wake-ups caused by a NOTIFY.
    pub notify_wakeups: AtomicU64,
    /// Claims that returned jobs right after a NOTIFY wake-up (not after a poll tick).
    pub claims_after_notify: AtomicU64,
    /// Claims that returned jobs after the poll interval elapsed.
    pub claims_after_poll: AtomicU64,
    /// Claims that started from the claim cursor instead of the front of the claim index.
    pub bounded_claims: AtomicU64,
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

/// One in-flight job as the heartbeat loop sees it.
struct Held {
    lease: Lease,
    cancel: CancellationToken,
}

type InFlight = Arc<Mutex<HashMap<airlock_core::ids::JobId, Held>>>;

/// How an execution ended, for the shutdown path.
enum Ended {
    Finished,
    /// The handler succeeded; its completion rides on the worker's next claim.
    Completed(Completion),
    /// The handler was cancelled before it wrote a result.
    Abandoned(Lease),
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
        airlock_queue::fleet::register(&self.pool, &s.id, &hostname(), s.queues.as_deref(), s.concurrency as i32)
            .await?;
        tracing::info!(worker.id = %s.id, concurrency = s.concurrency, "worker started");

        let in_flight: InFlight = Arc::new(Mutex::new(HashMap::new()));
        let wake = Arc::new(Notify::new());
        let pauses = Arc::new(Pauses::default());
        let cursor = Arc::new(ClaimCursor::default());
        // Background loops live until the drain is over (heartbeats must outlive it).
        let background = CancellationToken::new();
        let mut loops = JoinSet::new();
        loops.spawn(listen_loop(
            self.pool.clone(),
            wake.clone(),
            pauses.clone(),
            cursor.clone(),
            self.stats.clone(),
            background.clone(),
        ));
        loops.spawn(heartbeat_loop(
            self.pool.clone(),
            s.clone(),
            in_flight.clone(),
            self.stats.clone(),
            background.clone(),
        ));
        loops.spawn(rescue_loop(
            self.pool.clone(),
            self.registry.clone(),
            s.rescue_interval,
            self.stats.clone(),
            background.clone(),
        ));
        if let Some(age) = s.retention {
            loops.spawn(retention_loop(
                self.pool.clone(),
                age,
                s.retention_interval,
                s.retention_batch,
                self.stats.clone(),
                background.clone(),
            ));
        }

        let mut tasks: JoinSet<Ended> = JoinSet::new();
        let mut task_leases: HashMap<tokio::task::Id, Lease> = HashMap::new();
        // Claimed jobs waiting for a free slot (only when `claim_batch` > free slots); their
        // leases are heartbeated like running ones and released on shutdown.
        let mut ready: VecDeque<(Job, CancellationToken)> = VecDeque::new();
        // Completions leave the job's slot at once: a finished handler frees its slot, and
        // its completion joins the next statement (many share one commit under load).
        let (completer, completions) = mpsc::channel(4 * s.complete_batch.max(s.concurrency));
        let parallel = if s.complete_batch <= 1 { s.concurrency } else { COMPLETION_STATEMENTS };
        // Claims and completions: at most one statement per slot, plus the completer's.
        let queue_pool = airlock_core::db::generic_plans(&self.pool, (s.concurrency + parallel) as u32);
        loops.spawn(completion_loop(
            queue_pool.clone(),
            completions,
            s.complete_batch.max(1),
            parallel,
            self.stats.clone(),
        ));
        // One claim per free slot: a finished job's completion and its slot's next claim are
        // one statement.
        let want_per_slot = s.claim_batch.max(1) < s.concurrency && s.complete_batch <= 1;
        let ctx = ExecCtx {
            pool: self.pool.clone(),
            registry: self.registry.clone(),
            lease_len: s.lease,
            in_flight: in_flight.clone(),
            stats: self.stats.clone(),
            completer: completer.clone(),
            exchange: want_per_slot,
        };
        let claim_ctx = ClaimCtx {
            pool: queue_pool.clone(),
            owner: s.id.clone(),
            filter: ClaimFilter { queues: s.queues.clone() },
            lease: s.lease,
            pauses: pauses.clone(),
            cursor,
            stats: self.stats.clone(),
            completer: completer.clone(),
        };
        let want = s.claim_batch.max(1);
        // Claims run as tasks of their own, so claiming overlaps running and completing: in
        // per-job mode every free slot has its claim in flight (their commits share log
        // flushes); in batched mode the next batch is claimed while half of the buffer
        // remains.
        let mut claims: JoinSet<ClaimResult> = JoinSet::new();
        let mut reserved = 0usize;
        // The last claim came back short (or failed): wait for a wake-up before claiming.
        let mut idle = false;
        let mut woke_by_notify = false;
        let mut db_backoff = Duration::from_millis(100);
        let mut backoff_until: Option<tokio::time::Instant> = None;
        // Completions waiting for the next claim (see `exchange`).
        let mut pending: Vec<Completion> = Vec::new();

        while !shutdown.is_cancelled() {
            start_ready(&mut ready, &mut tasks, &mut task_leases, s.concurrency, &ctx);
            if !idle && backoff_until.is_none() {
                if want < s.concurrency {
                    let free = s.concurrency.saturating_sub(tasks.len() + ready.len() + reserved);
                    for _ in 0..free / want {
                        spawn_claim(&mut claims, &claim_ctx, want, woke_by_notify, std::mem::take(&mut pending));
                        reserved += want;
                    }
                } else if want > s.concurrency {
                    // Prefetching: jobs waiting beyond the slots, counting the claims in flight
                    // as full; a claim starts once half a batch has left the last one claimed.
                    while claims.len() < BATCHES_AHEAD
                        && (ready.len() + claims.len() * want) * 2 < (2 * BATCHES_AHEAD - 1) * want
                    {
                        spawn_claim(&mut claims, &claim_ctx, want, woke_by_notify, Vec::new());
                    }
                } else if claims.is_empty() {
                    // As many as there are free slots, and none to wait in a buffer: a job
                    // waiting here could run now on another worker.
                    let free = s.concurrency.saturating_sub(tasks.len() + ready.len());
                    if free > 0 {
                        spawn_claim(&mut claims, &claim_ctx, free, woke_by_notify, Vec::new());
                    }
                }
            }
            // No claim to ride on: complete them on their own.
            for c in pending.drain(..) {
                hand_over(&completer, c);
            }
            woke_by_notify = false;
            let has_room = tasks.len() + ready.len() < s.concurrency;
            let backoff = backoff_until;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(done) = claims.join_next() => {
                    let Ok(done) = done else { continue };
                    reserved = reserved.saturating_sub(if want < s.concurrency { want } else { 0 });
                    metrics::histogram!(airlock_core::metrics::CLAIM_SECONDS).record(done.took.as_secs_f64());
                    match done.jobs {
                        Ok(jobs) => {
                            db_backoff = Duration::from_millis(100);
                            if jobs.len() < done.asked {
                                idle = true;
                            }
                            if !jobs.is_empty() {
                                bump(if done.after_notify { &self.stats.claims_after_notify } else { &self.stats.claims_after_poll });
                            }
                            for job in jobs {
                                bump(&self.stats.claimed);
                                metrics::counter!(airlock_core::metrics::JOBS_CLAIMED, "kind" => job.kind.clone())
                                    .increment(1);
                                hold(&in_flight, &mut ready, job);
                            }
                            // At once, so a stop arriving now finds them in flight, not waiting.
                            start_ready(&mut ready, &mut tasks, &mut task_leases, s.concurrency, &ctx);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "claim failed; retrying");
                            backoff_until = Some(tokio::time::Instant::now() + db_backoff);
                            db_backoff = (db_backoff * 2).min(CLAIM_BACKOFF_MAX);
                        }
                    }
                }
                Some(done) = tasks.join_next_with_id() => {
                    pending.extend(reap(done, &mut task_leases, &self.pool, &in_flight, &self.stats).await);
                }
                // A notification also means the database answers again: no need to sit out
                // the rest of a back-off.
                _ = wake.notified(), if has_room => { idle = false; woke_by_notify = true; backoff_until = None; }
                _ = tokio::time::sleep(s.poll_interval), if has_room && idle => { idle = false; }
                _ = async { if let Some(t) = backoff { tokio::time::sleep_until(t).await } }, if backoff.is_some() => {
                    backoff_until = None;
                }
            }
        }

        for c in pending.drain(..) {
            hand_over(&completer, c);
        }
        // Claims still in flight: their jobs join the buffer.
        while let Some(done) = claims.join_next().await {
            if let Ok(ClaimResult { jobs: Ok(jobs), .. }) = done {
                for job in jobs {
                    hold(&in_flight, &mut ready, job);
                }
            }
        }

        // Claimed into a free slot: those are in flight, and run like the others. Claimed
        // beyond the free slots (a batched claim's buffer): give them back at once.
        start_ready(&mut ready, &mut tasks, &mut task_leases, s.concurrency, &ctx);
        for (job, _) in ready.drain(..) {
            lock(&in_flight).remove(&job.id);
            match queue::release(&self.pool, job.lease()).await {
                Ok(()) => bump(&self.stats.released),
                Err(e) => tracing::warn!(job.id = %job.id, error = %e, "could not release an unstarted job"),
            }
        }
        // Soft stop: no new claims; let in-flight jobs finish within the grace period.
        tracing::info!(worker.id = %s.id, in_flight = tasks.len(), "stopping: draining in-flight jobs");
        let deadline = tokio::time::Instant::now() + s.shutdown_grace;
        while !tasks.is_empty() {
            match tokio::time::timeout_at(deadline, tasks.join_next_with_id()).await {
                Ok(Some(done)) => {
                    if let Some(c) = reap(done, &mut task_leases, &self.pool, &in_flight, &self.stats).await {
                        hand_over(&completer, c);
                    }
                }
                Ok(None) => break,
                Err(_) => break,
            }
        }
        // Hard stop: cancel what is left, then give back what had not started its effect.
        if !tasks.is_empty() {
            tracing::warn!(worker.id = %s.id, left = tasks.len(), "grace period over: cancelling jobs");
            for held in lock(&in_flight).values() {
                held.cancel.cancel();
            }
            while let Some(done) = tasks.join_next_with_id().await {
                if let Some(c) = reap(done, &mut task_leases, &self.pool, &in_flight, &self.stats).await {
                    hand_over(&completer, c);
                }
            }
        }
        drop(ctx);
        drop(claim_ctx);
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

/// The paused queues as this worker last read them, so a claim is one statement: re-read
/// when a pause or resume is announced, when LISTEN reconnects, and at the latest every
/// [`queue::PAUSES_MAX_AGE`].
#[derive(Default)]
struct Pauses {
    state: Mutex<PausesState>,
}

#[derive(Default)]
struct PausesState {
    list: Arc<Vec<String>>,
    read_at: Option<Instant>,
    /// Bumped by every invalidation, so a read that raced one is not kept.
    generation: u64,
}

impl Pauses {
    fn invalidate(&self) {
        let mut st = lock(&self.state);
        st.read_at = None;
        st.generation += 1;
    }

    async fn get(&self, pool: &PgPool) -> Result<Arc<Vec<String>>, QueueError> {
        let generation = {
            let st = lock(&self.state);
            if st.read_at.is_some_and(|t| t.elapsed() < queue::PAUSES_MAX_AGE) {
                return Ok(st.list.clone());
            }
            st.generation
        };
        let read_at = Instant::now();
        let list = Arc::new(queue::paused_queues(pool).await?);
        let mut st = lock(&self.state);
        if st.generation == generation {
            st.list = list.clone();
            st.read_at = Some(read_at);
        }
        Ok(list)
    }
}

/// Where this worker's claims start. Normally every claim walks the claim index from
/// its front, which is cheap. When that becomes slow (the front is full of entries of
/// jobs already claimed that no vacuum may remove yet, see [`ClaimFrom`]), claims start
/// [`CURSOR_SLACK`] behind the last job claimed instead, and an unbounded claim still runs
/// at least every [`UNBOUNDED_EVERY`] (less often when it is slower, so it never takes
/// more than about 1/[`UNBOUNDED_SHARE`] of the time) to find what sorts earlier: a job
/// of a more urgent priority, released or rescued, or of a resumed queue. Such a job waits
/// at most that long; no job is skipped for good.
#[derive(Default)]
struct ClaimCursor {
    state: Mutex<CursorState>,
}

#[derive(Default)]
struct CursorState {
    /// The ordering key of the last job claimed, in claim order.
    last: Option<(i16, DateTime<Utc>)>,
    /// When the latest unbounded claim started, and how long it took.
    unbounded_at: Option<Instant>,
    unbounded_took: Duration,
}

/// An unbounded claim slower than this means that claims should start from the cursor.
const CURSOR_ENGAGE: Duration = Duration::from_millis(2);
/// How far behind the last job claimed a bounded claim starts: a job enqueued by a
/// transaction that began earlier (its `run_at` is that transaction's start) and committed
/// later still sorts after the bound.
const CURSOR_SLACK: chrono::TimeDelta = chrono::TimeDelta::seconds(1);
/// The longest wait for an unbounded claim while claims start from the cursor.
const UNBOUNDED_EVERY: Duration = Duration::from_secs(1);
/// Unbounded claims are spaced at least this many times their own duration.
const UNBOUNDED_SHARE: u32 = 50;

impl ClaimCursor {
    /// Where the next claim starts; `None`: from the front.
    fn from(&self, now: Instant) -> Option<ClaimFrom> {
        let st = lock(&self.state);
        let (priority, run_at) = st.last?;
        let at = st.unbounded_at?;
        if st.unbounded_took < CURSOR_ENGAGE
            || now.saturating_duration_since(at) >= UNBOUNDED_EVERY.max(st.unbounded_took * UNBOUNDED_SHARE)
        {
            return None;
        }
        Some(ClaimFrom { priority, run_at: run_at - CURSOR_SLACK })
    }

    /// Takes in what a claim that started at `started` brought back (in claim order).
    fn record(&self, from: Option<ClaimFrom>, started: Instant, took: Duration, jobs: &[Job]) {
        let mut st = lock(&self.state);
        let last = jobs.last().map(|j| (j.priority, j.run_at));
        if from.is_none() {
            if st.unbounded_at.is_none_or(|at| at <= started) {
                st.unbounded_at = Some(started);
                st.unbounded_took = took;
            }
            // An unbounded claim may have found jobs sorting before the cursor: start again from there.
            if last.is_some() {
                st.last = last;
            }
        } else if let Some(last) = last {
            st.last = Some(st.last.map_or(last, |l| l.max(last)));
        }
    }

    /// The next claim is unbounded (jobs may have appeared before the cursor).
    fn rewind(&self) {
        lock(&self.state).unbounded_at = None;
    }
}

/// Settles a finished task: releases an abandoned job, fails a panicked one.
async fn reap(
    done: Result<(tokio::task::Id, Ended), tokio::task::JoinError>,
    task_leases: &mut HashMap<tokio::task::Id, Lease>,
    pool: &PgPool,
    in_flight: &InFlight,
    stats: &WorkerStats,
) -> Option<Completion> {
    match done {
        Ok((id, Ended::Finished)) => {
            task_leases.remove(&id);
        }
        Ok((id, Ended::Completed(c))) => {
            task_leases.remove(&id);
            return Some(c);
        }
        Ok((id, Ended::Abandoned(lease))) => {
            task_leases.remove(&id);
            match queue::release(pool, lease).await {
                Ok(()) => bump(&stats.released),
                Err(QueueError::LeaseLost { .. }) => {
                    // Lost, finished elsewhere, or its effect started: the rescuer decides.
                }
                Err(e) => tracing::warn!(job.id = %lease.id(), error = %e, "could not release job"),
            }
        }
        Err(e) => {
            let lease = task_leases.remove(&e.id())?;
            lock(in_flight).remove(&lease.id());
            tracing::error!(job.id = %lease.id(), error = %e, "job handler panicked");
            match queue::fail(pool, lease, "handler panicked", false, None).await {
                Ok(_) => bump(&stats.retried),
                Err(e) => tracing::warn!(job.id = %lease.id(), error = %e, "could not fail panicked job"),
            }
        }
    }
    None
}

/// Gives a completion to the completer without waiting (a full channel gets a task of
/// its own to wait in).
fn hand_over(completer: &mpsc::Sender<Completion>, c: Completion) {
    if let Err(mpsc::error::TrySendError::Full(c)) = completer.try_send(c) {
        let completer = completer.clone();
        tokio::spawn(async move {
            let _ = completer.send(c).await;
        });
    }
}

/// The longest pause between failed claims: after an outage, claiming resumes within
/// about a second of the database answering (sooner when LISTEN reconnects first).
const CLAIM_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What one claim statement brought back.
struct ClaimResult {
    jobs: Result<Vec<Job>, QueueError>,
    /// The most jobs the claim asked for: fewer means none are left to claim now.
    asked: usize,
    took: Duration,
    /// The claim was made right after a NOTIFY woke the worker.
    after_notify: bool,
}

/// What every claim needs.
#[derive(Clone)]
struct ClaimCtx {
    pool: PgPool,
    owner: String,
    filter: ClaimFilter,
    lease: Duration,
    pauses: Arc<Pauses>,
    cursor: Arc<ClaimCursor>,
    stats: Arc<WorkerStats>,
    /// Where completions go when the claim they rode on failed.
    completer: mpsc::Sender<Completion>,
}

/// Starts one claim of up to `want` jobs as a task of its own; it also completes
/// `completing` in the same statement.
fn spawn_claim(
    claims: &mut JoinSet<ClaimResult>,
    c: &ClaimCtx,
    want: usize,
    after_notify: bool,
    completing: Vec<Completion>,
) {
    let c = c.clone();
    claims.spawn(async move {
        let started = Instant::now();
        let from = c.cursor.from(started);
        let leases: Vec<Lease> = completing.iter().map(|x| x.lease).collect();
        let result = match c.pauses.get(&c.pool).await {
            Ok(paused) => {
                let claim = queue::Claim {
                    owner: &c.owner,
                    filter: &c.filter,
                    limit: want as i64,
                    lease: c.lease,
                    paused: &paused,
                    from,
                };
                queue::complete_and_claim(&c.pool, &claim, &leases).await
            }
            Err(e) => Err(e),
        };
        let took = started.elapsed();
        let jobs = match result {
            Ok((jobs, done)) => {
                account(completing, &done.into_iter().collect(), &c.stats).await;
                Ok(jobs)
            }
            Err(e) => {
                // Not completed: the completer tries them on their own.
                for x in completing {
                    hand_over(&c.completer, x);
                }
                Err(e)
            }
        };
        if let Ok(jobs) = &jobs {
            c.cursor.record(from, started, took, jobs);
        }
        if from.is_some() {
            bump(&c.stats.bounded_claims);
        }
        ClaimResult { jobs, asked: want, took, after_notify }
    });
}

/// What every job execution needs from its worker.
#[derive(Clone)]
struct ExecCtx {
    pool: PgPool,
    registry: Arc<Registry>,
    lease_len: Duration,
    in_flight: InFlight,
    stats: Arc<WorkerStats>,
    /// Takes successful jobs' completions off their slots.
    completer: mpsc::Sender<Completion>,
    /// Successful jobs hand their completion back to the worker, which completes it in the
    /// statement that claims the freed slot's next job (one claim per slot).
    exchange: bool,
}

/// Takes a claimed job into the buffer; from now on its lease is heartbeated, and a lost
/// lease cancels it.
fn hold(in_flight: &InFlight, ready: &mut VecDeque<(Job, CancellationToken)>, job: Job) {
    let cancel = CancellationToken::new();
    lock(in_flight).insert(job.id, Held { lease: job.lease(), cancel: cancel.clone() });
    ready.push_back((job, cancel));
}

/// Starts buffered jobs while there are free slots; drops those whose lease was lost
/// while they waited.
fn start_ready(
    ready: &mut VecDeque<(Job, CancellationToken)>,
    tasks: &mut JoinSet<Ended>,
    task_leases: &mut HashMap<tokio::task::Id, Lease>,
    concurrency: usize,
    ctx: &ExecCtx,
) {
    while tasks.len() < concurrency {
        let Some((job, cancel)) = ready.pop_front() else { return };
        if cancel.is_cancelled() {
            lock(&ctx.in_flight).remove(&job.id);
            continue;
        }
        let lease = job.lease();
        let handle = tasks.spawn(execute(ctx.clone(), job, cancel));
        task_leases.insert(handle.id(), lease);
    }
}

/// A job whose handler succeeded, waiting for the statement that completes it.
struct Completion {
    lease: Lease,
    kind: String,
}

/// The longest pause between two tries of a failed completion statement (about 1.5 s of
/// tries in all).
const COMPLETION_RETRY_MAX: Duration = Duration::from_millis(800);

/// Batches claimed ahead of the slots when claims prefetch (`claim_batch` above
/// `concurrency`), counting claims in flight: one claim's commit overlaps the next one's.
/// Without prefetching, a worker claims only for its free slots, so slow jobs never wait in
/// its buffer while another worker could run them.
const BATCHES_AHEAD: usize = 2;

/// Completion statements in flight at once when completions are batched.
const COMPLETION_STATEMENTS: usize = 2;

/// Completes jobs: takes what is queued (up to `max`) and completes it in one statement,
/// with up to `parallel` statements in flight, so under load many completions share one
/// commit; alone, a completion goes out at once. Ends when every sender is gone and
/// every statement has returned.
async fn completion_loop(
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
async fn account(batch: Vec<Completion>, done: &HashSet<Lease>, stats: &WorkerStats) {
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
    lock(&in_flight).remove(&job.id);
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

/// LISTENs for enqueue notifications and wakes the claim loop. Reconnects by itself; after
/// a reconnect it wakes the loop once, since notifications may have been missed.
async fn listen_loop(
    pool: PgPool,
    wake: Arc<Notify>,
    pauses: Arc<Pauses>,
    cursor: Arc<ClaimCursor>,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    // What the worker keeps between claims may be stale: the paused queues, and whether a
    // job now sorts before its claim cursor.
    let forget = || {
        pauses.invalidate();
        cursor.rewind();
    };
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(queue::NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            _ = stop.cancelled() => return,
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN failed; polling until it is back");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(100);
        forget();
        stats.listening.store(true, Ordering::SeqCst);
        wake.notify_one();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => {
                        if n.payload().starts_with(queue::PAUSE_NOTIFY_PREFIX) {
                            forget();
                        }
                        bump(&stats.notify_wakeups);
                        wake.notify_one();
                    }
                    // The connection was lost and re-established: notifications may be missed.
                    Ok(None) => {
                        forget();
                        wake.notify_one();
                    }
                    Err(e) => {
                        stats.listening.store(false, Ordering::SeqCst);
                        tracing::warn!(error = %e, "LISTEN connection failed");
                        break;
                    }
                }
            }
        }
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

/// Extends the leases of in-flight jobs every lease/3 and refreshes the worker row.
async fn heartbeat_loop(
    pool: PgPool,
    s: WorkerSettings,
    in_flight: InFlight,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let every = (s.lease / 3).min(s.heartbeat_interval).max(Duration::from_millis(200));
    let mut tick = ticker(every);
    // Leases a heartbeat did not find held. A handler that ends its job in its own
    // transaction is still in flight for a moment after that commit, so a lease is only
    // taken as lost when the next heartbeat finds its job still in flight: cancelling at
    // the first miss would interrupt handlers that had just finished.
    let mut missed: std::collections::HashSet<Lease> = Default::default();
    while next_tick(&mut tick, &stop).await {
        let leases: Vec<Lease> = lock(&in_flight).values().map(|h| h.lease).collect();
        match queue::heartbeat_many(&pool, &leases, s.lease).await {
            Ok(held) => {
                let held: std::collections::HashSet<Lease> = held.into_iter().collect();
                let map = lock(&in_flight);
                let mut still_missed = std::collections::HashSet::new();
                for lease in leases.iter().filter(|l| !held.contains(l)) {
                    let Some(h) = map.get(&lease.id()).filter(|h| h.lease == *lease) else { continue };
                    if missed.contains(lease) {
                        bump(&stats.lease_lost);
                        tracing::warn!(job.id = %lease.id(), job.attempt = lease.attempt(), "lease lost: cancelling the job");
                        h.cancel.cancel();
                    } else {
                        still_missed.insert(*lease);
                    }
                }
                missed = still_missed;
            }
            Err(e) => tracing::warn!(error = %e, "lease heartbeat failed"),
        }
        let n = lock(&in_flight).len() as i32;
        if let Err(e) = airlock_queue::fleet::heartbeat(&pool, &s.id, n).await {
            tracing::warn!(error = %e, "worker heartbeat failed");
        }
    }
}

/// Runs the rescuer every `interval`.
async fn rescue_loop(
    pool: PgPool,
    registry: Arc<Registry>,
    interval: Duration,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        match rescue_once(&pool, &registry, 100).await {
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
/// in the same transaction. Repeats while full batches come back.
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

async fn retention_loop(
    pool: PgPool,
    age: Duration,
    interval: Duration,
    batch: i64,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    let mut tick = ticker(interval);
    while next_tick(&mut tick, &stop).await {
        loop {
            match queue::prune_finished(&pool, age, batch).await {
                Ok(n) => {
                    stats.pruned.fetch_add(n, Ordering::Relaxed);
                    if (n as i64) < batch || stop.is_cancelled() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "retention pass failed");
                    break;
                }
            }
        }
    }
}
