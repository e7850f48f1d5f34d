//! The benchmark adapter as the harness sees it: a real `airlock-bench-adapter` process
//! against a real Postgres, every line of its stdout checked against the adapter protocol
//! (descriptor first, every required metric at every wall-clock-aligned tick, numbers
//! where numbers belong), surviving the loss of all its connections, honouring the
//! rate-control file and `ENQUEUE <n>` pacing, and exiting 0 within 5 s of SIGTERM with
//! no job lost.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_tests::harness::{self, KillOnDrop};
use chrono::{DateTime, Utc};
use nix::sys::signal::Signal;
use serde_json::Value;
use sqlx::PgPool;

const BIN: &str = "airlock-bench-adapter";
const SAMPLE_EVERY_MS: i64 = 2000;
const REQUIRED: &[&str] =
    &["claim_p50_ms", "claim_p95_ms", "claim_p99_ms", "enqueue_rate", "completion_rate", "queue_depth"];
const SAMPLE_KEYS: &[&str] =
    &["t", "system", "kind", "subject_kind", "subject", "metric", "value", "window_s", "instance_id"];

/// Lines of a child's stdout as they arrive, collected by a thread.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl Lines {
    fn collect(stdout: ChildStdout) -> Self {
        let lines = Lines::default();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                sink.0.lock().unwrap().push(line);
            }
        });
        lines
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Samples (not the descriptor) as (tick time, metric, value).
    fn samples(&self) -> Vec<(String, String, f64)> {
        self.all()
            .iter()
            .skip(1)
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| {
                (
                    v["t"].as_str().unwrap_or("").to_string(),
                    v["metric"].as_str().unwrap_or("").to_string(),
                    v["value"].as_f64().unwrap_or(f64::NAN),
                )
            })
            .collect()
    }

    async fn wait_for_sample(&self, what: &str, timeout: Duration, check: impl Fn(&str, f64) -> bool) {
        harness::wait_for(what, timeout, || {
            let found = self.samples().iter().any(|(_, m, v)| check(m, *v));
            async move { found.then_some(()) }
        })
        .await
    }
}

fn spawn(url: &str, env: &[(&str, &str)], stdin: Stdio) -> Child {
    let mut cmd = Command::new(harness::bin_path(BIN));
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", url)
        .env("RUST_LOG", std::env::var("TEST_LOG").unwrap_or_else(|_| "warn".into()))
        .env("SCENARIO", "long_horizon")
        .env("SAMPLE_EVERY_S", (SAMPLE_EVERY_MS / 1000).to_string())
        .env("BENCH_INSTANCE_ID", "0")
        // Keep completed rows, so the loss check can see every job.
        .env("AIRLOCK_BENCH_RETENTION_SECONDS", "0")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("TEST_LOG").is_some() { Stdio::inherit() } else { Stdio::null() });
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap_or_else(|e| panic!("spawning {BIN}: {e}"))
}

fn parse_time(s: &str) -> DateTime<Utc> {
    assert!(s.len() == 24 && s.ends_with('Z') && s.as_bytes()[19] == b'.', "not RFC 3339 with ms and Z: {s}");
    DateTime::parse_from_rfc3339(s).unwrap_or_else(|e| panic!("{s}: {e}")).with_timezone(&Utc)
}

/// Checks every line against the protocol; returns the samples grouped by tick.
async fn check_protocol(lines: &[String], pool: &PgPool, db_name: &str) -> BTreeMap<String, BTreeMap<String, f64>> {
    assert!(!lines.is_empty(), "no output at all");
    let d: Value =
        serde_json::from_str(&lines[0]).unwrap_or_else(|e| panic!("first line is not JSON ({e}): {}", lines[0]));
    assert_eq!(d["kind"], "descriptor", "the descriptor comes first: {d}");
    assert_eq!(d["system"], "airlock");
    assert_eq!(d["db_name"], db_name);
    assert_eq!(d["instance_id"], 0);
    assert_eq!(d["extensions"], serde_json::json!([]));
    assert!(d["version"].as_str().is_some_and(|v| !v.is_empty()), "{d}");
    let latest = airlock_core::db::MIGRATOR.iter().map(|m| m.version).max().unwrap();
    assert!(d["schema_version"].as_str().unwrap().starts_with(&format!("{latest:04}_")), "{d}");
    parse_time(d["started_at"].as_str().unwrap());
    // Every declared table and index exists, and the static manifest is a subset.
    let tables: Vec<&str> = d["event_tables"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let indexes: Vec<&str> = d["event_indexes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(tables.contains(&"public.jobs_ring_0") && tables.contains(&"public.jobs_done"), "{tables:?}");
    for name in tables.iter().chain(&indexes) {
        let found: Option<String> =
            sqlx::query_scalar("SELECT to_regclass($1)::text").bind(name).fetch_one(pool).await.unwrap();
        assert!(found.is_some(), "declared relation {name} does not exist");
    }
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../adapter/adapter.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["system"], "airlock");
    for (key, declared) in [("event_tables", &tables), ("event_indexes", &indexes)] {
        for m in manifest[key].as_array().unwrap() {
            assert!(declared.contains(&m.as_str().unwrap()), "adapter.json {key} lists {m}, the descriptor does not");
        }
    }

    let mut ticks: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for line in &lines[1..] {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let keys: HashSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, SAMPLE_KEYS.iter().copied().collect(), "sample keys: {line}");
        assert_eq!(v["system"], "airlock", "{line}");
        assert_eq!(v["kind"], "adapter", "{line}");
        assert_eq!(v["subject_kind"], "adapter", "{line}");
        assert_eq!(v["subject"], "", "{line}");
        assert_eq!(v["instance_id"], 0, "{line}");
        let value = v["value"].as_f64().unwrap_or_else(|| panic!("value is not a number: {line}"));
        let window = v["window_s"].as_f64().unwrap_or_else(|| panic!("window_s is not a number: {line}"));
        assert!(value.is_finite() && value >= 0.0 && window >= 0.0, "{line}");
        let t = v["t"].as_str().unwrap();
        assert_eq!(parse_time(t).timestamp_millis() % SAMPLE_EVERY_MS, 0, "tick not on a wall-clock multiple: {line}");
        let metric = v["metric"].as_str().unwrap().to_string();
        match metric.as_str() {
            m if m.starts_with("claim_p") => assert_eq!(window, 30.0, "{line}"),
            // The interval since the previous tick (more than one period only if a
            // stalled machine made the adapter miss a boundary).
            "enqueue_rate" | "completion_rate" => {
                assert!(window > 0.0 && window <= 3.0 * SAMPLE_EVERY_MS as f64 / 1000.0 + 0.5, "{line}")
            }
            "queue_depth" | "running_depth" | "total_backlog" => {
                assert_eq!(window, 0.0, "{line}");
                assert_eq!(value.fract(), 0.0, "a depth is a count: {line}");
            }
            _ => {}
        }
        let tick = ticks.entry(t.to_string()).or_default();
        assert!(tick.insert(metric, value).is_none(), "a metric twice in one tick: {line}");
    }
    let times: Vec<i64> = ticks.keys().map(|t| parse_time(t).timestamp_millis()).collect();
    assert!(
        times.windows(2).all(|w| w[1] > w[0] && w[1] - w[0] <= 3 * SAMPLE_EVERY_MS),
        "ticks increase, one period apart (a stalled machine may skip one): {times:?}"
    );
    for (t, metrics) in &ticks {
        for m in REQUIRED {
            assert!(metrics.contains_key(*m), "tick {t} lacks {m}: {metrics:?}");
        }
        let (p50, p95, p99) = (metrics["claim_p50_ms"], metrics["claim_p95_ms"], metrics["claim_p99_ms"]);
        assert!(p50 <= p95 && p95 <= p99, "tick {t}: percentiles out of order {metrics:?}");
    }
    ticks
}

/// Nothing lost: every sequence number each producing process committed is in the table
/// (gaps would be lost jobs; repeats are an ambiguous commit retried), and every job is
/// completed or still waiting, none failed or left running.
async fn check_nothing_lost(pool: &PgPool) -> i64 {
    let runs: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT payload->>'run', count(*), count(DISTINCT (payload->>'seq')::bigint), max((payload->>'seq')::bigint)
         FROM jobs WHERE kind = 'bench.job' GROUP BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(!runs.is_empty(), "no job was produced");
    for (run, _, distinct, max) in &runs {
        assert_eq!(*distinct, max + 1, "producer run {run}: sequence numbers have gaps");
    }
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT state::text, count(*) FROM jobs WHERE kind = 'bench.job' GROUP BY 1")
            .fetch_all(pool)
            .await
            .unwrap();
    for (state, n) in &states {
        assert!(state == "completed" || state == "available", "{n} jobs {state}: {states:?}");
    }
    runs.iter().map(|r| r.1).sum()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn speaks_the_protocol_survives_lost_connections_and_stops_on_sigterm(pool: PgPool) {
    let url = harness::database_url(&pool);
    let db_name = pool.connect_options().get_database().unwrap().to_string();
    let dir = std::env::temp_dir().join(format!("airlock-bench-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let rate_file = dir.join("rate");
    std::fs::write(&rate_file, "100\n").unwrap();

    let started = Instant::now();
    let mut child = KillOnDrop(spawn(
        &url,
        &[
            ("PRODUCER_MODE", "fixed"),
            ("PRODUCER_RATE", "100"),
            ("PRODUCER_RATE_CONTROL_FILE", rate_file.to_str().unwrap()),
            ("WORKER_COUNT", "2"),
            ("JOB_PAYLOAD_BYTES", "256"),
            ("JOB_WORK_MS", "1"),
        ],
        Stdio::null(),
    ));
    let lines = Lines::collect(child.0.stdout.take().unwrap());
    harness::wait_for("the descriptor", Duration::from_secs(60), || {
        let n = lines.all().len();
        async move { (n > 0).then_some(()) }
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(60));
    lines.wait_for_sample("jobs to complete", Duration::from_secs(30), |m, v| m == "completion_rate" && v > 0.0).await;

    // The harness raises the rate through the control file.
    std::fs::write(&rate_file, "150\n").unwrap();
    // Every connection of the adapter is cut, as a failover or an operator would.
    let cut: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for pid in &cut {
        sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&pool).await.unwrap();
    }
    assert!(!cut.is_empty(), "the adapter had connections to cut");
    let seen = lines.all().len();
    // After the cut it keeps producing and completing at the new rate.
    harness::wait_for("completions after the connections were cut", Duration::from_secs(30), || {
        let later: Vec<String> = lines.all().into_iter().skip(seen).collect();
        let ok = later
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| v["metric"] == "completion_rate" && v["value"].as_f64().unwrap_or(0.0) > 0.0)
            && later.iter().any(|l| l.contains("\"producer_target_rate\"") && l.contains("\"value\":150"));
        async move { ok.then_some(()) }
    })
    .await;
    assert!(child.0.try_wait().unwrap().is_none(), "the adapter exited after losing its connections");
    let until = Instant::now() + Duration::from_secs(15).saturating_sub(started.elapsed());
    tokio::time::sleep_until(until.into()).await;

    harness::signal(&child.0, Signal::SIGTERM);
    let stop = Instant::now();
    let status = harness::wait_exit(&mut child.0, Duration::from_secs(10));
    let stop_took = stop.elapsed();
    assert!(status.success(), "exit 0 on SIGTERM, got {status:?}");
    assert!(stop_took < Duration::from_secs(5), "stopped in {stop_took:?}");
    std::thread::sleep(Duration::from_millis(100)); // the reader drains the closed pipe

    let ticks = check_protocol(&lines.all(), &pool, &db_name).await;
    assert!(ticks.len() >= 5, "only {} ticks in ~15 s", ticks.len());
    assert!(ticks.values().any(|m| m["enqueue_rate"] > 0.0 && m["completion_rate"] > 0.0), "{ticks:?}");
    assert!(ticks.values().any(|m| m["claim_p99_ms"] > 0.0), "{ticks:?}");
    let total = check_nothing_lost(&pool).await;
    let running: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state = 'running'").fetch_one(&pool).await.unwrap();
    assert_eq!(running, 0, "the stop released or finished every job it held");
    assert!(total > 100, "only {total} jobs in ~15 s at 100-150/s");
    std::fs::remove_dir_all(dir).unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn harness_pacing_inserts_exactly_what_stdin_asks_for(pool: PgPool) {
    let url = harness::database_url(&pool);
    let mut child = KillOnDrop(spawn(
        &url,
        &[("PRODUCER_MODE", "fixed"), ("PRODUCER_PACING", "harness"), ("PRODUCER_RATE", "500"), ("WORKER_COUNT", "2")],
        Stdio::piped(),
    ));
    let lines = Lines::collect(child.0.stdout.take().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    for line in ["ENQUEUE 40", "a line the adapter ignores", "ENQUEUE 25", "ENQUEUE 35"] {
        writeln!(stdin, "{line}").unwrap();
    }
    stdin.flush().unwrap();
    harness::wait_for("the 100 asked-for jobs to complete", Duration::from_secs(60), || {
        let pool = pool.clone();
        async move {
            let done: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'bench.job' AND state = 'completed'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            (done >= 100).then_some(())
        }
    })
    .await;
    // Asked for nothing more, with stdin still open, it produces nothing more.
    lines.wait_for_sample("a tick", Duration::from_secs(10), |m, _| m == "enqueue_rate").await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    harness::signal(&child.0, Signal::SIGTERM);
    assert!(harness::wait_exit(&mut child.0, Duration::from_secs(10)).success());
    drop(stdin);
    assert_eq!(check_nothing_lost(&pool).await, 100, "exactly the jobs ENQUEUE asked for");
}
