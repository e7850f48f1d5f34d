//! The per-job drain of graphile-worker, the nearest peer among Postgres job queues, on the
//! same server and in the same repetition as airlock's: its own worker processes (Node.js,
//! `bench/peer/graphile-drain.cjs`, the version `bench/peer/package-lock.json` pins, its
//! defaults but for the slots), the same no-op jobs, the same count, the same clock.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::{Args, DELETING_POLL, Db, Proc, count, db_clock, wait_every};

/// Slots per worker process, as airlock's drain runs 10 handlers per worker.
const SLOTS: usize = 10;

/// How long the processes may take to start before the drain starts without the rest.
const START_LIMIT: Duration = Duration::from_secs(30);

/// Claims waiting on the bench's lock of graphile-worker's jobs table.
const WAITING: &str = "SELECT count(*) FROM pg_stat_activity
                       WHERE datname = current_database() AND wait_event_type = 'Lock'";

/// 1 once graphile-worker's jobs table is empty: it deletes a job when it completes it, and
/// keeps a failed one for its retry.
const EMPTY: &str = "SELECT (NOT EXISTS (SELECT 1 FROM graphile_worker._private_jobs))::int::bigint";

/// What one worker process printed as it stopped.
#[derive(serde::Deserialize)]
struct Ran {
    ran: i64,
    twice: i64,
}

fn node(args: &Args, dir: &Path, db: &Db, mode: &str) -> Command {
    let mut cmd = Command::new(&args.node);
    cmd.current_dir(dir).arg("graphile-drain.cjs").arg(mode).env("DATABASE_URL", &db.url).stdin(Stdio::null());
    cmd
}

/// graphile-worker draining `n` jobs with `workers` processes of [`SLOTS`] slots; returns
/// jobs/s. Its jobs are enqueued and analyzed first; the bench then holds its jobs table
/// locked while the processes start, so that every slot's first claim waits for the same
/// moment (the lock's release, dated on the database's clock, as airlock's queue is
/// resumed), and the end is when a poll every few milliseconds first finds the table empty.
/// Fails unless every job ran exactly once.
pub async fn drain(args: &Args, dir: &Path, n: i64, workers: usize) -> anyhow::Result<f64> {
    let db = Db::create(args, "graphile").await?;
    let status = node(args, dir, &db, "setup").env("JOBS", n.to_string()).status().context("running node")?;
    if !status.success() {
        bail!("graphile-worker's set-up failed ({status})");
    }
    sqlx::query("ANALYZE graphile_worker._private_jobs").execute(&db.pool).await?;
    let mut hold = db.pool.begin().await?;
    sqlx::query("LOCK TABLE graphile_worker._private_jobs IN EXCLUSIVE MODE").execute(&mut *hold).await?;
    let procs: Vec<Proc> = (0..workers)
        .map(|_| {
            let mut cmd = node(args, dir, &db, "work");
            cmd.env("CONCURRENCY", SLOTS.to_string()).stdout(Stdio::piped()).stderr(Stdio::inherit());
            Ok(Proc(cmd.spawn().context("spawning graphile-worker")?))
        })
        .collect::<anyhow::Result<_>>()?;
    let begun = Instant::now();
    let want = (workers * SLOTS) as i64;
    let mut waiting = 0;
    while begun.elapsed() < START_LIMIT {
        waiting = count(&db.pool, WAITING).await?;
        if waiting >= want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if waiting < want {
        eprintln!("  graphile-worker: {waiting} of {want} slots waiting to claim after {START_LIMIT:?}; starting");
    }
    let start = db_clock(&db.pool).await?;
    hold.commit().await?;
    wait_every(&db.pool, EMPTY, 1, Duration::from_secs(1800), DELETING_POLL).await?;
    let end = db_clock(&db.pool).await?;
    let cpu: f64 = procs.iter().map(Proc::cpu_seconds).sum();
    eprintln!("    graphile-worker's CPU: {:.0} µs a job (start-up included)", cpu * 1e6 / n as f64);
    let (mut ran, mut twice) = (0, 0);
    for mut p in procs {
        p.terminate();
        let mut out = String::new();
        p.0.stdout.take().context("graphile-worker's output")?.read_to_string(&mut out)?;
        let r: Ran = serde_json::from_str(out.trim()).with_context(|| format!("graphile-worker printed {out:?}"))?;
        ran += r.ran;
        twice += r.twice;
    }
    if ran != n || twice != 0 {
        bail!("graphile-worker ran {ran} jobs ({twice} twice), {n} expected once each");
    }
    db.drop().await?;
    Ok(n as f64 / (end - start))
}
