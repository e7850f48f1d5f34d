//! The telemetry tick: at every wall-clock multiple of `SAMPLE_EVERY_S`, one sample per
//! metric. It reads only in-memory figures (counters, the latency window, the latest depth
//! reading), so a slow or absent database never delays or skips a tick.
//!
//! Every tick: `claim_p50_ms`, `claim_p95_ms`, `claim_p99_ms` (window 30 s),
//! `enqueue_rate`, `completion_rate` (per second over the interval since the previous
//! tick, `window_s` = that interval). Replica 0 also reports `queue_depth`,
//! `running_depth` and `total_backlog` (`window_s` 0) from its latest depth reading;
//! `producer_target_rate` whenever the producer has a rate.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_worker::WorkerStats;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::depth::DepthGauge;
use crate::latency::RollingLatency;
use crate::producer::Counters;
use crate::protocol::{Emitter, Sample, next_tick, timestamp};

/// The rolling window of the pickup percentiles.
pub const LATENCY_WINDOW: Duration = Duration::from_secs(30);

/// Jobs completed by this process, across the worker runs it has had (a worker that
/// failed to start is started again, with fresh counters).
#[derive(Default)]
pub struct Completions {
    ended_runs: AtomicU64,
    current: Mutex<Option<Arc<WorkerStats>>>,
}

impl Completions {
    pub fn start(&self, stats: Arc<WorkerStats>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats);
    }

    pub fn end(&self) {
        if let Some(s) = self.current.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.ended_runs.fetch_add(WorkerStats::get(&s.completed), Ordering::Relaxed);
        }
    }

    pub fn total(&self) -> u64 {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        self.ended_runs.load(Ordering::Relaxed) + current.as_ref().map_or(0, |s| WorkerStats::get(&s.completed))
    }
}

/// What the sampler reads.
pub struct Sources {
    pub latency: Arc<Mutex<RollingLatency>>,
    pub counters: Arc<Counters>,
    pub completions: Arc<Completions>,
    pub depth: Arc<DepthGauge>,
    /// Whether this replica reports depths (replica 0).
    pub reports_depth: bool,
    pub instance_id: u32,
}

/// Emits samples at every tick until `shutdown`.
pub async fn run<W: Write + Send>(
    every: Duration,
    sources: Sources,
    emitter: Arc<Emitter<W>>,
    shutdown: CancellationToken,
) {
    let mut last_at = Instant::now();
    let mut last_enqueued = sources.counters.enqueued();
    let mut last_completed = sources.completions.total();
    let depth_max_age = every * 2 + Duration::from_secs(1);
    let mut last_tick = None;
    loop {
        // Never the same boundary twice, even if the timer woke a hair before it.
        let mut tick = next_tick(Utc::now(), every);
        if let Some(last) = last_tick
            && tick <= last
        {
            tick = next_tick(last, every);
        }
        last_tick = Some(tick);
        let wait = (tick - Utc::now()).to_std().unwrap_or_default();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let now = Instant::now();
        let interval_s = round3(now.duration_since(last_at).as_secs_f64());
        last_at = now;
        let enqueued = sources.counters.enqueued();
        let completed = sources.completions.total();
        let per_s = |n: u64| if interval_s > 0.0 { n as f64 / interval_s } else { 0.0 };
        let enqueue_rate = per_s(enqueued.saturating_sub(last_enqueued));
        let completion_rate = per_s(completed.saturating_sub(last_completed));
        (last_enqueued, last_completed) = (enqueued, completed);
        let p = sources.latency.lock().unwrap_or_else(|e| e.into_inner()).snapshot();

        let t = timestamp(tick);
        let id = sources.instance_id;
        let window = LATENCY_WINDOW.as_secs_f64();
        let mut samples = vec![
            Sample::new(&t, "claim_p50_ms", p.p50_ms, window, id),
            Sample::new(&t, "claim_p95_ms", p.p95_ms, window, id),
            Sample::new(&t, "claim_p99_ms", p.p99_ms, window, id),
            Sample::new(&t, "enqueue_rate", enqueue_rate, interval_s, id),
            Sample::new(&t, "completion_rate", completion_rate, interval_s, id),
        ];
        if sources.reports_depth {
            // `queue_depth` is required every tick: while the database is away the last
            // reading stands (0 before the first one), and the log says so.
            let (available, running) = match sources.depth.latest() {
                Some(d) => {
                    if d.at.elapsed() > depth_max_age {
                        tracing::warn!(age_s = d.at.elapsed().as_secs(), "queue depth reading is stale");
                    }
                    (d.available, d.running)
                }
                None => (0, 0),
            };
            samples.push(Sample::new(&t, "queue_depth", available as f64, 0.0, id));
            samples.push(Sample::new(&t, "running_depth", running as f64, 0.0, id));
            samples.push(Sample::new(&t, "total_backlog", (available + running) as f64, 0.0, id));
        }
        if let Some(rate) = sources.counters.target_rate() {
            samples.push(Sample::new(&t, "producer_target_rate", rate, 0.0, id));
        }
        emitter.emit_all(&samples);
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}
