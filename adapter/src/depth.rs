//! How deep the benchmark queue is: available and running jobs of the bench kind, polled
//! through the queue's public counts and kept for the sampler and the depth-target producer.
//!
//! The poller runs on its own, so a slow or failing count never delays a telemetry tick;
//! a reading older than the reader's limit is treated as missing rather than reported.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use airlock_queue::{self as queue, JobState};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::job;
use crate::retry::Backoff;

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depth {
    /// Jobs waiting to be claimed (including retries whose time has not come).
    pub available: u64,
    /// Jobs held by a worker.
    pub running: u64,
    /// The producer's enqueue count just before the reading, so a reader can add what was
    /// enqueued since.
    pub enqueued_before: u64,
    pub at: Instant,
}

/// The latest reading.
#[derive(Debug, Default)]
pub struct DepthGauge(Mutex<Option<Depth>>);

impl DepthGauge {
    pub fn set(&self, d: Depth) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(d);
    }

    /// The latest reading, however old.
    pub fn latest(&self) -> Option<Depth> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latest reading if it is younger than `max_age`.
    pub fn fresh(&self, max_age: Duration) -> Option<Depth> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).filter(|d| d.at.elapsed() <= max_age)
    }
}

/// Reads the depth once.
pub async fn read(pool: &PgPool, enqueued: &AtomicU64) -> Result<Depth, queue::QueueError> {
    let enqueued_before = enqueued.load(Ordering::Relaxed);
    let counts = queue::count_by_kind_state(pool).await?;
    let count = |state: JobState| {
        counts.iter().filter(|c| c.kind == job::KIND && c.state == state).map(|c| c.count.max(0) as u64).sum()
    };
    Ok(Depth {
        available: count(JobState::Available),
        running: count(JobState::Running),
        enqueued_before,
        at: Instant::now(),
    })
}

/// Polls every `every` until `shutdown`, surviving any database error.
pub async fn poll(
    pool: PgPool,
    every: Duration,
    enqueued: std::sync::Arc<AtomicU64>,
    gauge: std::sync::Arc<DepthGauge>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(every, Duration::from_secs(5).max(every));
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = read(&pool, &enqueued) => r,
        };
        wait = match result {
            Ok(d) => {
                gauge.set(d);
                backoff.reset();
                every
            }
            Err(e) => {
                tracing::warn!(error = %e, "queue depth poll failed; retrying");
                backoff.next_delay()
            }
        };
    }
}
