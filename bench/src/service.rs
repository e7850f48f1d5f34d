//! The pipeline's figures, through real api, admin and worker processes on one database:
//! its throughput (with the reviewer's reads timed beside it when the database has a
//! history), and the latencies of a steady rate that a reviewer approves by hand.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::deliveries::list_statement;
use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::{
    Args, Db, MEASURED_POLL, Proc, db_clock, free_port, peak_rss_mib, percentile, spawn, spawn_niced, wait_until,
};

/// Sends one worker process of the pipeline runs at once.
const PIPELINE_CONCURRENCY: usize = 128;

/// Agent runs submitting at once, as a fleet of agents does (each run's budget is spent in
/// order, so one run's submissions are serialised by design).
const RUNS: usize = 16;

/// The bench's setting for `key`, unless the bench's own environment sets it (for runs
/// side by side).
fn tuned(key: &str, default: usize) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

/// A local SMTP sink (STARTTLS, discarding what it gets, answering each message after
/// `reply_ms`): the process, its port, its CA.
pub async fn smtp_sink(args: &Args, reply_ms: u64) -> anyhow::Result<(Proc, u16, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("airlock-bench-smtp-{}-{}", std::process::id(), uuid::Uuid::new_v4()));
    let port = free_port()?;
    let sink_args =
        [port.to_string(), dir.display().to_string(), "--discard".into(), "--reply-ms".into(), reply_ms.to_string()];
    let sink_args: Vec<&str> = sink_args.iter().map(String::as_str).collect();
    let sink = spawn(&args.bin_dir, "airlock-dev-smtp", &sink_args, &[])?;
    let ca = dir.join("ca.pem");
    let start = Instant::now();
    while !ca.exists() {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the SMTP sink did not start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((sink, port, ca))
}

/// The whole service on one database: an SMTP sink, the api, the admin and two workers,
/// with an agent, an operator and a reviewer token, ready to serve.
pub struct Stack {
    sink: Proc,
    sink_dir: PathBuf,
    api: Proc,
    admin: Proc,
    workers: Vec<Proc>,
    http: reqwest::Client,
    pub api_url: String,
    pub admin_url: String,
    pub agent_id: String,
    pub agent: String,
    pub operator: String,
    pub reviewer: String,
}

impl Stack {
    /// Starts everything on `db`, the relay answering each message after `reply_ms`.
    pub async fn start(args: &Args, db: &Db, reply_ms: u64) -> anyhow::Result<Self> {
        let (sink, smtp_port, ca) = smtp_sink(args, reply_ms).await?;
        let sink_dir = ca.parent().map(PathBuf::from).unwrap_or_default();
        let (api_port, admin_port) = (free_port()?, free_port()?);
        let env = vec![
            ("DATABASE_URL", db.url.clone()),
            ("AIRLOCK__API__LISTEN", format!("127.0.0.1:{api_port}")),
            ("AIRLOCK__ADMIN__LISTEN", format!("127.0.0.1:{admin_port}")),
            ("AIRLOCK__SMTP__HOST", "127.0.0.1".into()),
            ("AIRLOCK__SMTP__PORT", smtp_port.to_string()),
            ("AIRLOCK__SMTP__CA_FILE", ca.display().to_string()),
            ("AIRLOCK__DELIVERY__SENDERS", "@example.com".into()),
            ("AIRLOCK__DELIVERY__KNOWN_DOMAINS", "example.org".into()),
            // Sends wait on the database and the relay far more than they compute: a worker
            // runs many at once, and its batches grow with them (see the README).
            ("AIRLOCK__WORKER__CONCURRENCY", tuned("AIRLOCK__WORKER__CONCURRENCY", PIPELINE_CONCURRENCY)),
            // As many SMTP connections kept open as sends run at once: a new one costs a TLS
            // handshake on both ends.
            ("AIRLOCK__SMTP__MAX_IDLE_CONNECTIONS", tuned("AIRLOCK__SMTP__MAX_IDLE_CONNECTIONS", PIPELINE_CONCURRENCY)),
            ("AIRLOCK__DATABASE__MAX_CONNECTIONS", "16".into()),
        ];
        let api = spawn(&args.bin_dir, "airlock-api", &[], &env)?;
        let admin = spawn(&args.bin_dir, "airlock-admin", &["serve"], &env)?;
        let workers: Vec<Proc> = (0..2)
            .map(|_| spawn_niced(&args.bin_dir, "airlock-worker", &[], &env, args.worker_nice))
            .collect::<anyhow::Result<_>>()?;
        // A worker that cannot start (one without bubblewrap refuses to) fails the run here,
        // rather than leaving it to wait for receipts that never come.
        wait_until(&db.pool, "SELECT count(*) FROM workers WHERE stopped_at IS NULL", 2, Duration::from_secs(60))
            .await
            .context("the pipeline's two workers did not start (their errors are above)")?;
        // Names of their own, so that several stacks can run on one database in turn.
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let agent_id = format!("bench-agent-{suffix}");
        let token = |role: &str| -> anyhow::Result<String> {
            let mut cmd = Command::new(args.bin_dir.join("airlock-admin"));
            cmd.args(["token", "create", "--role", role, "--name", &format!("bench-{role}-{suffix}")]);
            if role == "agent" {
                cmd.args(["--agent", &agent_id]);
            }
            let out = cmd.env("DATABASE_URL", &db.url).env("RUST_LOG", "error").output()?;
            anyhow::ensure!(out.status.success(), "token create: {}", String::from_utf8_lossy(&out.stderr));
            Ok(String::from_utf8(out.stdout)?.trim().to_string())
        };
        let (agent, operator, reviewer) = (token("agent")?, token("operator")?, token("reviewer")?);
        let http = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(64).build()?;
        let api_url = format!("http://127.0.0.1:{api_port}");
        let admin_url = format!("http://127.0.0.1:{admin_port}");
        for _ in 0..600 {
            if http.get(format!("{api_url}/readyz")).send().await.is_ok_and(|r| r.status().is_success())
                && http.get(format!("{admin_url}/readyz")).send().await.is_ok_and(|r| r.status().is_success())
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let stack =
            Self { sink, sink_dir, api, admin, workers, http, api_url, admin_url, agent_id, agent, operator, reviewer };
        let r = stack
            .http
            .put(format!("{}/admin/v1/send-enabled", stack.admin_url))
            .bearer_auth(&stack.operator)
            .json(&json!({"enabled": true, "reason": "benchmark"}))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "switch: {}", r.status());
        Ok(stack)
    }

    /// POSTs `body`; its answer, or an error saying what the service said.
    pub async fn post(&self, url: String, token: &str, body: Value) -> anyhow::Result<Value> {
        let r = self.http.post(url).bearer_auth(token).json(&body).send().await?;
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        anyhow::ensure!(status.is_success(), "{status}: {v}");
        Ok(v)
    }

    /// GETs `url` as the reviewer; its answer and how long it took, ms.
    pub async fn get(&self, url: &str) -> anyhow::Result<(Value, f64)> {
        timed_get(&self.http, url, &self.reviewer).await
    }

    /// A standing grant approving this stack's agent's email to example.org.
    pub async fn grant(&self) -> anyhow::Result<()> {
        let body = json!({"channel": "email", "agent_ids": [self.agent_id], "recipient_domains": ["example.org"],
                          "min_score": 0.5, "expires_at": (chrono::Utc::now() + chrono::Duration::hours(2)).to_rfc3339(),
                          "max_uses": 1_000_000, "reason": "benchmark"});
        self.post(format!("{}/admin/v1/grants", self.admin_url), &self.operator, body).await.map(|_| ())
    }

    /// Runs to submit under, unlimited.
    pub async fn runs(&self) -> anyhow::Result<Vec<String>> {
        let mut runs = Vec::new();
        for _ in 0..RUNS {
            let run = self
                .post(format!("{}/v1/runs", self.api_url), &self.agent, json!({"budget": {"max_steps": 0}}))
                .await?;
            runs.push(run["id"].as_str().context("run id")?.to_string());
        }
        Ok(runs)
    }

    /// Submits one email delivery; its id and the POST's time, ms.
    pub async fn submit(&self, run_id: &str, step_id: &str) -> anyhow::Result<(String, f64)> {
        let t = Instant::now();
        let body = json!({"run_id": run_id, "step_id": step_id, "channel": "email",
                          "email": {"from": "agent@example.com", "to": ["reader@example.org"],
                                    "subject": format!("Report {step_id}"), "text": "The numbers are in."}});
        let v = self.post(format!("{}/v1/deliveries", self.api_url), &self.agent, body).await?;
        Ok((v["id"].as_str().context("delivery id")?.to_string(), t.elapsed().as_secs_f64() * 1000.0))
    }

    /// Stops everything; the workers' peak RSS, MiB.
    pub fn stop(self) -> f64 {
        let rss = peak_rss_mib(&self.workers);
        for w in self.workers {
            w.stop();
        }
        self.api.stop();
        self.admin.stop();
        drop(self.sink);
        let _ = std::fs::remove_dir_all(&self.sink_dir);
        rss
    }
}

/// Submits `n` deliveries spread over `runs`, one submitter per run at once, step ids
/// `{prefix}{i}`; each POST's time, ms.
async fn submit_all(stack: &Arc<Stack>, runs: &[String], prefix: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (c, run_id) in runs.iter().cloned().enumerate() {
        let (stack, prefix, stride) = (stack.clone(), prefix.to_string(), runs.len());
        tasks.spawn(async move {
            let mut ms = Vec::new();
            let mut i = c;
            while i < n {
                ms.push(stack.submit(&run_id, &format!("{prefix}{i}")).await?.1);
                i += stride;
            }
            anyhow::Ok(ms)
        });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r??);
    }
    all.sort_by(f64::total_cmp);
    Ok(all)
}

/// Submits `n` deliveries at `rate` a second, spread over `runs`, step ids `{prefix}{i}`,
/// each POST started on its tick whether or not the ones before were answered; each
/// delivery's id and its POST's time, ms, in the order they were answered.
async fn submit_paced(
    stack: &Arc<Stack>,
    runs: &[String],
    prefix: &str,
    rate: u64,
    n: usize,
) -> anyhow::Result<Vec<(String, f64)>> {
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut posts = tokio::task::JoinSet::new();
    for i in 0..n {
        tick.tick().await;
        let (stack, run, step) = (stack.clone(), runs[i % runs.len()].clone(), format!("{prefix}{i}"));
        posts.spawn(async move { stack.submit(&run, &step).await });
    }
    let mut answered = Vec::with_capacity(n);
    while let Some(r) = posts.join_next().await {
        answered.push(r??);
    }
    Ok(answered)
}

/// The reviewer's reads, timed: the review queue's first page, its page 100 through the
/// cursor, and one delivery of the history.
#[derive(Default)]
pub struct Reads {
    pub list_ms: Vec<f64>,
    pub page100_ms: Vec<f64>,
    pub get_ms: Vec<f64>,
    /// The floors beside them: the admin's `/healthz` (one HTTP exchange, no database) and
    /// one round trip of `SELECT 1` from the bench to the database, each timed as the reads.
    pub healthz_ms: Vec<f64>,
    pub select1_ms: Vec<f64>,
    /// The first page's statement as the admin prepares it, sent over the same connection
    /// as the `SELECT 1`: the page's database part, with no HTTP and no token lookup.
    pub statement_ms: Vec<f64>,
}

impl Reads {
    /// Starts reading, on a sample of the history's sent deliveries, until `done`. The
    /// reviewer reads from a thread and a runtime of their own, with a client and a
    /// database connection of their own: a reviewer's browser is not queued behind the
    /// bench's submitters, and its reads are not either.
    async fn start(
        stack: &Arc<Stack>,
        db: &Db,
        done: &Arc<AtomicBool>,
    ) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<Reads>>> {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id::text FROM deliveries TABLESAMPLE SYSTEM (1) WHERE state = 'sent' LIMIT 1000",
        )
        .fetch_all(&db.pool)
        .await?;
        anyhow::ensure!(!ids.is_empty(), "no history to read");
        let reader =
            Reader { admin_url: stack.admin_url.clone(), token: stack.reviewer.clone(), db_url: db.url.clone() };
        let done = done.clone();
        Ok(tokio::task::spawn_blocking(move || {
            tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(reader.run(ids, done))
        }))
    }
}

/// GETs `url` with `token`; its answer and how long it took, ms.
async fn timed_get(http: &reqwest::Client, url: impl AsRef<str>, token: &str) -> anyhow::Result<(Value, f64)> {
    let url = url.as_ref();
    let t = Instant::now();
    let r = http.get(url).bearer_auth(token).send().await?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    anyhow::ensure!(status.is_success(), "{url}: {status}: {v}");
    Ok((v, ms))
}

/// A reviewer reading the admin service.
struct Reader {
    admin_url: String,
    token: String,
    db_url: String,
}

impl Reader {
    /// Reads as a reviewer does, one read every 20 ms, until `done`.
    async fn run(self, ids: Vec<String>, done: Arc<AtomicBool>) -> anyhow::Result<Reads> {
        let http = reqwest::Client::builder().no_proxy().build()?;
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&self.db_url).await?;
        let get = |url: String| timed_get(&http, url, &self.token);
        let list = format!("{}/admin/v1/deliveries?state=in_review&limit=50", self.admin_url);
        // Page 100: ninety-nine pages through the cursor first.
        let mut page100 = list.clone();
        for _ in 0..99 {
            let (v, _) = get(page100.clone()).await?;
            let next = v["next"].as_str().context("the review queue has fewer than 100 pages")?;
            page100 = format!("{list}&cursor={next}");
        }
        let healthz = format!("{}/healthz", self.admin_url);
        let mut reads = Reads::default();
        let mut i = 0;
        while !done.load(Ordering::Relaxed) {
            let (v, ms) = get(page100.clone()).await?;
            anyhow::ensure!(v["items"].as_array().is_some_and(|a| a.len() == 50), "page 100 is a full page: {v}");
            reads.page100_ms.push(ms);
            tokio::time::sleep(Duration::from_millis(20)).await;
            reads.list_ms.push(get(list.clone()).await?.1);
            tokio::time::sleep(Duration::from_millis(20)).await;
            let url = format!("{}/admin/v1/deliveries/{}", self.admin_url, ids[i % ids.len()]);
            reads.get_ms.push(get(url).await?.1);
            tokio::time::sleep(Duration::from_millis(20)).await;
            reads.healthz_ms.push(get(healthz.clone()).await?.1);
            tokio::time::sleep(Duration::from_millis(20)).await;
            let t = Instant::now();
            sqlx::query("SELECT 1").execute(&mut conn).await?;
            reads.select1_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            tokio::time::sleep(Duration::from_millis(20)).await;
            let t = Instant::now();
            list_statement(&[DeliveryState::InReview], None, 51).build().execute(&mut conn).await?;
            reads.statement_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            tokio::time::sleep(Duration::from_millis(20)).await;
            i += 1;
        }
        for v in [
            &mut reads.list_ms,
            &mut reads.page100_ms,
            &mut reads.get_ms,
            &mut reads.healthz_ms,
            &mut reads.select1_ms,
            &mut reads.statement_ms,
        ] {
            v.sort_by(f64::total_cmp);
        }
        Ok(reads)
    }
}

/// Waits until `n` deliveries of `agent` are sent (read through the agent's index, so the
/// wait costs the same on a history as without one).
async fn wait_sent(db: &Db, agent: &str, n: usize) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE agent = $1 AND state = 'sent'")
            .bind(agent)
            .fetch_one(&db.pool)
            .await?;
        if sent as usize >= n {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(1800) {
            bail!("only {sent} of {n} deliveries of {agent} were sent");
        }
        tokio::time::sleep(MEASURED_POLL).await;
    }
}

/// One repetition of the pipeline's throughput.
pub struct PipelineRun {
    /// Deliveries per second.
    pub rate: f64,
    /// The journey's p50 and p99, ms.
    pub p50: f64,
    pub p99: f64,
    /// Each submission's POST, ms, sorted.
    pub submit_ms: Vec<f64>,
    /// The workers' peak RSS, MiB.
    pub rss: f64,
    /// The reviewer's reads beside it, when asked for.
    pub reads: Option<Reads>,
}

/// Deliveries per second from POST to `sent` on `db`, approved by a standing grant, sent
/// to a local SMTP sink; the journey's p50/p99, and the workers' peak RSS. With `reads`,
/// a reviewer reads the review queue and the history's deliveries all along.
pub async fn pipeline(args: &Args, db: &Db, reads: bool) -> anyhow::Result<PipelineRun> {
    pipeline_at(args, db, reads, None).await
}

/// The pipeline's work submitted at `pace`'s (deliveries per second, seconds) instead of
/// all at once, the rest as `pipeline`: the reviewer's reads at a given load below the
/// saturating one.
pub async fn pipeline_at(args: &Args, db: &Db, reads: bool, pace: Option<(u64, u64)>) -> anyhow::Result<PipelineRun> {
    let stack = Arc::new(Stack::start(args, db, 0).await?);
    stack.grant().await?;
    let runs = stack.runs().await?;
    // A warm-up first, then ANALYZE, as autovacuum has long done on a running installation:
    // the statements a process keeps prepared were planned on the tables as they were, and
    // plans made on empty tables read them whole (see the README).
    let warmup = args.pipeline_warmup;
    if warmup > 0 {
        submit_all(&stack, &runs, "w", warmup).await?;
        wait_sent(db, &stack.agent_id, warmup).await?;
        sqlx::query("ANALYZE").execute(&db.pool).await?;
    }
    let done = Arc::new(AtomicBool::new(false));
    let reader = if reads { Some(Reads::start(&stack, db, &done).await?) } else { None };
    let n = pace.map_or(args.deliveries, |(rate, seconds)| (rate * seconds) as usize);
    let start = db_clock(&db.pool).await?;
    let submit_ms = match pace {
        None => submit_all(&stack, &runs, "s", n).await?,
        Some((rate, _)) => {
            let mut ms: Vec<f64> = submit_paced(&stack, &runs, "s", rate, n).await?.into_iter().map(|a| a.1).collect();
            ms.sort_by(f64::total_cmp);
            ms
        }
    };
    // From the first POST to the last receipt, on the database's clock.
    wait_sent(db, &stack.agent_id, warmup + n).await?;
    done.store(true, Ordering::Relaxed);
    let reads = match reader {
        Some(r) => Some(r.await??),
        None => None,
    };
    let journeys: Vec<(f64, f64)> = sqlx::query_as(
        "SELECT extract(epoch FROM r.sent_at)::float8, extract(epoch FROM r.sent_at - d.created_at)::float8 * 1000
         FROM deliveries d JOIN receipts r ON r.delivery_id = d.id
         WHERE d.agent = $1 AND d.created_at >= to_timestamp($2)",
    )
    .bind(&stack.agent_id)
    .bind(start)
    .fetch_all(&db.pool)
    .await?;
    anyhow::ensure!(journeys.len() == n, "{} of {n} measured deliveries have a receipt", journeys.len());
    let end = journeys.iter().map(|j| j.0).fold(f64::MIN, f64::max);
    let rate = n as f64 / (end - start);
    let mut ms: Vec<f64> = journeys.iter().map(|j| j.1).collect();
    ms.sort_by(f64::total_cmp);
    let stack = Arc::into_inner(stack).context("the stack is still in use")?;
    let rss = stack.stop();
    Ok(PipelineRun { rate, p50: percentile(&ms, 0.5), p99: percentile(&ms, 0.99), submit_ms, rss, reads })
}

/// The latencies of a steady rate a reviewer approves by hand.
pub struct Steady {
    /// Each submission's POST, ms, sorted.
    pub submit_ms: Vec<f64>,
    /// Submission committed to scored, ms, sorted.
    pub scored_ms: Vec<f64>,
    /// Approve answered (HTTP 200) to receipt committed, ms, sorted.
    pub approve_to_sent_ms: Vec<f64>,
    /// The reviewer's reads beside it, when asked for.
    pub reads: Option<Reads>,
    /// What the server wrote and read, per delivery, from the first submission to the
    /// last receipt.
    pub io: Io,
    /// The blocks each table and index was read for, per delivery, over the same span.
    pub touched: Touched,
}

/// What the server wrote to its WAL (the whole cluster's: nothing else runs) and what the
/// measured database read from outside its shared buffers: counters, or their growth per
/// delivery. The counters are the statistics system's, which a backend flushes at the end
/// of its transactions at most once a second, so a reading misses the last second or so.
#[derive(Debug, Clone, Copy, Default)]
pub struct Io {
    pub wal_records: f64,
    /// Full-page images: the first change of a page after a checkpoint writes it whole.
    pub wal_fpi: f64,
    pub wal_bytes: f64,
    /// Blocks read from outside shared buffers (the OS's cache or the disk).
    pub blks_read: f64,
    pub blks_hit: f64,
}

impl Io {
    pub async fn read(pool: &sqlx::PgPool) -> anyhow::Result<Io> {
        let (wal_records, wal_fpi, wal_bytes, blks_read, blks_hit) = sqlx::query_as(
            "SELECT w.wal_records::float8, w.wal_fpi::float8, w.wal_bytes::float8, d.blks_read::float8, d.blks_hit::float8
             FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        Ok(Io { wal_records, wal_fpi, wal_bytes, blks_read, blks_hit })
    }

    /// The growth since `before`, per one of `n`.
    pub fn per(self, before: Io, n: f64) -> Io {
        Io {
            wal_records: (self.wal_records - before.wal_records) / n,
            wal_fpi: (self.wal_fpi - before.wal_fpi) / n,
            wal_bytes: (self.wal_bytes - before.wal_bytes) / n,
            blks_read: (self.blks_read - before.blks_read) / n,
            blks_hit: (self.blks_hit - before.blks_hit) / n,
        }
    }
}

/// The blocks each table and each index of the measured database has been read for,
/// from shared buffers or from outside them (`pg_statio_user_tables`' heap blocks and
/// `pg_statio_user_indexes`), by `table` or `table.index`: or their growth per delivery,
/// which names where the work a delivery costs went. The same flushing as [`Io`]'s.
#[derive(Debug, Clone, Default)]
pub struct Touched(pub BTreeMap<String, f64>);

impl Touched {
    pub async fn read(pool: &sqlx::PgPool) -> anyhow::Result<Touched> {
        let rows: Vec<(String, f64)> = sqlx::query_as(
            "SELECT relname::text, (heap_blks_hit + heap_blks_read)::float8 FROM pg_statio_user_tables
             UNION ALL
             SELECT relname || '.' || indexrelname, (idx_blks_hit + idx_blks_read)::float8 FROM pg_statio_user_indexes",
        )
        .fetch_all(pool)
        .await?;
        Ok(Touched(rows.into_iter().collect()))
    }

    /// The growth since `before`, per one of `n`.
    pub fn per(self, before: &Touched, n: f64) -> Touched {
        let grown = |(k, v): (String, f64)| {
            let was = before.0.get(&k).copied().unwrap_or(0.0);
            (k, (v - was) / n)
        };
        Touched(self.0.into_iter().map(grown).collect())
    }
}

/// `rate` deliveries a second for `seconds` on `db`, switch on, no grant: each waits for
/// approval, which a reviewer gives as soon as the review list shows it (polled every
/// 20 ms); the relay answers each message after `reply_ms`. With `reads`, another
/// reviewer reads the review queue and the history's deliveries all along.
pub async fn steady(
    args: &Args,
    db: &Db,
    (rate, seconds, reply_ms): (u64, u64, u64),
    reads: bool,
) -> anyhow::Result<Steady> {
    let stack = Arc::new(Stack::start(args, db, reply_ms).await?);
    let runs = stack.runs().await?;
    let n = (rate * seconds) as usize;
    let done = Arc::new(AtomicBool::new(false));
    let reads_done = Arc::new(AtomicBool::new(false));
    let reader = if reads { Some(Reads::start(&stack, db, &reads_done).await?) } else { None };
    let reviewer = tokio::spawn(approve_all(stack.clone(), n, done.clone()));
    let io_before = Io::read(&db.pool).await?;
    let touched_before = Touched::read(&db.pool).await?;
    let prefix = format!("steady-{}-", uuid::Uuid::new_v4().simple());
    let (mut ids, mut submit_ms) = (Vec::new(), Vec::new());
    for (id, ms) in submit_paced(&stack, &runs, &prefix, rate, n).await? {
        ids.push(uuid::Uuid::parse_str(&id)?);
        submit_ms.push(ms);
    }
    let approved = match tokio::time::timeout(Duration::from_secs(600), reviewer).await {
        Ok(r) => r??,
        Err(_) => {
            done.store(true, Ordering::Relaxed);
            bail!("the reviewer did not see every delivery awaiting approval in time");
        }
    };
    wait_sent(db, &stack.agent_id, n).await?;
    let io = Io::read(&db.pool).await?.per(io_before, n as f64);
    let touched = Touched::read(&db.pool).await?.per(&touched_before, n as f64);
    reads_done.store(true, Ordering::Relaxed);
    let reads = match reader {
        Some(r) => Some(r.await??),
        None => None,
    };
    let sent: Vec<(uuid::Uuid, f64)> = sqlx::query_as(
        "SELECT r.delivery_id, extract(epoch FROM r.sent_at)::float8
         FROM unnest($1::uuid[]) AS x (id) JOIN receipts r ON r.delivery_id = x.id",
    )
    .bind(&ids)
    .fetch_all(&db.pool)
    .await?;
    let mut approve_to_sent_ms: Vec<f64> =
        sent.iter().map(|(id, at)| (at - approved[&id.to_string()]) * 1000.0).collect();
    let mut scored_ms: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM e.at - d.created_at)::float8 * 1000
         FROM unnest($1::uuid[]) AS x (id) JOIN deliveries d ON d.id = x.id
         JOIN delivery_events e ON e.delivery_id = d.id AND e.to_state = 'scored'",
    )
    .bind(&ids)
    .fetch_all(&db.pool)
    .await?;
    anyhow::ensure!(sent.len() == n && scored_ms.len() == n, "every steady delivery scored and sent once");
    for v in [&mut submit_ms, &mut scored_ms, &mut approve_to_sent_ms] {
        v.sort_by(f64::total_cmp);
    }
    Arc::into_inner(stack).context("the stack is still in use")?.stop();
    Ok(Steady { submit_ms, scored_ms, approve_to_sent_ms, reads, io, touched })
}

/// The reviewer: approves every delivery of the stack's agent as soon as the list of those
/// awaiting approval shows it, until `n` are approved; when each approve was answered,
/// seconds since the epoch, by delivery id.
async fn approve_all(stack: Arc<Stack>, n: usize, done: Arc<AtomicBool>) -> anyhow::Result<HashMap<String, f64>> {
    let list = format!("{}/admin/v1/deliveries?state=awaiting_approval&limit=200", stack.admin_url);
    let mut seen = HashSet::new();
    let mut approvals = tokio::task::JoinSet::new();
    let mut approved = HashMap::new();
    while seen.len() < n && !done.load(Ordering::Relaxed) {
        let (v, _) = stack.get(&list).await?;
        for d in v["items"].as_array().into_iter().flatten() {
            let id = d["id"].as_str().context("id")?.to_string();
            if d["agent"] != stack.agent_id || !seen.insert(id.clone()) {
                continue;
            }
            let (stack, sha) = (stack.clone(), d["artifact_sha256"].clone());
            approvals.spawn(async move {
                let url = format!("{}/admin/v1/deliveries/{id}/approve", stack.admin_url);
                stack.post(url, &stack.reviewer, json!({"artifact_sha256": sha, "note": "read it through"})).await?;
                let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
                anyhow::Ok((id, at))
            });
        }
        while let Some(r) = approvals.try_join_next() {
            let (id, at) = r??;
            approved.insert(id, at);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while let Some(r) = approvals.join_next().await {
        let (id, at) = r??;
        approved.insert(id, at);
    }
    Ok(approved)
}
