//! The benchmark's adapter protocol: what goes to standard output, and when.
//!
//! Standard output carries telemetry only, one JSON object a line: first a descriptor,
//! then one sample per metric at every tick. Logs go to standard error. Ticks fall on
//! wall-clock multiples of the sample period, so samples of different systems line up.

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use serde::Serialize;

/// The system name the harness knows airlock by.
pub const SYSTEM: &str = "airlock";

/// The tables the queue churns (inserts, updates and deletes at the job rate), which the
/// harness watches for bloat: every partition that holds jobs (the ring's slots, the
/// long-lived live jobs, the finished ones; `jobs` itself is partitioned and holds no row),
/// the ring's state and the fleet. Kept equal to `adapter.json`, which a test checks.
pub const EVENT_TABLES: &[&str] = &[
    "public.jobs_ring_0",
    "public.jobs_ring_1",
    "public.jobs_ring_2",
    "public.jobs_ring_3",
    "public.jobs_long",
    "public.jobs_done",
    "public.job_ring",
    "public.workers",
];

/// Their indexes.
pub const EVENT_INDEXES: &[&str] = &[
    "public.jobs_ring_0_pkey",
    "public.jobs_ring_0_claim_idx",
    "public.jobs_ring_0_lease_idx",
    "public.jobs_ring_0_key_idx",
    "public.jobs_ring_1_pkey",
    "public.jobs_ring_1_claim_idx",
    "public.jobs_ring_1_lease_idx",
    "public.jobs_ring_1_key_idx",
    "public.jobs_ring_2_pkey",
    "public.jobs_ring_2_claim_idx",
    "public.jobs_ring_2_lease_idx",
    "public.jobs_ring_2_key_idx",
    "public.jobs_ring_3_pkey",
    "public.jobs_ring_3_claim_idx",
    "public.jobs_ring_3_lease_idx",
    "public.jobs_ring_3_key_idx",
    "public.jobs_long_pkey",
    "public.jobs_long_claim_idx",
    "public.jobs_long_lease_idx",
    "public.jobs_long_key_idx",
    "public.jobs_done_pkey",
    "public.jobs_done_finished_idx",
    "public.job_ring_pkey",
    "public.workers_pkey",
];

/// What this build is: the crate version, plus the commit when the build names one.
pub fn version() -> String {
    match option_env!("AIRLOCK_GIT_SHA") {
        Some(sha) if !sha.is_empty() => format!("{}+{sha}", env!("CARGO_PKG_VERSION")),
        _ => env!("CARGO_PKG_VERSION").to_string(),
    }
}

/// The latest embedded migration, e.g. `0005_sandbox`.
pub fn schema_version() -> String {
    airlock_core::db::MIGRATOR
        .iter()
        .max_by_key(|m| m.version)
        .map(|m| format!("{:04}_{}", m.version, m.description.replace(' ', "_")))
        .unwrap_or_else(|| "none".into())
}

/// RFC 3339 with milliseconds and `Z`, the protocol's one time format.
pub fn timestamp(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The first wall-clock multiple of `every` strictly after `now`.
pub fn next_tick(now: DateTime<Utc>, every: Duration) -> DateTime<Utc> {
    let every_ms = (every.as_millis() as i64).max(1);
    let now_ms = now.timestamp_millis();
    let next_ms = (now_ms.div_euclid(every_ms) + 1) * every_ms;
    DateTime::<Utc>::UNIX_EPOCH + TimeDelta::milliseconds(next_ms)
}

/// The startup record.
#[derive(Debug, Serialize)]
pub struct Descriptor<'a> {
    pub kind: &'static str,
    pub system: &'static str,
    pub event_tables: &'a [&'a str],
    pub event_indexes: &'a [&'a str],
    pub extensions: &'a [&'a str],
    pub version: String,
    pub schema_version: String,
    pub db_name: &'a str,
    pub started_at: String,
    pub instance_id: u32,
}

impl<'a> Descriptor<'a> {
    pub fn new(db_name: &'a str, instance_id: u32, started_at: DateTime<Utc>) -> Self {
        Self {
            kind: "descriptor",
            system: SYSTEM,
            event_tables: EVENT_TABLES,
            event_indexes: EVENT_INDEXES,
            extensions: &[],
            version: version(),
            schema_version: schema_version(),
            db_name,
            started_at: timestamp(started_at),
            instance_id,
        }
    }
}

/// One metric at one tick.
#[derive(Debug, Serialize)]
pub struct Sample<'a> {
    pub t: &'a str,
    pub system: &'static str,
    pub kind: &'static str,
    pub subject_kind: &'static str,
    pub subject: &'static str,
    pub metric: &'static str,
    pub value: f64,
    pub window_s: f64,
    pub instance_id: u32,
}

impl<'a> Sample<'a> {
    /// A sample; a value that is not finite is reported as 0 (JSON has no NaN).
    pub fn new(t: &'a str, metric: &'static str, value: f64, window_s: f64, instance_id: u32) -> Self {
        let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
        Self {
            t,
            system: SYSTEM,
            kind: "adapter",
            subject_kind: "adapter",
            subject: "",
            metric,
            value: finite(value),
            window_s: finite(window_s),
            instance_id,
        }
    }
}

/// Writes records as JSON lines, each flushed at once. A write error (the harness closed
/// the pipe) is logged once and never stops the adapter.
pub struct Emitter<W: Write + Send> {
    out: Mutex<(W, bool)>,
}

impl<W: Write + Send> Emitter<W> {
    pub fn new(out: W) -> Self {
        Self { out: Mutex::new((out, false)) }
    }

    /// Writes several records together, so one tick's lines are never interleaved.
    pub fn emit_all<T: Serialize>(&self, records: &[T]) {
        let mut buf = Vec::with_capacity(records.len() * 200);
        for r in records {
            if serde_json::to_writer(&mut buf, r).is_ok() {
                buf.push(b'\n');
            }
        }
        let mut guard = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let (out, failed) = &mut *guard;
        if let Err(e) = out.write_all(&buf).and_then(|()| out.flush())
            && !*failed
        {
            *failed = true;
            tracing::warn!(error = %e, "cannot write telemetry to stdout");
        }
    }

    pub fn emit<T: Serialize>(&self, record: &T) {
        self.emit_all(std::slice::from_ref(record));
    }

    pub fn into_inner(self) -> W {
        self.out.into_inner().unwrap_or_else(|e| e.into_inner()).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn ticks_fall_on_wall_clock_multiples() {
        let five = Duration::from_secs(5);
        assert_eq!(next_tick(at("2026-01-01T00:00:03.250Z"), five), at("2026-01-01T00:00:05Z"));
        assert_eq!(next_tick(at("2026-01-01T00:00:05Z"), five), at("2026-01-01T00:00:10Z"));
        assert_eq!(next_tick(at("2026-01-01T00:00:59.999Z"), five), at("2026-01-01T00:01:00Z"));
        let half = Duration::from_millis(500);
        assert_eq!(next_tick(at("2026-01-01T00:00:00.100Z"), half), at("2026-01-01T00:00:00.500Z"));
        assert_eq!(timestamp(at("2026-01-01T00:00:05Z")), "2026-01-01T00:00:05.000Z");
    }

    #[test]
    fn records_have_the_protocol_shape() {
        let e = Emitter::new(Vec::new());
        let d = Descriptor::new("airlock_bench", 3, at("2026-01-01T00:00:00.123Z"));
        e.emit(&d);
        e.emit_all(&[Sample::new("2026-01-01T00:00:05.000Z", "claim_p99_ms", f64::NAN, 30.0, 3)]);
        let text = String::from_utf8(e.into_inner()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["kind"], "descriptor");
        assert_eq!(lines[0]["system"], "airlock");
        assert_eq!(lines[0]["started_at"], "2026-01-01T00:00:00.123Z");
        assert_eq!(lines[0]["instance_id"], 3);
        assert_eq!(lines[0]["extensions"], serde_json::json!([]));
        let schema = lines[0]["schema_version"].as_str().unwrap();
        assert!(
            schema.len() > 5 && schema[..4].bytes().all(|b| b.is_ascii_digit()) && &schema[4..5] == "_",
            "{schema}"
        );
        assert_eq!(lines[1]["value"], 0.0, "NaN becomes 0, never null");
        assert_eq!(lines[1]["subject"], "");
        assert_eq!(lines[1]["window_s"], 30.0);
    }

    #[test]
    fn manifest_matches_descriptor() {
        let manifest: serde_json::Value = serde_json::from_str(include_str!("../adapter.json")).unwrap();
        assert_eq!(manifest["system"], SYSTEM);
        let list = |k: &str| -> Vec<String> {
            manifest[k].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
        };
        assert_eq!(list("event_tables"), EVENT_TABLES);
        assert_eq!(list("event_indexes"), EVENT_INDEXES);
        assert!(list("extensions").is_empty());
    }
}
