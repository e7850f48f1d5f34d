//! The MCP figure: `get_delivery` over MCP (`POST /mcp`, a `tools/call` as a streamable-HTTP
//! client sends it after `initialize`) against the same read over HTTP (`GET
//! /v1/deliveries/{id}`), side by side: the two kinds of call alternate, one at a time, on
//! one real `airlock-api` process and a database of its own, so a drift of the machine
//! touches both alike. The target: MCP's p99 at most 1.5× HTTP's.

use std::time::Instant;

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use crate::{Args, Db, free_port, percentile, spawn};

/// One measurement's figures, milliseconds.
pub struct McpFigures {
    pub http_p50_ms: f64,
    pub http_p99_ms: f64,
    pub mcp_p50_ms: f64,
    pub mcp_p99_ms: f64,
}

/// Calls of each kind measured (after as many again to warm up).
const CALLS: usize = 2_000;

pub async fn mcp(args: &Args) -> anyhow::Result<McpFigures> {
    let db = Db::create(args, "mcp").await?;
    let port = free_port()?;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("AIRLOCK__API__LISTEN", format!("127.0.0.1:{port}")),
        ("AIRLOCK__DELIVERY__SENDERS", "agent@example.com".into()),
    ];
    let api = spawn(&args.bin_dir, "airlock-api", &[], &env)?;
    let out = std::process::Command::new(args.bin_dir.join("airlock-admin"))
        .args(["token", "create", "--role", "agent", "--name", "bench-mcp", "--agent", "bench-mcp"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .output()?;
    let token = String::from_utf8(out.stdout)?.trim().to_string();
    ensure!(!token.is_empty(), "no token: {}", String::from_utf8_lossy(&out.stderr));
    let http = reqwest::Client::builder().no_proxy().build()?;
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..600 {
        if http.get(format!("{url}/readyz")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    // One run and one delivery to read (no worker: it stays as submitted).
    let post = |path: &str, body: Value| http.post(format!("{url}{path}")).bearer_auth(&token).json(&body).send();
    let run: Value = post("/v1/runs", json!({"budget": {}})).await?.json().await?;
    let run_id = run["id"].as_str().context("run id")?.to_string();
    let email = json!({"run_id": run_id, "step_id": "bench", "channel": "email",
        "email": {"from": "agent@example.com", "to": ["a@example.org"], "subject": "A delivery to read",
                  "text": "A body of a typical size for a short agent email, a line or two of text."}});
    let d: Value = post("/v1/deliveries", email).await?.json().await?;
    let id = d["id"].as_str().with_context(|| format!("delivery: {d}"))?.to_string();

    // The MCP client's handshake, once, as a real client does; then only tool calls.
    let mcp_url = format!("{url}/mcp");
    let rpc = |body: Value| {
        http.post(&mcp_url)
            .bearer_auth(&token)
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-11-25")
            .json(&body)
            .send()
    };
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-11-25",
        "capabilities": {}, "clientInfo": {"name": "airlock-bench", "version": "0"}}});
    let r = rpc(init).await?;
    ensure!(r.status().is_success(), "initialize: {}", r.status());

    let over_http = || async {
        let r = http.get(format!("{url}/v1/deliveries/{id}")).bearer_auth(&token).send().await?;
        ensure!(r.status().is_success(), "GET: {}", r.status());
        let v: Value = r.json().await?;
        anyhow::Ok(v)
    };
    let call = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "get_delivery", "arguments": {"delivery_id": id}}});
    let over_mcp = || async {
        let r = rpc(call.clone()).await?;
        ensure!(r.status().is_success(), "tools/call: {}", r.status());
        let v: Value = r.json().await?;
        ensure!(v["result"]["isError"] == false, "tools/call: {v}");
        anyhow::Ok(v["result"]["structuredContent"].clone())
    };
    // Both answer the same delivery.
    ensure!(over_http().await? == over_mcp().await?, "MCP and HTTP answer differently");

    let (mut h, mut m) = (Vec::with_capacity(CALLS), Vec::with_capacity(CALLS));
    let timed = |ms: &mut f64, t: Instant| *ms = t.elapsed().as_secs_f64() * 1000.0;
    for i in 0..2 * CALLS {
        // Which goes first alternates, so neither always meets a warmer connection.
        let (mut a, mut b) = (0.0, 0.0);
        if i % 2 == 0 {
            let t = Instant::now();
            over_http().await?;
            timed(&mut a, t);
            let t = Instant::now();
            over_mcp().await?;
            timed(&mut b, t);
        } else {
            let t = Instant::now();
            over_mcp().await?;
            timed(&mut b, t);
            let t = Instant::now();
            over_http().await?;
            timed(&mut a, t);
        }
        if i >= CALLS {
            h.push(a);
            m.push(b);
        }
    }
    h.sort_by(f64::total_cmp);
    m.sort_by(f64::total_cmp);
    api.stop();
    db.drop().await?;
    Ok(McpFigures {
        http_p50_ms: percentile(&h, 0.5),
        http_p99_ms: percentile(&h, 0.99),
        mcp_p50_ms: percentile(&m, 0.5),
        mcp_p99_ms: percentile(&m, 0.99),
    })
}
