//! The agent-turns figures: airlock's own time per round (everything between two model
//! calls of a turn: the answer parsed and recorded, the tool called and its result
//! recorded, the next context rendered — the model call itself excluded), and turns
//! completed per second with 32 at once (on 32 runs: the turns of one run take it one at a
//! time). A real `airlock-api` and `airlock-worker` on a database of their own, against a
//! scripted OpenAI-compatible server in this process that answers at once: a tool call
//! (`journal.search`), another, then a final answer.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};

use crate::service::smtp_sink;
use crate::{Args, Db, Proc, free_port, percentile, spawn};

/// Turns in flight at once.
pub const AT_ONCE: usize = 32;
/// Turns measured.
const TURNS: usize = 256;

/// Turns measured one at a time, for the time per round of an unloaded worker.
const ALONE: usize = 48;

pub struct TurnFigures {
    pub turns_per_sec: f64,
    /// One turn at a time.
    pub round_p50_ms: f64,
    pub round_p99_ms: f64,
    /// 32 at once.
    pub round_loaded_p50_ms: f64,
    pub round_loaded_p99_ms: f64,
    pub worker_rss_mib: f64,
}

/// airlock's time per round: from a model answer going out to the turn's next request
/// coming in. Clears what was seen.
fn round_gaps(seen: &Mutex<Seen>) -> Vec<f64> {
    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    let mut gaps: Vec<f64> = Vec::new();
    for rounds in seen.rounds.values() {
        for w in rounds.windows(2) {
            gaps.push(w[1].0.duration_since(w[0].1).as_secs_f64() * 1000.0);
        }
    }
    seen.rounds.clear();
    gaps.sort_by(f64::total_cmp);
    gaps
}

/// Waits until turn `id` has ended.
async fn ended(pool: &sqlx::PgPool, id: uuid::Uuid) -> anyhow::Result<()> {
    loop {
        let ended: Option<bool> = sqlx::query_scalar("SELECT finished_at IS NOT NULL FROM agent_turns WHERE id = $1")
            .bind(id)
            .fetch_optional(pool)
            .await?;
        if ended == Some(true) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What the scripted server saw: per turn (its input), when each request came in and
/// when its answer went out.
#[derive(Default)]
struct Seen {
    rounds: HashMap<String, Vec<(Instant, Instant)>>,
}

async fn complete(State(seen): State<Arc<Mutex<Seen>>>, Json(req): Json<Value>) -> Json<Value> {
    let came = Instant::now();
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let answered = messages.iter().filter(|m| m["role"] == "assistant").count();
    let input = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .find(|c| c.starts_with("bench turn "))
        .unwrap_or_default()
        .to_string();
    let action = match answered {
        0 | 1 => {
            json!({"type": "tool_call", "tool_id": "journal.search", "arguments": {"query": format!("q{answered}")}})
        }
        _ => json!({"type": "final", "text": "done"}),
    };
    let body = json!({
        "id": "bench", "object": "chat.completion", "model": req["model"],
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": action.to_string()}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
    });
    seen.lock().unwrap_or_else(|e| e.into_inner()).rounds.entry(input).or_default().push((came, Instant::now()));
    Json(body)
}

pub async fn turns(args: &Args) -> anyhow::Result<TurnFigures> {
    let db = Db::create(args, "turns").await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let app = axum::Router::new().route("/v1/chat/completions", post(complete)).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let model_addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let (_sink, smtp_port, ca) = smtp_sink(args, 0).await?;
    let port = free_port()?;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("AIRLOCK__API__LISTEN", format!("127.0.0.1:{port}")),
        ("AIRLOCK__SMTP__HOST", "127.0.0.1".into()),
        ("AIRLOCK__SMTP__PORT", smtp_port.to_string()),
        ("AIRLOCK__SMTP__CA_FILE", ca.display().to_string()),
        ("AIRLOCK__WORKER__QUEUES", "default".into()),
        ("AIRLOCK__WORKER__CONCURRENCY", AT_ONCE.to_string()),
        ("AIRLOCK__DATABASE__MAX_CONNECTIONS", "16".into()),
        ("AIRLOCK__RUNS__MAX_STEPS", "0".into()),
        ("AIRLOCK__MODELS__BENCH__ENDPOINT", format!("http://{model_addr}")),
        ("AIRLOCK__MODELS__BENCH__MODEL", "scripted".into()),
    ];
    let _api = spawn(&args.bin_dir, "airlock-api", &[], &env)?;
    let worker: Proc = spawn(&args.bin_dir, "airlock-worker", &[], &env)?;
    let out = Command::new(args.bin_dir.join("airlock-admin"))
        .args(["token", "create", "--role", "agent", "--name", "bench-turns", "--agent", "bench-turns"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .output()?;
    let token = String::from_utf8(out.stdout)?.trim().to_string();
    let http = reqwest::Client::builder().no_proxy().build()?;
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..600 {
        if http.get(format!("{url}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let post = |path: String, body: Value| {
        let (http, token) = (http.clone(), token.clone());
        async move {
            let r = http.post(path).bearer_auth(&token).json(&body).send().await?;
            let status = r.status();
            let v: Value = r.json().await?;
            if !status.is_success() {
                bail!("{status}: {v}");
            }
            anyhow::Ok(v)
        }
    };
    let run = post(format!("{url}/v1/runs"), json!({}))
        .await?
        .get("id")
        .and_then(Value::as_str)
        .context("run id")?
        .to_string();
    let turn = |i: usize| json!({"step_id": format!("t{i}"), "model": "bench", "input": format!("bench turn {i}"), "tools": ["journal.search"]});
    // Warm-up: a few turns, not measured.
    for i in 0..4 {
        post(format!("{url}/v1/runs/{run}/turns"), turn(TURNS + i)).await?;
    }
    wait_done(&db, 4, Duration::from_secs(60)).await?;
    seen.lock().unwrap_or_else(|e| e.into_inner()).rounds.clear();

    // One at a time: airlock's time per round on a worker with nothing else to do.
    for i in 0..ALONE {
        let v = post(format!("{url}/v1/runs/{run}/turns"), turn(TURNS + 4 + i)).await?;
        ended(&db.pool, v["id"].as_str().context("turn id")?.parse()?).await?;
    }
    let alone = round_gaps(&seen);

    // 32 at once, each client on a run of its own (the turns of one run take it one at a
    // time): each asks for its next turn as soon as its last one ended.
    let mut runs = Vec::new();
    for _ in 0..AT_ONCE {
        let v = post(format!("{url}/v1/runs"), json!({})).await?;
        runs.push(v.get("id").and_then(Value::as_str).context("run id")?.to_string());
    }
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for run in runs {
        let (next, http, token, url, pool) = (next.clone(), http.clone(), token.clone(), url.clone(), db.pool.clone());
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= TURNS {
                    return anyhow::Ok(());
                }
                let r =
                    http.post(format!("{url}/v1/runs/{run}/turns")).bearer_auth(&token).json(&turn(i)).send().await?;
                let v: Value = r.json().await?;
                ended(&pool, v["id"].as_str().context("turn id")?.parse()?).await?;
            }
        });
    }
    while let Some(r) = clients.join_next().await {
        r??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM agent_turns WHERE state = 'completed'").fetch_one(&db.pool).await?;
    let all = (TURNS + 4 + ALONE) as i64;
    if completed < all {
        bail!("only {completed} of {all} turns completed");
    }
    let worker_rss_mib = worker.peak_rss_mib();
    let loaded = round_gaps(&seen);
    server.abort();
    drop(worker);
    db.drop().await?;
    Ok(TurnFigures {
        turns_per_sec: TURNS as f64 / elapsed,
        round_p50_ms: percentile(&alone, 0.5),
        round_p99_ms: percentile(&alone, 0.99),
        round_loaded_p50_ms: percentile(&loaded, 0.5),
        round_loaded_p99_ms: percentile(&loaded, 0.99),
        worker_rss_mib,
    })
}

async fn wait_done(db: &Db, n: i64, limit: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_turns WHERE finished_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await?;
        if done >= n {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("{done} of {n} warm-up turns ended");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
