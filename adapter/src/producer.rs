//! The producer: inserts benchmark jobs through `queue::enqueue_many`, one transaction per
//! batch, at the rate the harness asks for.
//!
//! - Fixed rate, adapter pacing: every `PRODUCER_BATCH_MS` the producer earns
//!   `rate × elapsed` jobs of credit (elapsed wall time, not the nominal tick, so slow
//!   inserts do not lower the offered rate) and inserts it in batches of at most
//!   `PRODUCER_BATCH_MAX`. Credit never exceeds about one second of jobs, so an outage
//!   is not followed by an unbounded burst. The rate is re-read from the control file on
//!   every tick.
//! - Fixed rate, harness pacing: each `ENQUEUE <n>` line on stdin asks for n jobs; what is
//!   asked for while the database is away is inserted when it is back.
//! - Depth target: keeps the available jobs near `TARGET_DEPTH`.
//!
//! Standard input is always read to its end (by a thread), whatever the pacing, because
//! the harness writes to it and a full pipe would block the harness.
//!
//! Invariant: the enqueue count and the sequence number advance only after a commit, so
//! what the telemetry reports as enqueued is in the table. A database error is logged and
//! retried after a back-off; it never stops the producer.

use std::io::BufRead;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use airlock_queue::{self as queue, QueueError};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::depth::DepthGauge;
use crate::job::PayloadFactory;
use crate::retry::Backoff;
use crate::settings::{Pacing, ProducerMode, Settings};

/// Producer figures the sampler reports.
#[derive(Debug)]
pub struct Counters {
    /// Jobs committed by this process.
    pub enqueued: Arc<AtomicU64>,
    /// The current offered rate as f64 bits; `NO_RATE` when the mode has none.
    target_rate_bits: AtomicU64,
}

const NO_RATE: u64 = u64::MAX;

impl Default for Counters {
    fn default() -> Self {
        Self { enqueued: Arc::new(AtomicU64::new(0)), target_rate_bits: AtomicU64::new(NO_RATE) }
    }
}

impl Counters {
    pub fn enqueued(&self) -> u64 {
        self.enqueued.load(Ordering::Relaxed)
    }

    pub fn target_rate(&self) -> Option<f64> {
        match self.target_rate_bits.load(Ordering::Relaxed) {
            NO_RATE => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    fn set_target_rate(&self, rate: f64) {
        self.target_rate_bits.store(rate.to_bits(), Ordering::Relaxed);
    }
}

/// Jobs the harness asked for on stdin and the producer has not inserted yet.
#[derive(Debug, Default)]
pub struct Tokens {
    owed: AtomicU64,
    /// Stdin reached its end.
    closed: AtomicBool,
    wake: Notify,
}

impl Tokens {
    /// Takes one stdin line into account; anything but `ENQUEUE <n>` is ignored.
    pub fn take_line(&self, line: &str) {
        if let Some(n) = line.trim().strip_prefix("ENQUEUE ").and_then(|n| n.trim().parse::<u64>().ok())
            && n > 0
        {
            self.owed.fetch_add(n, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    pub fn owed(&self) -> u64 {
        self.owed.load(Ordering::Relaxed)
    }
}

/// Reads stdin to its end on a thread of its own. With harness pacing each `ENQUEUE <n>`
/// line becomes owed jobs; otherwise lines are read and dropped.
pub fn spawn_stdin_reader(pacing: Pacing, tokens: Arc<Tokens>) {
    let spawned = std::thread::Builder::new().name("stdin".into()).spawn(move || {
        let stdin = std::io::stdin();
        let mut lines = stdin.lock().lines();
        while let Some(Ok(line)) = lines.next() {
            if pacing == Pacing::Harness {
                tokens.take_line(&line);
            }
        }
        tokens.close();
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the stdin reader");
    }
}

/// The current target rate: the control file when it holds a number, else the last
/// rate read, else `PRODUCER_RATE`.
struct RateControl {
    file: Option<PathBuf>,
    rate: f64,
    warned: bool,
}

impl RateControl {
    fn current(&mut self) -> f64 {
        if let Some(path) = &self.file {
            match std::fs::read_to_string(path).map(|s| s.trim().parse::<f64>()) {
                Ok(Ok(r)) if r.is_finite() && r >= 0.0 => {
                    self.rate = r;
                    self.warned = false;
                }
                other => {
                    if !self.warned {
                        self.warned = true;
                        tracing::warn!(file = %path.display(), read = ?other.map(|r| r.ok()).ok(),
                            rate = self.rate, "rate control file unreadable; keeping the last rate");
                    }
                }
            }
        }
        self.rate
    }
}

/// Everything the producer needs.
pub struct Producer {
    pub pool: PgPool,
    pub settings: Arc<Settings>,
    pub counters: Arc<Counters>,
    pub tokens: Arc<Tokens>,
    pub depth: Arc<DepthGauge>,
    pub payloads: PayloadFactory,
    /// The next sequence number; advances only on commit.
    pub next_seq: u64,
}

/// How long a depth reading may be used by the depth-target producer.
const DEPTH_MAX_AGE: Duration = Duration::from_secs(5);

impl Producer {
    /// Produces until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let s = self.settings.clone();
        match (s.producer_mode, s.pacing) {
            (ProducerMode::DepthTarget, _) => self.depth_target(&shutdown).await,
            (ProducerMode::Fixed, Pacing::Harness) => {
                self.harness_paced(&shutdown).await;
                if !shutdown.is_cancelled() {
                    tracing::warn!("stdin closed: pacing the producer here from now on");
                    self.adapter_paced(&shutdown).await;
                }
            }
            (ProducerMode::Fixed, Pacing::Adapter) => self.adapter_paced(&shutdown).await,
        }
    }

    /// Inserts and commits `n` jobs in one transaction; after a failure, waits out the
    /// back-off before returning.
    async fn insert(&mut self, n: usize, backoff: &mut Backoff, shutdown: &CancellationToken) -> Insert {
        let jobs = self.payloads.batch(self.next_seq, n);
        let pool = &self.pool;
        let attempt = async {
            let mut tx = pool.begin().await?;
            queue::enqueue_many(&mut tx, &jobs).await?;
            tx.commit().await?;
            Ok::<_, QueueError>(())
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return Insert::Stopped,
            r = attempt => r,
        };
        match result {
            Ok(()) => {
                self.next_seq += n as u64;
                self.counters.enqueued.fetch_add(n as u64, Ordering::Relaxed);
                backoff.reset();
                Insert::Committed
            }
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "enqueue failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Insert::Stopped,
                    _ = tokio::time::sleep(delay) => {}
                }
                Insert::Failed
            }
        }
    }

    async fn adapter_paced(&mut self, shutdown: &CancellationToken) {
        let s = self.settings.clone();
        let mut control = RateControl { file: s.rate_control_file.clone(), rate: s.producer_rate_per_s, warned: false };
        let mut backoff = backoff();
        let mut next = Instant::now();
        let mut last = Instant::now();
        let mut credit = 0.0_f64;
        loop {
            next = (next + s.producer_batch).max(Instant::now());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let rate = control.current();
            self.counters.set_target_rate(rate);
            let now = Instant::now();
            credit += rate * now.saturating_duration_since(last).as_secs_f64();
            last = now;
            credit = if rate > 0.0 { credit.min(rate + s.producer_batch_max as f64) } else { 0.0 };
            while credit >= 1.0 {
                let n = (credit.floor() as usize).min(s.producer_batch_max);
                match self.insert(n, &mut backoff, shutdown).await {
                    Insert::Stopped => return,
                    Insert::Committed => credit -= n as f64,
                    Insert::Failed => break,
                }
            }
        }
    }

    async fn harness_paced(&mut self, shutdown: &CancellationToken) {
        let s = self.settings.clone();
        let mut control = RateControl { file: s.rate_control_file.clone(), rate: s.producer_rate_per_s, warned: false };
        let mut backoff = backoff();
        loop {
            self.counters.set_target_rate(control.current());
            let owed = self.tokens.owed();
            if owed == 0 {
                if self.tokens.closed.load(Ordering::Relaxed) {
                    return;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.tokens.wake.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                continue;
            }
            let n = (owed as usize).min(s.producer_batch_max);
            match self.insert(n, &mut backoff, shutdown).await {
                Insert::Stopped => return,
                Insert::Committed => {
                    self.tokens.owed.fetch_sub(n as u64, Ordering::Relaxed);
                }
                Insert::Failed => {}
            }
        }
    }

    async fn depth_target(&mut self, shutdown: &CancellationToken) {
        let s = self.settings.clone();
        let mut backoff = backoff();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(s.producer_batch) => {}
            }
            let Some(d) = self.depth.fresh(DEPTH_MAX_AGE) else { continue };
            // What was enqueued since the reading is not in it yet.
            let estimate = d.available + self.counters.enqueued().saturating_sub(d.enqueued_before);
            if estimate >= s.target_depth {
                continue;
            }
            let n = ((s.target_depth - estimate) as usize).min(s.producer_batch_max);
            if self.insert(n, &mut backoff, shutdown).await == Insert::Stopped {
                return;
            }
        }
    }
}

/// How one insert ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Insert {
    Committed,
    /// Not committed (or not known to be); the back-off has been waited out.
    Failed,
    /// Shutdown came first; an insert in flight was abandoned (rolled back, or committed
    /// and not counted, never lost).
    Stopped,
}

fn backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enqueue_lines_add_up_and_others_are_ignored() {
        let t = Tokens::default();
        for line in ["ENQUEUE 5", "ENQUEUE 0", "enqueue 3", "ENQUEUE x", "", "PING", "ENQUEUE 7\r"] {
            t.take_line(line);
        }
        assert_eq!(t.owed(), 12);
    }

    #[test]
    fn rate_control_file_is_reread_and_bad_contents_keep_the_last_rate() {
        let dir = std::env::temp_dir().join(format!("airlock-rate-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rate");
        let mut c = RateControl { file: Some(path.clone()), rate: 200.0, warned: false };
        assert_eq!(c.current(), 200.0, "missing file: the configured rate");
        std::fs::write(&path, "300\n").unwrap();
        assert_eq!(c.current(), 300.0);
        std::fs::write(&path, "garbage").unwrap();
        assert_eq!(c.current(), 300.0);
        std::fs::write(&path, "0").unwrap();
        assert_eq!(c.current(), 0.0);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
