//! The benchmark's job: its kind, its payload and its handler.
//!
//! The payload carries the wall-clock time the producer handed the job to the queue, so
//! the handler can record pickup latency (enqueue → handler start) on any replica of the
//! same host; `created_at` (the database clock) is the fallback. It also carries the
//! producing process's run id and a sequence number that only advances when an insert
//! commits, so a run can be checked for lost jobs afterwards (see `docs/benchmark-adapter.md`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_queue::NewJob;
use airlock_worker::{JobContext, Outcome, Registry};
use chrono::Utc;
use serde_json::json;

use crate::latency::RollingLatency;

/// The job kind the adapter produces and handles.
pub const KIND: &str = "bench.job";
/// The queue it uses, so the worker claims nothing else.
pub const QUEUE: &str = "bench";

/// Wall-clock microseconds since the Unix epoch.
pub fn now_us() -> i64 {
    Utc::now().timestamp_micros()
}

/// Builds the payloads of one batch, padded to about `payload_bytes` each.
pub struct PayloadFactory {
    run: String,
    padding: String,
}

impl PayloadFactory {
    pub fn new(run: uuid::Uuid, payload_bytes: usize) -> Self {
        // `{"run":"<36>","seq":<n>,"enqueued_at_us":<16>,"pad":""}` is about 100 bytes.
        Self { run: run.to_string(), padding: "x".repeat(payload_bytes.saturating_sub(100)) }
    }

    /// Jobs `first_seq ..` stamped with the time of this call.
    pub fn batch(&self, first_seq: u64, n: usize) -> Vec<NewJob> {
        let at = now_us();
        (0..n as u64)
            .map(|i| {
                NewJob::new(
                    KIND,
                    json!({"run": self.run, "seq": first_seq + i, "enqueued_at_us": at, "pad": self.padding}),
                )
                .queue(QUEUE)
            })
            .collect()
    }
}

/// Registers the handler: record the pickup latency, sleep `work`, complete.
pub fn register(registry: &mut Registry, work: Duration, latency: Arc<Mutex<RollingLatency>>) {
    registry.register_fn(KIND, move |ctx: JobContext| {
        let latency = latency.clone();
        async move {
            let started = now_us();
            let enqueued = ctx
                .job
                .payload
                .get("enqueued_at_us")
                .and_then(|v| v.as_i64())
                .unwrap_or_else(|| ctx.job.created_at.timestamp_micros());
            let waited = Duration::from_micros(started.saturating_sub(enqueued).max(0) as u64);
            latency.lock().unwrap_or_else(|e| e.into_inner()).record(waited);
            if !work.is_zero() {
                tokio::select! {
                    _ = ctx.cancel.cancelled() => {}
                    _ = tokio::time::sleep(work) => {}
                }
            }
            Ok(Outcome::Completed)
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_about_the_asked_size_and_numbered() {
        let f = PayloadFactory::new(uuid::Uuid::nil(), 256);
        let jobs = f.batch(7, 3);
        assert_eq!(jobs.len(), 3);
        for (i, j) in jobs.iter().enumerate() {
            assert_eq!(j.kind, KIND);
            assert_eq!(j.queue, QUEUE);
            assert_eq!(j.payload["seq"], 7 + i as u64);
            let size = serde_json::to_vec(&j.payload).unwrap().len();
            assert!((200..=300).contains(&size), "payload of {size} bytes");
        }
        assert!(PayloadFactory::new(uuid::Uuid::nil(), 0).batch(0, 1)[0].payload["pad"] == "");
    }
}
