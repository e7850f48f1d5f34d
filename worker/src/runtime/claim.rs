//! Claiming: the claim loop, which decides when to claim and how many jobs, runs each
//! claim as a task of its own, and hands what comes back to the slots; and the caches that
//! keep a claim one statement: the paused queues ([`Pauses`]), where claims start
//! ([`ClaimCursor`]) and the slots of the ring they read ([`RingSeen`]).
//!
//! The claiming policy, from `claim_batch` and `concurrency`:
//! - `claim_batch` below `concurrency`: claims of `claim_batch` per free slots, each
//!   counted as reserved until it returns. With one completion per statement this is
//!   exchange mode: a finished job's completion rides on its slot's next claim.
//! - `claim_batch` above `concurrency`: prefetching. Up to [`BATCHES_AHEAD`] batches
//!   wait beyond the slots (counting claims in flight as full); a claim starts once half a
//!   batch has left the last one claimed.
//! - Otherwise: one claim at a time, for as many jobs as there are free slots and no more,
//!   so no job waits here that another worker could run now.
//!
//! Invariants:
//! - A worker claims only while it is neither idle (the last claim came back short and
//!   passed over no slot of the ring holding rows: it waits for a NOTIFY or the poll, due
//!   one poll interval after it went idle, however many jobs finish meanwhile) nor backing
//!   off after a failed claim.
//! - Completions carried by a claim that failed go to the completer, which tries them on
//!   their own; none is dropped.
//! - Claimed jobs are held (heartbeated) from the moment their claim returns, in the
//!   loop and on stop alike.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_core::sync::lock;
use airlock_queue::{self as queue, ClaimFilter, ClaimFrom, Job, Lease, QueueError};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgPool, Postgres};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::complete::{Completion, account, hand_over};
use super::execute::Slots;
use super::{WorkerStats, bump};

/// The longest pause between failed claims: after an outage, claiming resumes within
/// about a second of the database answering (sooner when LISTEN reconnects first).
const CLAIM_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The first pause after a failed claim, and the pause again once a claim succeeds.
const CLAIM_BACKOFF_MIN: Duration = Duration::from_millis(100);

/// Batches claimed ahead of the slots when claims prefetch (`claim_batch` above
/// `concurrency`), counting claims in flight: one claim's commit overlaps the next one's.
/// Without prefetching, a worker claims only for its free slots, so slow jobs never wait in
/// its buffer while another worker could run them.
const BATCHES_AHEAD: usize = 2;

/// What every claim needs.
#[derive(Clone)]
pub(super) struct ClaimCtx {
    pub(super) pool: PgPool,
    /// Connections kept between claims.
    pub(super) conns: Arc<KeptConns>,
    pub(super) owner: String,
    pub(super) filter: ClaimFilter,
    pub(super) lease: Duration,
    pub(super) pauses: Arc<Pauses>,
    pub(super) cursor: Arc<ClaimCursor>,
    pub(super) ring: Arc<RingSeen>,
    pub(super) stats: Arc<WorkerStats>,
    /// Where completions go when the claim they rode on failed.
    pub(super) completer: mpsc::Sender<Completion>,
}

/// What one claim statement brought back.
struct ClaimResult {
    jobs: Result<Vec<Job>, QueueError>,
    /// The most jobs the claim asked for: fewer means none are left to claim now, unless
    /// the claim passed over a slot of the ring holding rows (`passed_over`).
    asked: usize,
    passed_over: bool,
    took: Duration,
    /// The claim was made right after a NOTIFY woke the worker.
    after_notify: bool,
    /// The worker's wake-ups when the claim started (see `ClaimLoop::wakes`).
    wakes: u64,
}

/// Claims to start now: `count` claims of up to `size` jobs each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claims {
    count: usize,
    size: usize,
}

/// The claiming policy (see the module's header): the claims to start, given `want` jobs
/// per claim (`claim_batch`), the slots, the jobs `running` and `waiting` for a slot, the
/// slots `reserved` by per-slot claims in flight and the claims in flight.
fn claims_to_start(
    want: usize,
    concurrency: usize,
    running: usize,
    waiting: usize,
    reserved: usize,
    in_flight: usize,
) -> Claims {
    if want < concurrency {
        let free = concurrency.saturating_sub(running + waiting + reserved);
        Claims { count: free / want, size: want }
    } else if want > concurrency {
        // Prefetching: jobs waiting beyond the slots, counting the claims in flight as
        // full; a claim starts once half a batch has left the last one claimed.
        let mut claims = in_flight;
        while claims < BATCHES_AHEAD && (waiting + claims * want) * 2 < (2 * BATCHES_AHEAD - 1) * want {
            claims += 1;
        }
        Claims { count: claims - in_flight, size: want }
    } else if in_flight == 0 {
        // As many as there are free slots, and none to wait in a buffer: a job waiting
        // here could run now on another worker.
        let free = concurrency.saturating_sub(running + waiting);
        Claims { count: usize::from(free > 0), size: free }
    } else {
        Claims { count: 0, size: 0 }
    }
}

/// The claim loop and its state between turns.
///
/// Claims run as tasks of their own, so claiming overlaps running and completing: in
/// per-slot mode every free slot has its claim in flight (their commits share log
/// flushes); in batched mode the next batch is claimed while half of the buffer remains.
pub(super) struct ClaimLoop {
    ctx: ClaimCtx,
    /// Jobs per claim (`claim_batch`, at least 1).
    want: usize,
    concurrency: usize,
    poll_interval: Duration,
    claims: JoinSet<ClaimResult>,
    /// Slots taken by per-slot claims in flight, so a free slot gets one claim, not one
    /// per turn of the loop.
    reserved: usize,
    /// The last claim came back short (or failed): wait for a wake-up before claiming.
    idle: bool,
    /// While idle: when to poll, fixed when the worker went idle, so jobs finishing meanwhile
    /// do not push the poll back (a job due without a NOTIFY — a retry's back-off, a
    /// snooze — would otherwise wait until the running work drained).
    poll_at: Option<tokio::time::Instant>,
    /// This turn follows a NOTIFY wake-up, for the `claims_after_notify` counter.
    woke_by_notify: bool,
    /// Wake-ups so far. A claim that comes back short leaves the worker idle only if none
    /// came after it started: its snapshot may predate the jobs a later NOTIFY announced,
    /// and that NOTIFY, taken while the claim was in flight, will not come again.
    wakes: u64,
    /// The pause after the next failed claim; doubles up to [`CLAIM_BACKOFF_MAX`].
    db_backoff: Duration,
    /// No claim before this, after a failed one.
    backoff_until: Option<tokio::time::Instant>,
    /// Completions waiting for the next claim (see `ExecCtx::exchange`).
    pending: Vec<Completion>,
}

impl ClaimLoop {
    pub(super) fn new(ctx: ClaimCtx, claim_batch: usize, concurrency: usize, poll_interval: Duration) -> Self {
        Self {
            ctx,
            want: claim_batch.max(1),
            concurrency,
            poll_interval,
            claims: JoinSet::new(),
            reserved: 0,
            idle: false,
            poll_at: None,
            woke_by_notify: false,
            wakes: 0,
            db_backoff: CLAIM_BACKOFF_MIN,
            backoff_until: None,
            pending: Vec::new(),
        }
    }

    /// Claims into `slots` and settles their finished jobs until `shutdown` fires; woken
    /// early from idle by `wake` (a NOTIFY, or LISTEN reconnecting).
    pub(super) async fn run(&mut self, slots: &mut Slots, wake: &Notify, shutdown: &CancellationToken) {
        while !shutdown.is_cancelled() {
            slots.start_ready();
            if !self.idle && self.backoff_until.is_none() {
                self.start_claims(slots);
            }
            // No claim to ride on: complete them on their own.
            for c in self.pending.drain(..) {
                hand_over(&self.ctx.completer, c);
            }
            self.woke_by_notify = false;
            let has_room = slots.running() + slots.waiting() < self.concurrency;
            let backoff = self.backoff_until;
            let poll_at = if self.idle {
                *self.poll_at.get_or_insert_with(|| tokio::time::Instant::now() + self.poll_interval)
            } else {
                tokio::time::Instant::now()
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(done) = self.claims.join_next() => {
                    let Ok(done) = done else { continue };
                    self.take_in(done, slots);
                }
                Some(done) = slots.join_next() => {
                    let completion = slots.reap(done).await;
                    self.pending.extend(completion);
                }
                // A notification also means the database answers again: no need to sit out
                // the rest of a back-off.
                _ = wake.notified(), if has_room => {
                    // Idle, the worker has caught up with the queue: what woke it may sort
                    // before the cursor (a send, ahead of the scoring the cursor follows),
                    // and a claim from the cursor would leave it to the next unbounded one.
                    if self.idle {
                        self.ctx.cursor.rewind();
                    }
                    self.idle = false;
                    self.poll_at = None;
                    self.woke_by_notify = true;
                    self.wakes += 1;
                    self.backoff_until = None;
                }
                _ = tokio::time::sleep_until(poll_at), if has_room && self.idle => {
                    self.idle = false;
                    self.poll_at = None;
                }
                _ = async { if let Some(t) = backoff { tokio::time::sleep_until(t).await } }, if backoff.is_some() => {
                    self.backoff_until = None;
                }
            }
        }
    }

    /// Ends claiming: completions still waiting go to the completer, and the jobs of the
    /// claims still in flight join the buffer (held, so the stop releases or runs them).
    pub(super) async fn stop(mut self, slots: &mut Slots) {
        for c in self.pending.drain(..) {
            hand_over(&self.ctx.completer, c);
        }
        while let Some(done) = self.claims.join_next().await {
            if let Ok(ClaimResult { jobs: Ok(jobs), .. }) = done {
                for job in jobs {
                    slots.hold(job);
                }
            }
        }
    }

    /// Starts the claims the policy asks for; per-slot claims carry the completions
    /// waiting (the first one takes them all).
    fn start_claims(&mut self, slots: &Slots) {
        let per_slot = self.want < self.concurrency;
        let Claims { count, size } = claims_to_start(
            self.want,
            self.concurrency,
            slots.running(),
            slots.waiting(),
            self.reserved,
            self.claims.len(),
        );
        for _ in 0..count {
            let completing = if per_slot { std::mem::take(&mut self.pending) } else { Vec::new() };
            spawn_claim(&mut self.claims, &self.ctx, size, (self.woke_by_notify, self.wakes), completing);
            if per_slot {
                self.reserved += size;
            }
        }
    }

    /// Takes in what a claim brought back: its jobs into the slots, or a back-off.
    fn take_in(&mut self, done: ClaimResult, slots: &mut Slots) {
        self.reserved = self.reserved.saturating_sub(if self.want < self.concurrency { self.want } else { 0 });
        metrics::histogram!(airlock_core::metrics::CLAIM_SECONDS).record(done.took.as_secs_f64());
        match done.jobs {
            Ok(jobs) => {
                self.db_backoff = CLAIM_BACKOFF_MIN;
                if jobs.len() < done.asked && done.wakes == self.wakes && !done.passed_over {
                    self.idle = true;
                }
                // Made again at once, for the jobs it passed over: for what woke it, if a NOTIFY did.
                if done.passed_over {
                    self.woke_by_notify |= done.after_notify;
                }
                let stats = &self.ctx.stats;
                if !jobs.is_empty() {
                    bump(if done.after_notify { &stats.claims_after_notify } else { &stats.claims_after_poll });
                }
                for job in jobs {
                    bump(&stats.claimed);
                    metrics::counter!(airlock_core::metrics::JOBS_CLAIMED, "kind" => job.kind.clone()).increment(1);
                    slots.hold(job);
                }
                // At once, so a stop arriving now finds them in flight, not waiting.
                slots.start_ready();
            }
            Err(e) => {
                tracing::warn!(error = %e, "claim failed; retrying");
                bump(&self.ctx.stats.failed_claims);
                self.backoff_until = Some(tokio::time::Instant::now() + self.db_backoff);
                self.db_backoff = (self.db_backoff * 2).min(CLAIM_BACKOFF_MAX);
            }
        }
    }
}

/// Starts one claim of up to `want` jobs as a task of its own; it also completes
/// `completing` in the same statement.
fn spawn_claim(
    claims: &mut JoinSet<ClaimResult>,
    c: &ClaimCtx,
    want: usize,
    (after_notify, wakes): (bool, u64),
    completing: Vec<Completion>,
) {
    let c = c.clone();
    claims.spawn(async move {
        let started = Instant::now();
        let from = c.cursor.from(started);
        let leases: Vec<Lease> = completing.iter().map(|x| x.lease).collect();
        let ring = c.ring.get();
        let result = match c.pauses.get(&c.pool).await {
            Ok(paused) => {
                let claim = queue::Claim {
                    owner: &c.owner,
                    filter: &c.filter,
                    limit: want as i64,
                    lease: c.lease,
                    paused: &paused,
                    from,
                    ring: &ring,
                };
                match c.conns.take(&c.pool).await {
                    Ok(mut conn) => {
                        let result = queue::complete_and_claim(&mut *conn, &claim, &leases).await;
                        // After an error the connection goes back to the pool, which checks it.
                        if result.is_ok() {
                            c.conns.keep(conn);
                        }
                        result
                    }
                    Err(e) => Err(e.into()),
                }
            }
            Err(e) => Err(e),
        };
        let took = started.elapsed();
        let mut passed_over = false;
        let jobs = match result {
            Ok(claimed) => {
                c.ring.set(&claimed.ring);
                passed_over = claimed.passed_over;
                account(completing, &claimed.done.into_iter().collect(), &c.stats).await;
                Ok(claimed.jobs)
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
        ClaimResult { jobs, asked: want, passed_over, took, after_notify, wakes }
    });
}

/// The longest a connection stays kept unused.
const KEPT_AT_MOST: Duration = Duration::from_secs(60);

/// Connections a worker's claims keep between statements instead of handing them back to
/// the pool: the pool checks a connection by a round trip when it is handed back (sqlx
/// does, whatever its settings), which made a claim three round trips instead of one. At
/// most as many are kept as claims run at once (one per slot at the most), out of the
/// pool the claims and completions share, sized for them. The last kept is used first; one
/// kept for `check_after` or longer is checked before use, and a broken one closed.
pub(super) struct KeptConns {
    kept: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    check_after: Duration,
}

impl KeptConns {
    pub(super) fn new(check_after: Duration) -> Self {
        Self { kept: Mutex::new(Vec::new()), check_after }
    }

    /// A kept connection that answers, or one from `pool`.
    async fn take(&self, pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        loop {
            let Some((mut conn, since)) = lock(&self.kept).pop() else {
                return pool.acquire().await;
            };
            if since.elapsed() < self.check_after || conn.ping().await.is_ok() {
                return Ok(conn);
            }
            conn.close_on_drop();
        }
    }

    /// Keeps `conn`, and hands back to the pool those unused for [`KEPT_AT_MOST`] (the
    /// oldest come first), which closes them once idle for its own time: an idle worker
    /// keeps the one connection its polls use, not one per slot.
    fn keep(&self, conn: PoolConnection<Postgres>) {
        let mut kept = lock(&self.kept);
        let stale = kept.iter().take_while(|(_, since)| since.elapsed() >= KEPT_AT_MOST).count();
        let handed_back: Vec<_> = kept.drain(..stale).collect();
        kept.push((conn, Instant::now()));
        drop(kept);
        drop(handed_back);
    }
}

/// The paused queues as this worker last read them, so a claim is one statement: re-read
/// when a pause or resume is announced, when LISTEN reconnects, and at the latest every
/// [`queue::PAUSES_MAX_AGE`].
#[derive(Default)]
pub(super) struct Pauses {
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
    /// The next claim re-reads the paused queues.
    pub(super) fn invalidate(&self) {
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

/// The slots of the ring that held rows when this worker last claimed (all of them before
/// its first claim): its next claim reads those and `jobs_long`, not the slots truncated and
/// empty since. A slot fills only once it is made current; the claim that first finds it
/// holding rows passes it over and says so, and the worker claims again at once, with it.
pub(super) struct RingSeen(Mutex<Arc<[i16]>>);

impl Default for RingSeen {
    fn default() -> Self {
        Self(Mutex::new(Arc::new(queue::RING_SLOTS)))
    }
}

impl RingSeen {
    fn get(&self) -> Arc<[i16]> {
        lock(&self.0).clone()
    }

    fn set(&self, ring: &[i16]) {
        let mut seen = lock(&self.0);
        if **seen != *ring {
            *seen = ring.into();
        }
    }
}

/// Where this worker's claims start. Normally every claim walks the claim index from
/// its front, which is cheap. When that becomes slow (the front is full of entries of
/// jobs already claimed, see [`ClaimFrom`]), claims start at the last job claimed instead
/// (or a second before now, if that is earlier), and an unbounded claim still runs
/// at least every [`UNBOUNDED_EVERY`] (less often when it is slower, so it never takes
/// more than about 1/[`UNBOUNDED_SHARE`] of the time) to find what sorts earlier: a job
/// of a more urgent priority, released or rescued, or of a resumed queue. Such a job waits
/// at most that long; no job is skipped for good.
#[derive(Default)]
pub(super) struct ClaimCursor {
    state: Mutex<CursorState>,
}

#[derive(Default)]
struct CursorState {
    /// Where the last job claimed stands in claim order.
    last: Option<ClaimFrom>,
    /// When the latest unbounded claim started, and how long it took.
    unbounded_at: Option<Instant>,
    unbounded_took: Duration,
}

/// An unbounded claim slower than this means that claims should start from the cursor.
const CURSOR_ENGAGE: Duration = Duration::from_millis(2);
/// The longest wait for an unbounded claim while claims start from the cursor.
const UNBOUNDED_EVERY: Duration = Duration::from_secs(1);
/// Unbounded claims are spaced at least this many times their own duration.
const UNBOUNDED_SHARE: u32 = 50;

impl ClaimCursor {
    /// Where the next claim starts; `None`: from the front.
    fn from(&self, now: Instant) -> Option<ClaimFrom> {
        let st = lock(&self.state);
        let last = st.last?;
        let at = st.unbounded_at?;
        if st.unbounded_took < CURSOR_ENGAGE
            || now.saturating_duration_since(at) >= UNBOUNDED_EVERY.max(st.unbounded_took * UNBOUNDED_SHARE)
        {
            return None;
        }
        Some(last)
    }

    /// Takes in what a claim that started at `started` brought back (in claim order).
    fn record(&self, from: Option<ClaimFrom>, started: Instant, took: Duration, jobs: &[Job]) {
        let mut st = lock(&self.state);
        let last = jobs.last().map(ClaimFrom::at);
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
    pub(super) fn rewind(&self) {
        lock(&self.state).unbounded_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, Utc};

    /// The claims started when `want` jobs per claim meet `concurrency` slots, with
    /// `(running, waiting, reserved, claims in flight)`.
    fn policy(
        want: usize,
        concurrency: usize,
        (running, waiting, reserved, in_flight): (usize, usize, usize, usize),
    ) -> (usize, usize) {
        let Claims { count, size } = claims_to_start(want, concurrency, running, waiting, reserved, in_flight);
        (count, size)
    }

    #[test]
    fn below_the_slots_each_free_slot_gets_its_claim_once() {
        assert_eq!(policy(1, 4, (0, 0, 0, 0)), (4, 1), "a claim per free slot");
        assert_eq!(policy(1, 4, (2, 0, 1, 1)), (1, 1), "a slot reserved by a claim in flight gets no other");
        assert_eq!(policy(1, 4, (3, 0, 1, 1)), (0, 1), "every slot taken or reserved");
        assert_eq!(policy(2, 5, (0, 0, 0, 0)), (2, 2), "claims of two for five slots: two claims, one slot left over");
        assert_eq!(policy(2, 4, (3, 0, 0, 0)), (0, 2), "one free slot is less than a claim");
    }

    #[test]
    fn above_the_slots_claims_prefetch_two_batches_ahead() {
        assert_eq!(policy(10, 1, (0, 0, 0, 0)), (2, 10), "an empty buffer: two batches");
        assert_eq!(policy(10, 1, (1, 0, 0, 1)), (1, 10), "one claim in flight: the second");
        assert_eq!(policy(10, 1, (1, 0, 0, 2)), (0, 10), "never more than two in flight");
        assert_eq!(policy(10, 1, (1, 10, 0, 0)), (1, 10), "a full batch waiting: one more");
        assert_eq!(policy(10, 1, (1, 6, 0, 1)), (0, 10), "more than half of the last batch left");
        assert_eq!(policy(10, 1, (1, 4, 0, 1)), (1, 10), "half a batch has left the last one");
        assert_eq!(policy(10, 1, (1, 15, 0, 0)), (0, 10), "a batch and a half waiting");
        assert_eq!(policy(10, 1, (1, 14, 0, 0)), (1, 10), "less than that");
    }

    #[test]
    fn at_the_slots_one_claim_takes_the_free_slots_and_no_more() {
        assert_eq!(policy(4, 4, (0, 0, 0, 0)), (1, 4));
        assert_eq!(policy(4, 4, (3, 0, 0, 0)), (1, 1), "one free slot: a claim of one");
        assert_eq!(policy(4, 4, (2, 1, 0, 0)), (1, 1), "a job waiting takes a slot");
        assert_eq!(policy(4, 4, (4, 0, 0, 0)).0, 0, "no free slot");
        assert_eq!(policy(4, 4, (0, 0, 0, 1)).0, 0, "one claim at a time");
    }

    fn job(priority: i16, run_at: DateTime<Utc>) -> Job {
        Job {
            id: airlock_core::ids::JobId::new(),
            kind: "t".into(),
            queue: queue::DEFAULT_QUEUE.into(),
            payload: serde_json::json!({}),
            state: queue::JobState::Running,
            priority,
            run_at,
            attempt: 1,
            max_attempts: 5,
            effect_class: queue::EffectClass::Pure,
            effect_started_at: None,
            lease_owner: Some("w".into()),
            lease_expires_at: None,
            heartbeat_at: None,
            attempted_at: None,
            last_error: None,
            unique_key: None,
            created_at: run_at,
            finished_at: None,
            slot: None,
        }
    }

    const FAST: Duration = Duration::from_micros(500);
    const SLOW: Duration = Duration::from_millis(10);

    #[test]
    fn claims_start_from_the_front_until_unbounded_claims_are_slow() {
        let cursor = ClaimCursor::default();
        let t0 = Instant::now();
        let at = Utc::now();
        assert_eq!(cursor.from(t0), None, "nothing claimed yet");
        cursor.record(None, t0, FAST, &[job(100, at)]);
        assert_eq!(cursor.from(t0 + FAST), None, "a fast claim from the front stays there");
        let last = job(100, at);
        cursor.record(None, t0 + FAST, SLOW, std::slice::from_ref(&last));
        let from = cursor.from(t0 + FAST + SLOW).map(|f| (f.priority, f.run_at, f.id));
        assert_eq!(from, Some((100, at, last.id)), "a slow one engages the cursor, at the last job claimed");
    }

    #[test]
    fn an_unbounded_claim_still_runs_every_so_often_and_after_a_rewind() {
        let cursor = ClaimCursor::default();
        let t0 = Instant::now();
        let at = Utc::now();
        cursor.record(None, t0, SLOW, &[job(100, at)]);
        assert!(cursor.from(t0 + UNBOUNDED_EVERY / 2).is_some());
        assert_eq!(cursor.from(t0 + UNBOUNDED_EVERY), None, "an unbounded claim is due");
        // A very slow unbounded claim is spaced by its own duration instead.
        let slower = Duration::from_millis(100);
        cursor.record(None, t0, slower, &[job(100, at)]);
        assert!(cursor.from(t0 + UNBOUNDED_EVERY).is_some());
        assert_eq!(cursor.from(t0 + slower * UNBOUNDED_SHARE), None);
        cursor.rewind();
        assert_eq!(cursor.from(t0 + SLOW), None, "rewound: the next claim is unbounded");
    }

    #[test]
    fn bounded_claims_only_move_the_cursor_forward_and_unbounded_ones_reset_it() {
        let cursor = ClaimCursor::default();
        let t0 = Instant::now();
        let at = Utc::now();
        let later = at + chrono::TimeDelta::seconds(10);
        let from_key = |c: &ClaimCursor| c.from(t0 + SLOW).map(|f| (f.priority, f.run_at));
        cursor.record(None, t0, SLOW, &[job(100, at)]);
        let bound = cursor.from(t0 + SLOW);
        cursor.record(bound, t0 + SLOW, FAST, &[job(100, later)]);
        assert_eq!(from_key(&cursor), Some((100, later)));
        cursor.record(bound, t0 + SLOW, FAST, &[job(100, at)]);
        assert_eq!(from_key(&cursor), Some((100, later)), "a bounded claim never moves it back");
        cursor.record(bound, t0 + SLOW, FAST, &[]);
        assert_eq!(from_key(&cursor), Some((100, later)), "nor does an empty one");
        cursor.record(None, t0 + SLOW, SLOW, &[job(0, at)]);
        assert_eq!(from_key(&cursor), Some((0, at)), "an unbounded claim found something more urgent");
    }

    #[test]
    fn an_unbounded_claim_that_started_earlier_does_not_replace_a_later_ones_timing() {
        let cursor = ClaimCursor::default();
        let t0 = Instant::now();
        let at = Utc::now();
        cursor.record(None, t0 + SLOW, SLOW, &[job(100, at)]);
        // Started before the one recorded, and fast: the slow timing of the later one stands.
        cursor.record(None, t0, FAST, &[job(100, at)]);
        assert!(cursor.from(t0 + SLOW * 2).is_some());
    }
}
