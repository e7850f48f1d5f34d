//! The durable-runs figures: steps recorded per second through the agent API with sixteen
//! runs recording at once, and the latency of one step record at a steady 200 steps/s.
//! A real `airlock-api` process on a database of its own.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::{Args, Db, free_port, percentile, spawn};

/// One measurement's figures.
pub struct RunsFigures {
    pub steps_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Runs recording at once for the throughput figure.
const RUNS: usize = 16;
/// How long each figure records.
const SECONDS: u64 = 10;
/// The steady rate of the latency figure.
const RATE: u64 = 200;

pub async fn runs(args: &Args, db: &Db) -> anyhow::Result<RunsFigures> {
    let port = free_port()?;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("AIRLOCK__API__LISTEN", format!("127.0.0.1:{port}")),
        ("AIRLOCK__DATABASE__MAX_CONNECTIONS", "24".into()),
        ("AIRLOCK__RUNS__MAX_STEPS", "0".into()),
    ];
    let api = spawn(&args.bin_dir, "airlock-api", &[], &env)?;
    let out = Command::new(args.bin_dir.join("airlock-admin"))
        .args([
            "token",
            "create",
            "--role",
            "agent",
            "--name",
            &format!("bench-runs-{}", uuid::Uuid::new_v4()),
            "--agent",
            "bench-runs",
        ])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .output()?;
    let token = String::from_utf8(out.stdout)?.trim().to_string();
    let http = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(64).build()?;
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..600 {
        if http.get(format!("{url}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = Client { http, url, token: Arc::new(token) };
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        runs.push(client.create_run().await?);
    }
    // Warm the connections and the prepared statements up.
    for (i, run) in runs.iter().enumerate() {
        client.step(run, &format!("warm-{i}")).await?;
    }

    // Throughput: each run records its steps one after another, sixteen runs at once.
    let counter = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(SECONDS);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for run in runs.clone() {
        let (client, counter) = (client.clone(), counter.clone());
        tasks.spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                client.step(&run, &format!("t-{i}")).await?;
                counter.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let steps_per_sec = counter.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();

    // Latency: one step every 1/RATE s, spread over the runs, each timed from its send.
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut timed = tokio::task::JoinSet::new();
    for i in 0..(RATE * SECONDS) {
        tick.tick().await;
        let (client, run) = (client.clone(), runs[i as usize % RUNS].clone());
        timed.spawn(async move {
            let t = Instant::now();
            client.step(&run, &format!("l-{i}")).await?;
            anyhow::Ok(t.elapsed().as_secs_f64() * 1000.0)
        });
    }
    let mut ms = Vec::new();
    while let Some(r) = timed.join_next().await {
        ms.push(r??);
    }
    ms.sort_by(f64::total_cmp);
    api.stop();
    Ok(RunsFigures { steps_per_sec, p50_ms: percentile(&ms, 0.5), p99_ms: percentile(&ms, 0.99) })
}

#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    url: String,
    token: Arc<String>,
}

impl Client {
    async fn post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let r =
            self.http.post(format!("{}{path}", self.url)).bearer_auth(self.token.as_str()).json(&body).send().await?;
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status.is_success(), "{path}: {status}: {v}");
        Ok(v)
    }

    async fn create_run(&self) -> anyhow::Result<String> {
        let v = self.post("/v1/runs", json!({"budget": {}})).await?;
        Ok(v["id"].as_str().context("run id")?.to_string())
    }

    /// Records one step, as an agent records a model's output (with its usage).
    async fn step(&self, run: &str, step_id: &str) -> anyhow::Result<()> {
        let body = json!({"epoch": 1, "step_id": step_id, "kind": "model_output",
                          "data": {"text": "a recorded answer of a typical size, with a little JSON around it"},
                          "usage": {"tokens": 120, "cost_micros": 30}});
        self.post(&format!("/v1/runs/{run}/steps"), body).await.map(|_| ())
    }
}
