//! `airlock-bench`: measures the queue and the pipeline side by side with the raw ceiling
//! of the same Postgres, in one run, and writes `bench/results/<date>.json` plus a Markdown
//! table. Every figure is the median of `--reps` repetitions. Real worker, api and admin
//! processes are used (built with `--release` by `scripts/bench`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod fresh;
mod mcp;
mod peer;
mod runs;
mod sandbox;
mod service;
mod turns;
mod with_history;

use airlock_bench::history::History;
use anyhow::{Context, bail};
use clap::Parser;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmarks airlock against the raw ceiling of the same Postgres")]
struct Args {
    /// A Postgres server where databases may be created (the maintenance database URL).
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Directory with the airlock binaries (release build).
    #[arg(long, default_value = "target/release")]
    bin_dir: PathBuf,
    /// Repetitions per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Jobs in the small drain.
    #[arg(long, default_value_t = 20_000)]
    small: i64,
    /// Jobs in the large drain (0 skips it).
    #[arg(long, default_value_t = 200_000)]
    large: i64,
    /// Completed rows for the growth measurement.
    #[arg(long, default_value_t = 1_000_000)]
    growth_rows: i64,
    /// Deliveries in the end-to-end measurement.
    #[arg(long, default_value_t = 4_000)]
    deliveries: usize,
    /// Deliveries sent before the measured ones (then ANALYZE); 0 measures a new database.
    #[arg(long, default_value_t = 1_000)]
    pipeline_warmup: usize,
    /// Finished deliveries in the history the `history` part measures on top of (each
    /// with its events, score, approval, attempt and receipt).
    #[arg(long, default_value_t = History::MONTH.deliveries)]
    history_deliveries: i64,
    /// Deliveries of the history still waiting in review (page 100 of the review queue
    /// needs 5,000 at the default page size).
    #[arg(long, default_value_t = History::MONTH.in_review)]
    history_in_review: i64,
    /// Run steps in the history.
    #[arg(long, default_value_t = History::MONTH.run_steps)]
    history_run_steps: i64,
    /// Finished jobs in the history.
    #[arg(long, default_value_t = History::MONTH.jobs)]
    history_jobs: i64,
    /// The history part, for profiling the reviewer's reads: measure only them, under the
    /// saturating pipeline, on this database of the same server, which already holds a
    /// history (one kept by `--keep-history`); each repetition is printed, no result file
    /// is written, and the database is left as it is.
    #[arg(long)]
    history_db: Option<String>,
    /// With `--history-db`: also measure the reads beside the pipeline's work submitted at
    /// each of these rates (deliveries per second, for `--steady-seconds` each), before the
    /// saturating one, in every repetition: the load at which they leave their target.
    #[arg(long, value_delimiter = ',')]
    read_rates: Vec<u64>,
    /// Keep the history part's database when it ends (its name is printed), for
    /// `--history-db`.
    #[arg(long)]
    keep_history: bool,
    /// The CPU priority the service's workers start at in the pipeline, steady-rate and
    /// history measurements (`nice -n`, 0 to 19): a host running the api, the admin and
    /// Postgres beside its workers may lower theirs (see docs/operations.md).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=19))]
    worker_nice: u8,
    /// Jobs the `fresh` part keeps waiting while its workers drain them.
    #[arg(long, default_value_t = 4_000)]
    fresh_backlog: i64,
    /// Worker processes of the `fresh` part's drain (16 handlers each).
    #[arg(long, default_value_t = 2)]
    fresh_workers: usize,
    /// Seconds the `fresh` part's backlog is kept standing, on each database.
    #[arg(long, default_value_t = 90)]
    fresh_seconds: u64,
    /// Analyze `jobs` once the `fresh` part's backlog is in, before its drain starts.
    #[arg(long)]
    fresh_analyze: bool,
    /// Deliveries per second of the steady measurement, each approved by a reviewer.
    #[arg(long, default_value_t = 50)]
    steady_rate: u64,
    /// Seconds the steady measurement submits for.
    #[arg(long, default_value_t = 30)]
    steady_seconds: u64,
    /// How long the relay takes to answer each message in the steady measurement, ms.
    #[arg(long, default_value_t = 10)]
    relay_ms: u64,
    /// Where results go.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
    /// pgbench binary.
    #[arg(long, default_value = "pgbench")]
    pgbench: String,
    /// No-op sandboxed runs of each kind (unisolated, bubblewrap) in the sandbox part.
    #[arg(long, default_value_t = 300)]
    sandbox_runs: usize,
    /// Measure only these parts (ceiling, drain, enqueue, latency, growth, pipeline, runs, turns,
    /// sandbox, mcp, history, fresh, peer), for profiling; a partial run (of parts, modes or
    /// worker counts) prints its table but writes no result file, except `--only history`,
    /// `--only fresh` and `--only peer` (the ceiling and the small set's per-job drains beside
    /// graphile-worker's), which write `<date>-<part>.json`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Drain modes to measure (per_job, per_job_deleting, batched, graphile), for profiling one
    /// of them; `graphile` runs only with `--graphile-dir`.
    #[arg(long, value_delimiter = ',', default_value = "per_job,per_job_deleting,batched,graphile")]
    modes: Vec<String>,
    /// Directory with `graphile-drain.cjs` and its installed packages (`bench/peer` after
    /// `npm ci`): the `graphile` drain mode runs graphile-worker there, beside airlock's.
    #[arg(long)]
    graphile_dir: Option<PathBuf>,
    /// Node.js binary for the `graphile` drain mode.
    #[arg(long, default_value = "node")]
    node: String,
    /// Worker process counts for the drains, for profiling one of them.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<usize>,
}

impl Args {
    fn wants(&self, part: &str) -> bool {
        self.only.is_empty()
            || self.only.iter().any(|p| p == part || (p == "peer" && (part == "ceiling" || part == "drain")))
    }

    /// `--only peer`: the ceiling and the small set's per-job drains, airlock's and
    /// graphile-worker's, in each repetition.
    fn peer_only(&self) -> bool {
        self.only == ["peer"]
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A database of its own for one measurement, dropped afterwards.
struct Db {
    admin: PgPool,
    name: String,
    url: String,
    pool: PgPool,
}

impl Db {
    async fn create(args: &Args, tag: &str) -> anyhow::Result<Self> {
        let admin = PgPoolOptions::new().max_connections(2).connect(&args.database_url).await?;
        let name = format!("airlock_bench_{tag}_{}", std::process::id());
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
            .execute(&admin)
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await?;
        let db = Self::connect(args, admin, name).await?;
        airlock_core::db::migrate(&db.pool).await?;
        Ok(db)
    }

    /// An existing database of the server, left as it is.
    async fn open(args: &Args, name: &str) -> anyhow::Result<Self> {
        let admin = PgPoolOptions::new().max_connections(2).connect(&args.database_url).await?;
        Self::connect(args, admin, name.to_string()).await
    }

    /// Connects to database `name` of the server `admin` is connected to.
    async fn connect(args: &Args, admin: PgPool, name: String) -> anyhow::Result<Self> {
        let base = args.database_url.rsplit_once('/').map(|(b, _)| b).unwrap_or(&args.database_url);
        let url = format!("{base}/{name}");
        let pool = PgPoolOptions::new().max_connections(20).connect(&url).await?;
        Ok(Self { admin, name, url, pool })
    }

    async fn drop(self) -> anyhow::Result<()> {
        self.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)))
            .execute(&self.admin)
            .await?;
        Ok(())
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The highest peak resident memory of `procs`, MiB.
fn peak_rss_mib(procs: &[Proc]) -> f64 {
    procs.iter().map(Proc::peak_rss_mib).fold(0.0, f64::max)
}

impl Proc {
    fn pid(&self) -> u32 {
        self.0.id()
    }
    /// Peak resident memory so far (VmHWM), MiB.
    fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    }
    fn stop(mut self) {
        self.terminate();
    }
    /// CPU time the process has used so far (user and system), seconds.
    fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        // Fields after the command's closing parenthesis; utime and stime are the 12th and
        // 13th of them, in clock ticks (100 a second on Linux).
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let ticks: f64 = rest.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<f64>().ok()).sum();
        if rest.is_empty() { f64::NAN } else { ticks / 100.0 }
    }
    /// Sends SIGTERM and waits up to 30 s for the process to exit.
    fn terminate(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn spawn(bin_dir: &Path, name: &str, args: &[&str], env: &[(&str, String)]) -> anyhow::Result<Proc> {
    spawn_niced(bin_dir, name, args, env, 0)
}

/// [`spawn`], at CPU priority `nice` (through `nice -n`, when above 0).
fn spawn_niced(bin_dir: &Path, name: &str, args: &[&str], env: &[(&str, String)], nice: u8) -> anyhow::Result<Proc> {
    let path = bin_dir.join(name);
    if !path.exists() {
        bail!("{} is missing: build with `cargo build --release --workspace --bins`", path.display());
    }
    let mut cmd = if nice > 0 {
        let mut cmd = Command::new("nice");
        cmd.arg("-n").arg(nice.to_string()).arg(&path);
        cmd
    } else {
        Command::new(&path)
    };
    cmd.args(args).env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(Proc(cmd.spawn().with_context(|| format!("spawning {name}"))?))
}

/// Inserts `n` no-op jobs in batches.
async fn fill(pool: &PgPool, n: i64) -> anyhow::Result<()> {
    let mut left = n;
    while left > 0 {
        let k = left.min(5000);
        let jobs: Vec<airlock_queue::NewJob> =
            (0..k).map(|_| airlock_queue::NewJob::new("diag.sleep", json!({"ms": 0})).queue("bench")).collect();
        let mut tx = pool.begin().await?;
        airlock_queue::enqueue_many(&mut tx, &jobs).await?;
        tx.commit().await?;
        left -= k;
    }
    Ok(())
}

async fn count(pool: &PgPool, sql: &'static str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

async fn wait_until(pool: &PgPool, sql: &'static str, want: i64, limit: Duration) -> anyhow::Result<()> {
    wait_every(pool, sql, want, limit, Duration::from_millis(20)).await
}

/// [`wait_until`], polling every `every`: a measured run is timed on the database's clock
/// (its first and last rows), so its end is polled rarely, and the bench's own queries
/// take next to nothing from what it measures.
async fn wait_every(
    pool: &PgPool,
    sql: &'static str,
    want: i64,
    limit: Duration,
    every: Duration,
) -> anyhow::Result<()> {
    let start = Instant::now();
    while count(pool, sql).await? < want {
        if start.elapsed() > limit {
            bail!("timed out waiting for {want} ({sql})");
        }
        tokio::time::sleep(every).await;
    }
    Ok(())
}

/// The database's clock now, in seconds since the epoch.
async fn db_clock(pool: &PgPool) -> anyhow::Result<f64> {
    Ok(sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8").fetch_one(pool).await?)
}

/// How often a measured run's end is polled.
const MEASURED_POLL: Duration = Duration::from_millis(250);

/// How often a drain whose completions delete their rows is polled: the poll dates its end.
const DELETING_POLL: Duration = Duration::from_millis(5);

/// How a drain's workers claim and complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One job per claim and per completion, completed rows kept.
    PerJob,
    /// As `PerJob`, with `retention.delete_completed_jobs`: a completion deletes the row.
    PerJobDeleting,
    /// 100 jobs per claim and per completion.
    Batched,
    /// graphile-worker's processes instead of airlock's, one job per claim ([`peer`]).
    Graphile,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::PerJob, Mode::PerJobDeleting, Mode::Batched, Mode::Graphile];

    fn name(self) -> &'static str {
        match self {
            Mode::PerJob => "per_job",
            Mode::PerJobDeleting => "per_job_deleting",
            Mode::Batched => "batched",
            Mode::Graphile => "graphile",
        }
    }
}

/// Drains `n` pre-enqueued jobs with `workers` processes; returns (jobs/s, peak RSS MiB).
async fn drain(args: &Args, n: i64, workers: usize, mode: Mode, completed_rows: i64) -> anyhow::Result<(f64, f64)> {
    let db = Db::create(args, "drain").await?;
    if completed_rows > 0 {
        sqlx::query(
            r#"INSERT INTO jobs (id, kind, queue, payload, state, attempt, max_attempts, finished_at, created_at)
               SELECT gen_random_uuid(), 'diag.sleep', 'bench', '{}', 'completed', 1, 1, now(), now()
               FROM generate_series(1, $1)"#,
        )
        .bind(completed_rows)
        .execute(&db.pool)
        .await?;
        sqlx::query("VACUUM ANALYZE jobs").execute(&db.pool).await?;
        // Written out before the jobs to drain are enqueued: left to a checkpoint during the
        // drain, flushing a million rows stalled every commit for over a second at a time.
        // Only here: right after a checkpoint the first change of every page writes the
        // whole page to the WAL, so one just before any drain would bill it for its set-up.
        sqlx::query("CHECKPOINT").execute(&db.pool).await?;
    }
    let figures = drain_on(args, &db, n, workers, mode).await?;
    db.drop().await?;
    Ok(figures)
}

/// The environment of a worker process draining the bench's no-op jobs on `db`:
/// `concurrency` handlers, `batch` jobs per claim and per completion, completed jobs kept
/// (or, `deleting`, deleted by their completion).
fn drain_env(db: &Db, concurrency: usize, batch: usize, deleting: bool) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", db.url.clone()),
        ("AIRLOCK__WORKER__DIAGNOSTIC_JOBS", "true".into()),
        ("AIRLOCK__WORKER__CONCURRENCY", concurrency.to_string()),
        ("AIRLOCK__WORKER__CLAIM_BATCH", batch.to_string()),
        ("AIRLOCK__WORKER__COMPLETE_BATCH", batch.to_string()),
        ("AIRLOCK__WORKER__QUEUES", "bench".into()),
        ("AIRLOCK__RETENTION__COMPLETED_JOBS_HOURS", "0".into()),
        ("AIRLOCK__RETENTION__DELETE_COMPLETED_JOBS", deleting.to_string()),
        ("AIRLOCK__DATABASE__MAX_CONNECTIONS", "16".into()),
    ]
}

/// 1 once nothing is left to claim and nothing is held, read through the partial indexes
/// (a count of completed rows would scan the growing table).
const DRAINED: &str = "SELECT CASE WHEN EXISTS (SELECT 1 FROM jobs WHERE state = 'available')
                              OR EXISTS (SELECT 1 FROM jobs WHERE lease_owner IS NOT NULL) THEN 0 ELSE 1 END::bigint";

/// [`drain`] on `db`, which may already hold anything (a history).
async fn drain_on(args: &Args, db: &Db, n: i64, workers: usize, mode: Mode) -> anyhow::Result<(f64, f64)> {
    fill(&db.pool, n).await?;
    sqlx::query("ANALYZE jobs").execute(&db.pool).await?;
    airlock_queue::pause_queue(&db.pool, "bench", "bench start").await?;
    let deleting = mode == Mode::PerJobDeleting;
    let env = drain_env(db, 10, if mode == Mode::Batched { 100 } else { 1 }, deleting);
    let procs: Vec<Proc> =
        (0..workers).map(|_| spawn(&args.bin_dir, "airlock-worker", &[], &env)).collect::<anyhow::Result<_>>()?;
    wait_until(
        &db.pool,
        "SELECT count(*) FROM workers WHERE stopped_at IS NULL",
        workers as i64,
        Duration::from_secs(60),
    )
    .await?;
    let before = count(&db.pool, "SELECT count(*) FROM jobs WHERE state = 'completed'").await?;
    let start = db_clock(&db.pool).await?;
    airlock_queue::resume_queue(&db.pool, "bench").await?;
    // Poll what is left through the partial indexes (a count of completed rows would scan
    // the growing table and slow the very drain it measures), then check nothing was lost.
    // The drain ends when its last job was completed, on the database's clock.
    let poll = if deleting { DELETING_POLL } else { MEASURED_POLL };
    wait_every(&db.pool, DRAINED, 1, Duration::from_secs(1800), poll).await?;
    let end = if deleting {
        // A completion leaves no row to date it: the end is when the poll, every few
        // milliseconds, first finds nothing left, and nothing is lost when no job of the
        // drain is left at all (a failed one would stay, and nothing else deletes them).
        let end = db_clock(&db.pool).await?;
        let left = count(&db.pool, "SELECT count(*) FROM jobs WHERE queue = 'bench'").await?;
        if left != 0 {
            bail!("drain lost jobs: {left} of the drain's jobs left, none expected");
        }
        end
    } else {
        let (after, end): (i64, f64) = sqlx::query_as(
            "SELECT count(*), extract(epoch FROM max(finished_at))::float8 FROM jobs WHERE state = 'completed'",
        )
        .fetch_one(&db.pool)
        .await?;
        if after != before + n {
            bail!("drain lost jobs: {} completed, {} expected", after - before, n);
        }
        end
    };
    let rate = n as f64 / (end - start);
    let rss = peak_rss_mib(&procs);
    let cpu: f64 = procs.iter().map(Proc::cpu_seconds).sum();
    eprintln!("    workers' CPU: {:.0} µs a job (start-up included)", cpu * 1e6 / n as f64);
    for p in procs {
        p.stop();
    }
    Ok((rate, rss))
}

/// Enqueue throughput: one job per transaction, and 1000 per statement.
async fn enqueue_rates(args: &Args) -> anyhow::Result<(f64, f64)> {
    let db = Db::create(args, "enqueue").await?;
    let single_n = 3000;
    let start = Instant::now();
    // Ten concurrent producers, one job per transaction, as agents submit.
    let mut handles = Vec::new();
    for _ in 0..10 {
        let pool = db.pool.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..single_n / 10 {
                let mut tx = pool.begin().await?;
                airlock_queue::enqueue(&mut tx, &airlock_queue::NewJob::new("diag.sleep", json!({})).queue("x"))
                    .await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for h in handles {
        h.await??;
    }
    let single = single_n as f64 / start.elapsed().as_secs_f64();
    let batch_n = 100_000;
    let start = Instant::now();
    fill(&db.pool, batch_n).await?;
    let batched = batch_n as f64 / start.elapsed().as_secs_f64();
    db.drop().await?;
    Ok((single, batched))
}

/// Enqueue-to-start latency at a steady rate with idle workers (ms: p50, p99, max).
async fn latency(args: &Args, rate: u64, seconds: u64) -> anyhow::Result<(f64, f64, f64)> {
    let db = Db::create(args, "latency").await?;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("AIRLOCK__WORKER__DIAGNOSTIC_JOBS", "true".into()),
        ("AIRLOCK__WORKER__CONCURRENCY", "10".into()),
        ("AIRLOCK__WORKER__QUEUES", "bench".into()),
    ];
    let worker = spawn(&args.bin_dir, "airlock-worker", &[], &env)?;
    wait_until(&db.pool, "SELECT count(*) FROM workers WHERE stopped_at IS NULL", 1, Duration::from_secs(60)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let total = rate * seconds;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    for _ in 0..total {
        tick.tick().await;
        let mut tx = db.pool.begin().await?;
        airlock_queue::enqueue(&mut tx, &airlock_queue::NewJob::new("diag.sleep", json!({"ms": 0})).queue("bench"))
            .await?;
        tx.commit().await?;
    }
    wait_until(&db.pool, "SELECT count(*) FROM jobs WHERE state = 'completed'", total as i64, Duration::from_secs(120))
        .await?;
    // Both ends on the database clock: enqueue commit (created_at) to claim (attempted_at).
    let mut ms: Vec<f64> =
        sqlx::query_scalar("SELECT extract(epoch FROM attempted_at - created_at)::float8 * 1000 FROM jobs")
            .fetch_all(&db.pool)
            .await?;
    ms.sort_by(f64::total_cmp);
    worker.stop();
    db.drop().await?;
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99), ms.last().copied().unwrap_or(f64::NAN)))
}

/// The raw ceiling: pgbench claiming and completing 1 or 100 rows per transaction with
/// SKIP LOCKED at 10 clients, on the same server.
async fn ceiling(args: &Args, per_tx: i64) -> anyhow::Result<f64> {
    let db = Db::create(args, "ceiling").await?;
    sqlx::query(
        "CREATE TABLE pgq (id bigserial PRIMARY KEY, state text NOT NULL, payload jsonb NOT NULL DEFAULT '{}')",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query("CREATE INDEX pgq_avail ON pgq (id) WHERE state = 'available'").execute(&db.pool).await?;
    let rows = if per_tx == 1 { 200_000 } else { 2_000_000 };
    sqlx::query("INSERT INTO pgq (state) SELECT 'available' FROM generate_series(1, $1)")
        .bind(rows)
        .execute(&db.pool)
        .await?;
    sqlx::query("VACUUM ANALYZE pgq").execute(&db.pool).await?;
    let script = std::env::temp_dir().join(format!("airlock-bench-{per_tx}.sql"));
    std::fs::write(
        &script,
        format!(
            "UPDATE pgq SET state = 'done' WHERE id IN (SELECT id FROM pgq WHERE state = 'available' ORDER BY id LIMIT {per_tx} FOR UPDATE SKIP LOCKED);\n"
        ),
    )?;
    let out = Command::new(&args.pgbench)
        .args(["-n", "-c", "10", "-j", "2", "-T", "10", "-f"])
        .arg(&script)
        .arg(&db.url)
        .output()
        .context("running pgbench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse::<f64>().ok())
        .with_context(|| format!("pgbench output: {text} {}", String::from_utf8_lossy(&out.stderr)))?;
    db.drop().await?;
    Ok(tps * per_tx as f64)
}

/// Records figure `k`. Ratios keep three decimals, cut rather than rounded, so one just
/// under a target never shows as reaching it (0.29989 is 0.299, not 0.300).
fn put(m: &mut serde_json::Map<String, Value>, k: &str, v: f64) {
    let v = if k.contains("ratio") { (v * 1000.0).floor() / 1000.0 } else { (v * 100.0).round() / 100.0 };
    m.insert(k.to_string(), json!(v));
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    airlock_core::telemetry::install_crypto_provider();
    let args = Args::parse();
    if args.history_db.is_some() && args.only != ["history"] {
        bail!("--history-db measures the history part alone: give --only history");
    }
    if !args.read_rates.is_empty() && args.history_db.is_none() {
        bail!("--read-rates measures the reads on a kept history: give --history-db");
    }
    if args.read_rates.contains(&0) {
        bail!("--read-rates: every rate is at least 1 delivery a second");
    }
    if args.peer_only() && args.graphile_dir.is_none() {
        bail!("--only peer runs graphile-worker: give --graphile-dir (scripts/bench installs it in bench/peer)");
    }
    let r = args.reps.max(1);
    let mut results = serde_json::Map::new();
    let mut rss_seen: f64 = 0.0;
    let server = PgPoolOptions::new().max_connections(1).connect(&args.database_url).await?;
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum").fetch_one(&server).await?;
    if autovacuum != "on" {
        eprintln!(
            "bench: this server runs with autovacuum = {autovacuum}: a database used for more than one \
             measurement (the history's) keeps every dead row version of the earlier ones, and its figures carry them"
        );
    }

    // The machine's speed drifts over minutes (a shared host), so the ceiling is measured
    // again next to each repetition of the drains, and each ratio is taken within its
    // repetition: a drain is only ever compared with the ceiling measured beside it.
    let sets: Vec<(&str, i64)> =
        [("small", args.small), ("large", args.large)].into_iter().filter(|s| s.1 > 0).collect();
    let (mut c1s, mut c100s) = (Vec::new(), Vec::new());
    let mut drains: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let (mut per_jobs, mut batcheds, mut per_job_ratios, mut batched_ratios) = (vec![], vec![], vec![], vec![]);
    let (mut deletings, mut deleting_ratios) = (vec![], vec![]);
    let (mut graphiles, mut graphile_ratios, mut to_graphile) = (vec![], vec![], vec![]);
    for i in 0..r {
        let (mut c1, mut c100) = (f64::NAN, f64::NAN);
        if args.wants("ceiling") {
            eprintln!("repetition {}: ceiling (pgbench, 10 clients, SKIP LOCKED)", i + 1);
            c1 = ceiling(&args, 1).await?;
            c100 = ceiling(&args, 100).await?;
            eprintln!("  claim1 {c1:.1} jobs/s, claim100 {c100:.1} jobs/s");
            c1s.push(c1);
            c100s.push(c100);
        }
        if !args.wants("drain") {
            continue;
        }
        let (mut per_job, mut deleting, mut batched, mut graphile) = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
        for (label, n) in &sets {
            if args.peer_only() && *label == "large" {
                continue;
            }
            for &workers in &args.workers {
                // Every other repetition measures the modes in the reverse order, so that a
                // drift of the machine's speed over a repetition favours none of them.
                let mut modes = Mode::ALL;
                if i % 2 == 1 {
                    modes.reverse();
                }
                for mode in modes {
                    let name = mode.name();
                    if !args.modes.iter().any(|m| m == name) || (args.peer_only() && mode == Mode::Batched) {
                        continue;
                    }
                    if mode == Mode::Graphile {
                        let Some(dir) = &args.graphile_dir else { continue };
                        let rate = peer::drain(&args, dir, *n, workers).await?;
                        eprintln!(
                            "  repetition {}: drain {n} jobs, {workers} worker(s), {name}: {rate:.0} jobs/s",
                            i + 1
                        );
                        drains.entry(format!("drain_{label}_{workers}w_{name}_jobs_per_sec")).or_default().push(rate);
                        graphile = graphile.max(rate);
                        continue;
                    }
                    let (rate, rss) = drain(&args, *n, workers, mode, 0).await?;
                    eprintln!(
                        "  repetition {}: drain {n} jobs, {workers} worker(s), {name}: {rate:.0} jobs/s, peak RSS {rss:.1} MiB",
                        i + 1
                    );
                    rss_seen = rss_seen.max(rss);
                    drains.entry(format!("drain_{label}_{workers}w_{name}_jobs_per_sec")).or_default().push(rate);
                    let best = match mode {
                        Mode::PerJob => &mut per_job,
                        Mode::PerJobDeleting => &mut deleting,
                        Mode::Batched => &mut batched,
                        Mode::Graphile => unreachable!("measured above"),
                    };
                    *best = best.max(rate);
                }
            }
        }
        per_jobs.push(per_job);
        deletings.push(deleting);
        batcheds.push(batched);
        per_job_ratios.push(per_job / c1);
        deleting_ratios.push(deleting / c1);
        batched_ratios.push(batched / c100);
        if !graphile.is_nan() {
            graphiles.push(graphile);
            graphile_ratios.push(graphile / c1);
            to_graphile.push(per_job / graphile);
        }
    }
    if !c1s.is_empty() {
        put(&mut results, "ceiling_claim1_jobs_per_sec", median(c1s));
        put(&mut results, "ceiling_claim100_jobs_per_sec", median(c100s));
    }
    for (k, rates) in drains {
        put(&mut results, &k, median(rates));
    }
    // Medians over the repetitions of each repetition's best (any set, any worker count).
    if args.wants("drain") {
        put(&mut results, "drain_jobs_per_sec", median(per_jobs));
        put(&mut results, "batched_drain_jobs_per_sec", median(batcheds));
        put(&mut results, "drain_ratio_to_ceiling", median(per_job_ratios));
        put(&mut results, "drain_deleting_jobs_per_sec", median(deletings));
        put(&mut results, "drain_deleting_ratio_to_ceiling", median(deleting_ratios));
        put(&mut results, "batched_drain_ratio_to_ceiling", median(batched_ratios));
        if !graphiles.is_empty() {
            put(&mut results, "graphile_drain_jobs_per_sec", median(graphiles));
            put(&mut results, "graphile_drain_ratio_to_ceiling", median(graphile_ratios));
            put(&mut results, "drain_ratio_to_graphile", median(to_graphile));
        }
    }

    if args.wants("enqueue") {
        eprintln!("enqueue throughput");
        let mut singles = Vec::new();
        let mut batches = Vec::new();
        for _ in 0..r {
            let (s, b) = enqueue_rates(&args).await?;
            eprintln!("  single {s:.0}/s, batched {b:.0}/s");
            singles.push(s);
            batches.push(b);
        }
        put(&mut results, "enqueue_single_jobs_per_sec", median(singles));
        put(&mut results, "enqueue_batched_jobs_per_sec", median(batches));
    }
    if args.wants("latency") {
        eprintln!("enqueue-to-start latency at 200 jobs/s");
        let (mut p50s, mut p99s, mut maxes) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..r {
            let (p50, p99, max) = latency(&args, 200, 15).await?;
            eprintln!("  p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms");
            p50s.push(p50);
            p99s.push(p99);
            maxes.push(max);
        }
        put(&mut results, "enqueue_to_start_p50_ms", median(p50s));
        put(&mut results, "enqueue_to_start_p99_ms", median(p99s));
        put(&mut results, "enqueue_to_start_max_ms", median(maxes));
    }
    if args.wants("growth") {
        eprintln!("claim cost as the table grows");
        let mut small_rates = Vec::new();
        let mut big_rates = Vec::new();
        for _ in 0..r {
            let (a, _) = drain(&args, args.small, 1, Mode::PerJob, 10_000).await?;
            let (b, rss) = drain(&args, args.small, 1, Mode::PerJob, args.growth_rows).await?;
            rss_seen = rss_seen.max(rss);
            eprintln!("  10k completed: {a:.0}/s, {} completed: {b:.0}/s", args.growth_rows);
            small_rates.push(a);
            big_rates.push(b);
        }
        let (a, b) = (median(small_rates), median(big_rates));
        put(&mut results, "drain_with_10k_completed_jobs_per_sec", a);
        put(&mut results, "drain_with_1m_completed_jobs_per_sec", b);
        put(&mut results, "growth_ratio_1m_vs_10k", b / a);
    }
    if args.wants("pipeline") {
        eprintln!("end-to-end pipeline, {} deliveries", args.deliveries);
        let (mut rates, mut p50s, mut p99s, mut rss) = (Vec::new(), Vec::new(), Vec::new(), 0.0_f64);
        for _ in 0..r {
            let db = Db::create(&args, "pipeline").await?;
            let run = service::pipeline(&args, &db, false).await?;
            db.drop().await?;
            eprintln!(
                "  {:.0} deliveries/s, journey p50 {:.0} ms, p99 {:.0} ms, worker peak RSS {:.1} MiB",
                run.rate, run.p50, run.p99, run.rss
            );
            rates.push(run.rate);
            p50s.push(run.p50);
            p99s.push(run.p99);
            rss = rss.max(run.rss);
        }
        put(&mut results, "pipeline_deliveries_per_sec", median(rates));
        put(&mut results, "pipeline_p50_ms", median(p50s));
        put(&mut results, "pipeline_p99_ms", median(p99s));
        put(&mut results, "pipeline_worker_peak_rss_mib", rss);
        rss_seen = rss_seen.max(rss);
    }
    if args.wants("runs") {
        eprintln!("durable runs: steps recorded, {} runs at once; step latency at 200 steps/s", 16);
        let (mut rates, mut p50s, mut p99s) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..r {
            let db = Db::create(&args, "runs").await?;
            let f = runs::runs(&args, &db).await?;
            db.drop().await?;
            eprintln!("  {:.0} steps/s; step p50 {:.2} ms, p99 {:.2} ms", f.steps_per_sec, f.p50_ms, f.p99_ms);
            rates.push(f.steps_per_sec);
            p50s.push(f.p50_ms);
            p99s.push(f.p99_ms);
        }
        put(&mut results, "run_steps_per_sec", median(rates));
        put(&mut results, "run_step_p50_ms", median(p50s));
        put(&mut results, "run_step_p99_ms", median(p99s));
    }
    if args.wants("turns") {
        eprintln!(
            "agent turns against a scripted model answering at once: time per round one at a time, turns/s with {} at once",
            turns::AT_ONCE
        );
        let mut figures = Vec::new();
        for _ in 0..r {
            let f = turns::turns(&args).await?;
            eprintln!(
                "  {:.1} turns/s; round p50 {:.2} ms, p99 {:.2} ms alone; p50 {:.2} ms, p99 {:.2} ms with {} at once; worker peak RSS {:.1} MiB",
                f.turns_per_sec,
                f.round_p50_ms,
                f.round_p99_ms,
                f.round_loaded_p50_ms,
                f.round_loaded_p99_ms,
                turns::AT_ONCE,
                f.worker_rss_mib
            );
            figures.push(f);
        }
        let med = |g: fn(&turns::TurnFigures) -> f64| median(figures.iter().map(g).collect());
        put(&mut results, "turns_per_sec", med(|f| f.turns_per_sec));
        put(&mut results, "turn_round_p50_ms", med(|f| f.round_p50_ms));
        put(&mut results, "turn_round_p99_ms", med(|f| f.round_p99_ms));
        put(&mut results, "turn_round_at32_p50_ms", med(|f| f.round_loaded_p50_ms));
        put(&mut results, "turn_round_at32_p99_ms", med(|f| f.round_loaded_p99_ms));
        let rss = figures.iter().map(|f| f.worker_rss_mib).fold(0.0, f64::max);
        put(&mut results, "turn_worker_peak_rss_mib", rss);
        rss_seen = rss_seen.max(rss);
    }
    if args.wants("sandbox") {
        eprintln!("sandboxed no-op task, start to end, {} runs of each kind", args.sandbox_runs);
        let dir = std::env::temp_dir().join(format!("airlock-bench-sandbox-{}", uuid::Uuid::new_v4()));
        let (plain, boxed) = sandbox::measure(args.sandbox_runs.max(1), &dir).await?;
        eprintln!(
            "  unisolated p50 {:.1} ms, p99 {:.1} ms; bubblewrap p50 {:.1} ms, p99 {:.1} ms",
            plain.p(0.5),
            plain.p(0.99),
            boxed.p(0.5),
            boxed.p(0.99)
        );
        put(&mut results, "sandbox_noop_unisolated_p50_ms", plain.p(0.5));
        put(&mut results, "sandbox_noop_unisolated_p99_ms", plain.p(0.99));
        put(&mut results, "sandbox_noop_bubblewrap_p50_ms", boxed.p(0.5));
        put(&mut results, "sandbox_noop_bubblewrap_p99_ms", boxed.p(0.99));
        put(&mut results, "sandbox_isolation_added_p99_ms", boxed.p(0.99) - plain.p(0.99));
    }
    if args.wants("mcp") {
        eprintln!(
            "get_delivery over MCP (/mcp, tools/call) and over HTTP (GET /v1/deliveries/{{id}}), alternating, one at a time"
        );
        let mut figures = Vec::new();
        for _ in 0..r {
            let f = mcp::mcp(&args).await?;
            eprintln!(
                "  HTTP p50 {:.2} ms, p99 {:.2} ms; MCP p50 {:.2} ms, p99 {:.2} ms; MCP p99 / HTTP p99 {:.2}",
                f.http_p50_ms,
                f.http_p99_ms,
                f.mcp_p50_ms,
                f.mcp_p99_ms,
                f.mcp_p99_ms / f.http_p99_ms
            );
            figures.push(f);
        }
        let med = |g: fn(&mcp::McpFigures) -> f64| median(figures.iter().map(g).collect());
        put(&mut results, "get_delivery_http_p50_ms", med(|f| f.http_p50_ms));
        put(&mut results, "get_delivery_http_p99_ms", med(|f| f.http_p99_ms));
        put(&mut results, "get_delivery_mcp_p50_ms", med(|f| f.mcp_p50_ms));
        put(&mut results, "get_delivery_mcp_p99_ms", med(|f| f.mcp_p99_ms));
        put(&mut results, "get_delivery_mcp_p99_ratio_to_http", med(|f| f.mcp_p99_ms / f.http_p99_ms));
    }
    let mut history_plans = String::new();
    if args.wants("history") {
        history_plans = with_history::measure(&args, r, &mut results).await?;
        println!("{history_plans}");
    }
    if args.wants("fresh") {
        fresh::measure(&args, r, &mut results).await?;
    }
    if rss_seen > 0.0 {
        put(&mut results, "worker_peak_rss_mib", rss_seen);
    }

    let machine = json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "postgres": sqlx::query_scalar::<_, String>("SHOW server_version").fetch_one(&server).await?,
        "autovacuum": autovacuum,
        "reps": r,
        "worker_nice": args.worker_nice,
    });
    // One of the parts that keep a result file of their own.
    let own_file = match args.only.as_slice() {
        [part] if part == "history" || part == "fresh" || part == "peer" => Some(part.as_str()),
        _ => None,
    };
    let partial = (!args.only.is_empty() && own_file.is_none())
        || args.modes.len() < Mode::ALL.len()
        || args.workers != [1, 2]
        || args.history_db.is_some();
    if partial {
        let mut table = String::new();
        for (k, v) in &results {
            table.push_str(&format!("{k} = {v}\n"));
        }
        println!("{table}");
        eprintln!("partial run: no result file written");
        return Ok(());
    }
    let date = chrono::Utc::now().format("%Y-%m-%d").to_string();
    let mut doc = Value::Object(results.clone());
    doc["date"] = json!(date);
    doc["machine"] = machine;
    std::fs::create_dir_all(&args.out_dir)?;
    let name = own_file.map_or(date.clone(), |part| format!("{date}-{part}"));
    let path = args.out_dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    let mut table = String::from("| figure | value |\n| --- | --- |\n");
    for (k, v) in &results {
        table.push_str(&format!("| `{k}` | {v} |\n"));
    }
    if !history_plans.is_empty() {
        table.push_str(&format!("\nWith the history loaded:\n\n```\n{history_plans}```\n"));
    }
    std::fs::write(args.out_dir.join(format!("{name}.md")), &table)?;
    println!("{table}");
    eprintln!("wrote {}", path.display());
    Ok(())
}
