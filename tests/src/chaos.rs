//! The chaos run behind `scripts/chaos`: many deliveries through real `airlock-worker`
//! processes while everything around them fails, then a check of every promise.
//!
//! A run, on a throwaway Postgres cluster of its own:
//! 1. creates a fresh database, an agent, an operator, standing grants that approve every
//!    delivery of the run, and turns the send switch on;
//! 2. starts an SMTP server (STARTTLS, test CA) that drops connections at every phase and
//!    refuses at random (`SmtpServer::set_random_faults`), and a webhook receiver;
//! 3. starts `workers` real worker processes and submits `deliveries` deliveries (half
//!    email, half webhook) through the pipeline, retrying a submission the database failed
//!    (submission is idempotent per run and step);
//! 4. meanwhile SIGKILLs a random worker every few hundred milliseconds and starts a new
//!    one in its place, and restarts Postgres once (`pg_ctl restart -m fast`) when about
//!    40% of the deliveries have settled: running workers must reconnect by themselves;
//! 5. once every delivery has settled (or the chaos time is up), stops the chaos, lets the
//!    rest settle, stops the workers, and checks [`crate::invariants`] plus its own rules:
//!    one delivery per submission, no worker exit it did not cause.
//!
//! The summary table goes to stdout; [`run`] returns it with the violations.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::harness::Rng;
use airlock_core::config::Config;
use airlock_core::principals::{self, Principal, Role};
use airlock_delivery::artifact::Artifact;
use airlock_delivery::grants::{self, NewGrant};
use airlock_delivery::pipeline::{self, Submission};
use anyhow::Context as _;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::app::{WEBHOOK_SECRET, WEBHOOK_SECRET_ENV};
use crate::invariants;
use crate::smtp::{SmtpOptions, SmtpServer, TestCa};
use crate::webhook::WebhookReceiver;

/// How a chaos run is shaped.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub deliveries: usize,
    pub workers: usize,
    pub seed: u64,
    /// A random worker is SIGKILLed every `kill_min_ms..=kill_max_ms`.
    pub kill_min_ms: u64,
    pub kill_max_ms: u64,
    /// Probability that an SMTP connection gets a fault.
    pub smtp_fault_p: f64,
    pub lease_seconds: u64,
    /// A URL of the throwaway cluster (any database); the run creates its own database.
    pub database_url: String,
    /// Shell command that restarts the cluster (`pg_ctl restart -m fast ...`); `None`
    /// skips the restart.
    pub pg_restart: Option<String>,
    /// The `airlock-worker` binary.
    pub worker_bin: PathBuf,
    /// Where worker logs go (one file per worker process).
    pub log_dir: PathBuf,
    /// The chaos stops after this long even if deliveries are still unsettled; then they
    /// get `settle_timeout` of calm to settle.
    pub max_chaos: Duration,
    pub settle_timeout: Duration,
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Summary {
    pub report: invariants::Report,
    pub emails: usize,
    pub webhooks: usize,
    pub kills: usize,
    pub worker_starts: usize,
    pub pg_restarts: usize,
    pub pg_restart_ms: u128,
    pub smtp_faults: usize,
    pub smtp_connections: usize,
    pub submit_retries: usize,
    pub elapsed: Duration,
    pub database: String,
    /// The report's violations plus the run's own.
    pub violations: Vec<String>,
}

impl Summary {
    /// The summary as a Markdown table (it goes to stdout, and into the README).
    pub fn table(&self, cfg: &ChaosConfig) -> String {
        let r = &self.report;
        let state = |s: &str| r.states.get(s).copied().unwrap_or(0);
        let split = |s: &str| {
            let of = |c: &str| r.by_channel.get(&(c.to_string(), s.to_string())).copied().unwrap_or(0);
            format!("{} ({} email, {} webhook)", state(s), of("email"), of("webhook"))
        };
        let rows: Vec<(&str, String)> = vec![
            ("deliveries", format!("{} ({} email, {} webhook)", r.deliveries, self.emails, self.webhooks)),
            ("sent", split("sent")),
            ("parked (started, outcome unknown)", split("parked")),
            ("failed", split("failed")),
            ("other states", (r.deliveries - state("sent") - state("parked") - state("failed")).to_string()),
            ("workers", format!("{} at a time, {} processes started", cfg.workers, self.worker_starts)),
            ("worker kills (SIGKILL)", self.kills.to_string()),
            ("postgres restarts (-m fast)", format!("{} ({} ms down)", self.pg_restarts, self.pg_restart_ms)),
            ("SMTP connections / faults injected", format!("{} / {}", self.smtp_connections, self.smtp_faults)),
            ("SMTP messages accepted", r.smtp_accepted.to_string()),
            (
                "webhook requests / distinct keys answered 2xx",
                format!("{} / {}", r.webhook_requests, r.webhook_effects),
            ),
            ("submissions retried after a database error", self.submit_retries.to_string()),
            ("duplicates", r.duplicates.to_string()),
            ("violations", self.violations.len().to_string()),
            ("elapsed", format!("{:.0} s", self.elapsed.as_secs_f64())),
        ];
        let mut out = String::new();
        let _ = writeln!(out, "| airlock chaos run (seed {}) | |", cfg.seed);
        let _ = writeln!(out, "| --- | --- |");
        for (k, v) in rows {
            let _ = writeln!(out, "| {k} | {v} |");
        }
        out
    }
}

/// One worker slot: the process in it, and when it started.
struct Slot {
    child: Child,
    started: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts and replaces worker processes.
struct Fleet {
    bin: PathBuf,
    env: Vec<(String, String)>,
    log_dir: PathBuf,
    started: usize,
}

impl Fleet {
    fn spawn(&mut self) -> anyhow::Result<Slot> {
        self.started += 1;
        let log = std::fs::File::create(self.log_dir.join(format!("worker-{:05}.log", self.started)))?;
        let mut cmd = Command::new(&self.bin);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", std::env::var("CHAOS_WORKER_LOG").unwrap_or_else(|_| "warn".into()))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().with_context(|| format!("starting {}", self.bin.display()))?;
        Ok(Slot { child, started: Instant::now() })
    }
}

/// Connects to `url`'s server, creates a fresh database, and returns its URL.
async fn fresh_database(url: &str) -> anyhow::Result<String> {
    let admin = PgPoolOptions::new().max_connections(1).connect(url).await.context("connecting to the cluster")?;
    let name = format!("airlock_chaos_{}", chrono::Utc::now().format("%Y%m%d_%H%M%S"));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await?;
    admin.close().await;
    let mut parsed = reqwest::Url::parse(url)?;
    parsed.set_path(&format!("/{name}"));
    Ok(parsed.to_string())
}

fn artifact(cfg: &Config, hooks: &str, run_id: Uuid, i: usize) -> anyhow::Result<Artifact> {
    let json = if i.is_multiple_of(2) {
        json!({"channel": "email", "email": {"from": "agent@example.com", "to": ["alice@example.org"], "cc": [],
               "subject": format!("Chaos order {i}"), "text": format!("Order {i} of run {run_id} has shipped."),
               "html": null}})
    } else {
        json!({"channel": "webhook", "webhook": {"url": format!("{hooks}/hooks/chaos"),
               "body": {"order": i, "run": run_id.to_string()}, "headers": {}}})
    };
    Ok(Artifact::from_json(&json, &pipeline::limits(cfg))?)
}

async fn settled_count(pool: &PgPool) -> Option<(i64, i64)> {
    sqlx::query_as(
        r#"SELECT count(*) FILTER (WHERE state IN ('sent', 'failed', 'parked', 'rejected', 'cancelled')),
                  count(*) FROM deliveries"#,
    )
    .fetch_one(pool)
    .await
    .ok()
}

/// Runs the chaos, prints progress to stderr, and returns what it found.
pub async fn run(cfg: &ChaosConfig) -> anyhow::Result<Summary> {
    airlock_core::telemetry::install_crypto_provider();
    let begun = Instant::now();
    let mut summary = Summary::default();
    std::fs::create_dir_all(&cfg.log_dir)?;

    let db_url = fresh_database(&cfg.database_url).await?;
    summary.database = db_url.clone();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(30))
        .test_before_acquire(true)
        .connect(&db_url)
        .await?;
    airlock_core::db::migrate(&pool).await?;

    let ca = Arc::new(TestCa::new()?);
    let ca_file = ca.write_ca_file(&cfg.log_dir)?;
    let smtp = SmtpServer::start(SmtpOptions::starttls(ca.clone())).await?;
    let hooks = WebhookReceiver::start().await?;
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), db_url.clone()),
        ("AIRLOCK__SMTP__HOST".into(), "127.0.0.1".into()),
        ("AIRLOCK__SMTP__PORT".into(), smtp.port().to_string()),
        ("AIRLOCK__SMTP__CA_FILE".into(), ca_file.display().to_string()),
        ("AIRLOCK__SMTP__TIMEOUT_SECONDS".into(), "10".into()),
        ("AIRLOCK__DELIVERY__SENDERS".into(), "agent@example.com".into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_ORIGINS".into(), hooks.origin()),
        ("AIRLOCK__DELIVERY__WEBHOOK_ALLOW_PLAINTEXT_LOOPBACK".into(), "true".into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_SECRET_ENV".into(), WEBHOOK_SECRET_ENV.into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_TIMEOUT_SECONDS".into(), "10".into()),
        (WEBHOOK_SECRET_ENV.into(), WEBHOOK_SECRET.into()),
        ("AIRLOCK__DELIVERY__KNOWN_DOMAINS".into(), "example.org".into()),
        ("AIRLOCK__WORKER__POLL_INTERVAL_MS".into(), "200".into()),
        ("AIRLOCK__WORKER__LEASE_SECONDS".into(), cfg.lease_seconds.to_string()),
        ("AIRLOCK__WORKER__RESCUE_INTERVAL_SECONDS".into(), "1".into()),
        ("AIRLOCK__WORKER__SHUTDOWN_GRACE_SECONDS".into(), "5".into()),
    ];
    env.extend(crate::app::hooks_endpoint_env(&hooks.origin()));
    let config = Config::from_sources(None, &env).context("the run's configuration")?;

    // Principals, grants and the switch, as an operator would set them up.
    let agent_id = "chaos-agent";
    principals::create(&pool, "chaos-agent", Role::Agent, Some(agent_id)).await?;
    let (operator, _) = principals::create(&pool, "chaos-operator", Role::Operator, None).await?;
    create_grants(&pool, &operator, agent_id, &hooks.origin(), cfg.deliveries).await?;
    pipeline::set_send_enabled(&pool, &operator, true, Some("chaos run")).await?;
    let run_row =
        airlock_runs::run::create(&pool, agent_id, agent_id, &json!({"chaos": cfg.seed}), Default::default()).await?;

    smtp.set_random_faults(cfg.smtp_fault_p, cfg.seed);
    let mut fleet = Fleet { bin: cfg.worker_bin.clone(), env, log_dir: cfg.log_dir.clone(), started: 0 };
    let mut slots: Vec<Slot> = (0..cfg.workers).map(|_| fleet.spawn()).collect::<anyhow::Result<_>>()?;

    // The producer: submissions, four at a time, each retried until it is on record.
    let submitted = Arc::new(AtomicUsize::new(0));
    let retries = Arc::new(AtomicUsize::new(0));
    let producer = {
        let (pool, config, hooks_origin) = (pool.clone(), Arc::new(config.clone()), hooks.origin());
        let waker = airlock_queue::Waker::new(pool.clone());
        let (submitted, retries, n) = (submitted.clone(), retries.clone(), cfg.deliveries);
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let (pool, config, hooks_origin, waker) =
                (pool.clone(), config.clone(), hooks_origin.clone(), waker.clone());
            let (submitted, retries, next) = (submitted.clone(), retries.clone(), next.clone());
            tasks.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        return Ok::<(), anyhow::Error>(());
                    }
                    let artifact = artifact(&config, &hooks_origin, run_row.id.uuid(), i)?;
                    let mut tries = 0;
                    loop {
                        let s =
                            Submission { run_id: run_row.id, step_id: format!("step-{i}"), artifact: artifact.clone() };
                        match pipeline::submit(&pool, &config, &waker, agent_id, s).await {
                            Ok(_) => break,
                            Err(e) if tries < 600 => {
                                tries += 1;
                                retries.fetch_add(1, Ordering::SeqCst);
                                tracing::debug!(error = %e, "submission failed; retrying");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            Err(e) => return Err(e).context(format!("submitting delivery {i}")),
                        }
                    }
                    submitted.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        tokio::spawn(async move {
            while let Some(r) = tasks.join_next().await {
                r??;
            }
            Ok::<(), anyhow::Error>(())
        })
    };

    // The chaos: kills, the Postgres restart, progress lines.
    let mut rng = Rng(cfg.seed ^ 0x5EED);
    let mut next_kill = Instant::now() + Duration::from_millis(rng.range(cfg.kill_min_ms, cfg.kill_max_ms));
    let mut next_report = Instant::now();
    let mut restart_window: Option<(Instant, Instant)> = None;
    let restarting = Arc::new(AtomicBool::new(false));
    let mut restart_task: Option<tokio::task::JoinHandle<anyhow::Result<Duration>>> = None;
    let chaos_until = begun + cfg.max_chaos;
    let mut violations: Vec<String> = Vec::new();
    let mut counts: Option<(i64, i64)> = None;
    let mut next_count = Instant::now();
    loop {
        let done_submitting = submitted.load(Ordering::SeqCst) >= cfg.deliveries;
        if Instant::now() >= next_count {
            counts = settled_count(&pool).await;
            next_count = Instant::now() + Duration::from_millis(500);
        }
        if let Some((settled, total)) = counts {
            if done_submitting && settled == total && total as usize == cfg.deliveries {
                break;
            }
            let restart_due = cfg.pg_restart.is_some() && summary.pg_restarts == 0 && restart_task.is_none();
            if restart_due && settled as f64 >= 0.4 * cfg.deliveries as f64 {
                let cmd = cfg.pg_restart.clone().unwrap_or_default();
                restarting.store(true, Ordering::SeqCst);
                restart_window = Some((Instant::now(), Instant::now() + Duration::from_secs(3600)));
                eprintln!("chaos: restarting postgres ({settled}/{total} settled)");
                restart_task = Some(tokio::task::spawn_blocking(move || restart_postgres(&cmd)));
            }
        }
        if let Some(task) = restart_task.take_if(|t| t.is_finished()) {
            let took = task.await??;
            summary.pg_restarts += 1;
            summary.pg_restart_ms = took.as_millis();
            restarting.store(false, Ordering::SeqCst);
            if let Some((from, _)) = restart_window {
                restart_window = Some((from, Instant::now()));
            }
            eprintln!("chaos: postgres is back after {} ms", took.as_millis());
        }
        if Instant::now() >= chaos_until {
            eprintln!("chaos: chaos time is up; letting the rest settle in calm");
            break;
        }
        // Workers that died without being killed must be startups refused while Postgres
        // was down; anything else is a violation.
        for slot in slots.iter_mut() {
            if let Some(status) = slot.child.try_wait()? {
                let near_restart = restart_window.is_some_and(|(from, to)| {
                    slot.started + Duration::from_secs(5) >= from && slot.started <= to + Duration::from_secs(5)
                });
                if !near_restart {
                    violations.push(format!("a worker exited by itself ({status}); see {}", cfg.log_dir.display()));
                }
                *slot = fleet.spawn()?;
            }
        }
        if Instant::now() >= next_kill && !restarting.load(Ordering::SeqCst) {
            let i = rng.range(0, slots.len() as u64 - 1) as usize;
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(slots[i].child.id() as i32), nix::sys::signal::SIGKILL)
                .ok();
            let _ = slots[i].child.wait();
            summary.kills += 1;
            slots[i] = fleet.spawn()?;
            next_kill = Instant::now() + Duration::from_millis(rng.range(cfg.kill_min_ms, cfg.kill_max_ms));
        }
        if Instant::now() >= next_report {
            next_report = Instant::now() + Duration::from_secs(5);
            let (settled, total) = counts.unwrap_or((-1, -1));
            eprintln!(
                "chaos: {:>4.0} s  submitted {}/{}  settled {settled}/{total}  kills {}  smtp faults {}",
                begun.elapsed().as_secs_f64(),
                submitted.load(Ordering::SeqCst),
                cfg.deliveries,
                summary.kills,
                smtp.faults_drawn().values().sum::<usize>(),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some(task) = restart_task.take() {
        let took = task.await??;
        summary.pg_restarts += 1;
        summary.pg_restart_ms = took.as_millis();
    }

    // Calm: no kills, no faults; whatever is left settles (parked sends stay parked).
    smtp.clear_random_faults();
    producer.await??;
    let calm_until = Instant::now() + cfg.settle_timeout;
    loop {
        match crate::reliability::unsettled(&pool).await {
            Ok((0, 0)) => break,
            Ok((jobs, deliveries)) if Instant::now() >= calm_until => {
                violations.push(format!(
                    "not settled after {:?} of calm: {jobs} live job(s), {deliveries} unsettled deliveries",
                    cfg.settle_timeout
                ));
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    for slot in &slots {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(slot.child.id() as i32), nix::sys::signal::SIGTERM);
    }
    for slot in slots.iter_mut() {
        let deadline = Instant::now() + Duration::from_secs(30);
        while slot.child.try_wait()?.is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        match slot.child.try_wait()? {
            Some(status) if status.success() => {}
            other => violations.push(format!("a worker did not stop cleanly on SIGTERM: {other:?}")),
        }
    }

    // The verdict.
    let report = invariants::check(&pool, &smtp.accepted(), &hooks.hits()).await?;
    let (rows, steps): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT step_id) FROM deliveries WHERE run_id = $1")
            .bind(run_row.id)
            .fetch_one(&pool)
            .await?;
    if rows != cfg.deliveries as i64 || steps != cfg.deliveries as i64 {
        violations.push(format!("{} submissions gave {rows} deliveries for {steps} steps", cfg.deliveries));
    }
    summary.emails = cfg.deliveries.div_ceil(2);
    summary.webhooks = cfg.deliveries / 2;
    summary.worker_starts = fleet.started;
    summary.smtp_faults = smtp.faults_drawn().values().sum();
    summary.smtp_connections = smtp.connections();
    summary.submit_retries = retries.load(Ordering::SeqCst);
    summary.violations = report.violations.iter().cloned().chain(violations).collect();
    summary.report = report;
    summary.elapsed = begun.elapsed();
    pool.close().await;
    Ok(summary)
}

async fn create_grants(
    pool: &PgPool,
    operator: &Principal,
    agent: &str,
    origin: &str,
    deliveries: usize,
) -> anyhow::Result<()> {
    let expires_at = chrono::Utc::now() + chrono::Duration::days(1);
    let max_uses = (deliveries as i32).clamp(1, grants::MAX_USES);
    let mut tx = pool.begin().await?;
    for (channel, domains, origins) in
        [("email", vec!["example.org".to_string()], vec![]), ("webhook", vec![], vec![origin.to_string()])]
    {
        let g = NewGrant {
            channel: channel.into(),
            agent_ids: vec![agent.into()],
            recipient_domains: domains,
            webhook_origins: origins,
            min_score: 0.0,
            expires_at,
            max_uses,
            reason: "chaos run: approve every delivery of the run".into(),
        };
        grants::create(&mut tx, operator, &g).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Runs the restart command; returns how long Postgres was away.
fn restart_postgres(cmd: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let out = Command::new("sh").arg("-c").arg(cmd).stdin(Stdio::null()).output()?;
    anyhow::ensure!(
        out.status.success(),
        "restarting postgres failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(started.elapsed())
}

/// The `airlock-worker` next to this executable, else the workspace's debug build.
pub fn worker_bin() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("airlock-worker")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| crate::harness::bin_path("airlock-worker"))
}

/// A directory for this run's logs under `base`.
pub fn log_dir(base: &Path) -> PathBuf {
    base.join(format!("chaos-{}", chrono::Utc::now().format("%Y%m%d-%H%M%S")))
}
