//! Pickup latency (enqueue → handler start) over a rolling window, in bounded memory.
//!
//! The window is a ring of one-second HDR histograms (microseconds, 3 significant figures,
//! up to one hour; longer waits are clamped to one hour). Recording touches one slice; a
//! snapshot merges the slices of the last `window` seconds. Memory is fixed when the window
//! is built, whatever the job rate or the length of the run.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

const SIGNIFICANT_FIGURES: u8 = 3;
const HIGHEST_US: u64 = 3_600_000_000;

/// Percentiles of one window, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    /// How many pickups the window holds; 0 means the percentiles are zeros, not data.
    pub count: u64,
}

struct Slice {
    /// The second (since `origin`) this slice holds; `None` until first used.
    second: Option<u64>,
    histogram: Histogram<u32>,
}

/// A rolling latency window. Not synchronised: share it behind a mutex.
pub struct RollingLatency {
    origin: Instant,
    slices: Vec<Slice>,
    /// Reused for every snapshot, so a snapshot allocates nothing.
    merged: Histogram<u32>,
}

fn histogram() -> Histogram<u32> {
    Histogram::new_with_bounds(1, HIGHEST_US, SIGNIFICANT_FIGURES).expect("static histogram bounds are valid")
}

impl RollingLatency {
    /// A window of `window` (whole seconds, at least one).
    pub fn new(window: Duration) -> Self {
        let seconds = window.as_secs().max(1) as usize;
        Self {
            origin: Instant::now(),
            slices: (0..seconds).map(|_| Slice { second: None, histogram: histogram() }).collect(),
            merged: histogram(),
        }
    }

    /// Records one pickup that happened now.
    pub fn record(&mut self, latency: Duration) {
        let second = self.origin.elapsed().as_secs();
        self.record_at(second, latency);
    }

    /// Percentiles over the window that ends now.
    pub fn snapshot(&mut self) -> Percentiles {
        let second = self.origin.elapsed().as_secs();
        self.snapshot_at(second)
    }

    fn record_at(&mut self, second: u64, latency: Duration) {
        let n = self.slices.len() as u64;
        let slice = &mut self.slices[(second % n) as usize];
        if slice.second != Some(second) {
            slice.histogram.reset();
            slice.second = Some(second);
        }
        slice.histogram.saturating_record((latency.as_micros() as u64).clamp(1, HIGHEST_US));
    }

    fn snapshot_at(&mut self, second: u64) -> Percentiles {
        let n = self.slices.len() as u64;
        self.merged.reset();
        for slice in &self.slices {
            if slice.second.is_some_and(|s| s <= second && s + n > second) {
                // Same bounds on both sides, so adding cannot fail.
                let _ = self.merged.add(&slice.histogram);
            }
        }
        let count = self.merged.len();
        let ms = |q: f64| if count == 0 { 0.0 } else { self.merged.value_at_quantile(q) as f64 / 1000.0 };
        Percentiles { p50_ms: ms(0.50), p95_ms: ms(0.95), p99_ms: ms(0.99), count }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_within_three_significant_figures() {
        let mut w = RollingLatency::new(Duration::from_secs(30));
        for i in 1..=1000u64 {
            w.record_at(5, Duration::from_micros(i * 100)); // 0.1 ms .. 100 ms
        }
        let p = w.snapshot_at(5);
        assert_eq!(p.count, 1000);
        assert!((p.p50_ms - 50.0).abs() < 0.1, "{p:?}");
        assert!((p.p95_ms - 95.0).abs() < 0.1, "{p:?}");
        assert!((p.p99_ms - 99.0).abs() < 0.1, "{p:?}");
    }

    #[test]
    fn old_seconds_leave_the_window() {
        let mut w = RollingLatency::new(Duration::from_secs(30));
        w.record_at(0, Duration::from_secs(10));
        w.record_at(29, Duration::from_millis(2));
        assert_eq!(w.snapshot_at(29).count, 2);
        let p = w.snapshot_at(30);
        assert_eq!(p.count, 1, "second 0 is out of a 30 s window at second 30");
        assert!(p.p99_ms < 3.0, "{p:?}");
        // The slice of second 0 is reused by second 30, not added to.
        w.record_at(30, Duration::from_millis(1));
        assert_eq!(w.snapshot_at(30).count, 2);
        assert_eq!(w.snapshot_at(100).count, 0);
        assert_eq!(w.snapshot_at(100).p99_ms, 0.0);
    }

    #[test]
    fn extreme_values_are_clamped_not_lost() {
        let mut w = RollingLatency::new(Duration::from_secs(30));
        w.record_at(1, Duration::ZERO);
        w.record_at(1, Duration::from_secs(10 * 3600));
        let p = w.snapshot_at(1);
        assert_eq!(p.count, 2);
        assert!(p.p99_ms >= 3_599_000.0, "{p:?}");
    }
}
