//! The `fresh` part: a new installation against a warm one. A standing backlog drained on
//! a database just migrated (never vacuumed, never analyzed: a new installation's first
//! minutes, autovacuum left to find it as it would), then the same on that database once
//! vacuumed and analyzed; and the pipeline with no warm-up against the pipeline after one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Map, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::{Args, DRAINED, Db, Proc, count, db_clock, drain_env, fill, median, put, service, spawn, wait_until};

/// Seconds of each window the drain's rate is reported over.
const WINDOW: f64 = 10.0;

/// A standing backlog's drain: completed jobs per second over the whole, and per window.
pub struct Standing {
    pub rate: f64,
    pub windows: Vec<f64>,
}

/// Keeps `args.fresh_backlog` jobs available on `db` for `args.fresh_seconds` while
/// `args.fresh_workers` worker processes (16 handlers each, claiming one job at a time)
/// drain them (after `ANALYZE jobs` with `args.fresh_analyze`, which tells the table's
/// statistics apart from the rest); checks that every job enqueued was completed once.
async fn standing(args: &Args, db: &Db) -> anyhow::Result<Standing> {
    let env = drain_env(db, 16, 1, false);
    let before = count(&db.pool, "SELECT count(*) FROM jobs WHERE state = 'completed'").await?;
    let backlog = args.fresh_backlog;
    fill(&db.pool, backlog).await?;
    if args.fresh_analyze {
        sqlx::query("ANALYZE jobs").execute(&db.pool).await?;
    }
    let procs: Vec<Proc> = (0..args.fresh_workers)
        .map(|_| spawn(&args.bin_dir, "airlock-worker", &[], &env))
        .collect::<anyhow::Result<_>>()?;
    wait_until(
        &db.pool,
        "SELECT count(*) FROM workers WHERE stopped_at IS NULL",
        procs.len() as i64,
        Duration::from_secs(60),
    )
    .await?;
    let start = db_clock(&db.pool).await?;
    // The producer tops the backlog up every 20 ms, counting what waits through the claim
    // index (only available rows are in it), on a connection of its own that never reads
    // the table whole: on a table never analyzed the planner might, and the bench's own
    // reads would then grow with the table they measure.
    let options: PgConnectOptions = db.url.parse()?;
    let pool =
        PgPoolOptions::new().max_connections(1).connect_with(options.options([("enable_seqscan", "off")])).await?;
    let done = Arc::new(AtomicBool::new(false));
    let producer = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut produced = backlog;
            while !done.load(Ordering::Relaxed) {
                let waiting = count(&pool, "SELECT count(*) FROM jobs WHERE state = 'available'").await?;
                if waiting < backlog {
                    fill(&pool, backlog - waiting).await?;
                    produced += backlog - waiting;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(produced)
        })
    };
    tokio::time::sleep(Duration::from_secs(args.fresh_seconds)).await;
    done.store(true, Ordering::Relaxed);
    let produced = producer.await??;
    let end = db_clock(&db.pool).await?;
    // What was completed while the producer ran, per window, on the database's clock.
    let per_window: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT floor((extract(epoch FROM finished_at) - $1) / $2)::int8 AS w, count(*)
         FROM jobs WHERE state = 'completed' AND finished_at >= to_timestamp($1) AND finished_at < to_timestamp($3)
         GROUP BY w ORDER BY w",
    )
    .bind(start)
    .bind(WINDOW)
    .bind(end)
    .fetch_all(&db.pool)
    .await?;
    // Then the rest of the backlog, and the check that nothing was lost or run twice.
    wait_until(&db.pool, DRAINED, 1, Duration::from_secs(600)).await?;
    let (after, twice): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'completed'), count(*) FILTER (WHERE attempt > 1) FROM jobs",
    )
    .fetch_one(&db.pool)
    .await?;
    anyhow::ensure!(after - before == produced, "{} of {produced} jobs completed", after - before);
    anyhow::ensure!(twice == 0, "{twice} jobs were claimed more than once");
    for p in procs {
        p.stop();
    }
    let full: Vec<f64> = per_window
        .iter()
        .filter(|(w, _)| ((*w + 1) as f64) * WINDOW <= end - start)
        .map(|(_, n)| *n as f64 / WINDOW)
        .collect();
    let total: i64 = per_window.iter().map(|(_, n)| n).sum();
    Ok(Standing { rate: total as f64 / (end - start), windows: full })
}

/// Runs the part.
pub async fn measure(args: &Args, reps: usize, results: &mut Map<String, Value>) -> anyhow::Result<()> {
    eprintln!(
        "a new database against a warm one: a standing backlog of {} drained by {} workers for {} s; the pipeline without a warm-up",
        args.fresh_backlog, args.fresh_workers, args.fresh_seconds
    );
    let mut figures: std::collections::BTreeMap<&'static str, Vec<f64>> = Default::default();
    for i in 0..reps {
        let db = Db::create(args, "fresh").await?;
        let fresh = standing(args, &db).await?;
        sqlx::query("VACUUM ANALYZE jobs").execute(&db.pool).await?;
        let warm = standing(args, &db).await?;
        db.drop().await?;
        let windows = |s: &Standing| s.windows.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(" ");
        eprintln!(
            "  repetition {}: new {:.0} jobs/s (by {WINDOW} s: {}), warm {:.0} jobs/s (by {WINDOW} s: {})",
            i + 1,
            fresh.rate,
            windows(&fresh),
            warm.rate,
            windows(&warm)
        );
        let slowest = fresh.windows.iter().copied().fold(f64::INFINITY, f64::min);
        let mut add = |k: &'static str, v: f64| figures.entry(k).or_default().push(v);
        add("standing_drain_new_jobs_per_sec", fresh.rate);
        add("standing_drain_warm_jobs_per_sec", warm.rate);
        add("standing_drain_new_ratio", fresh.rate / warm.rate);
        add("standing_drain_new_slowest_window_ratio", slowest / warm.rate);

        let cold_args = Args { pipeline_warmup: 0, ..args.clone() };
        let db = Db::create(args, "fresh_pipeline").await?;
        let cold = service::pipeline(&cold_args, &db, false).await?;
        db.drop().await?;
        let db = Db::create(args, "warm_pipeline").await?;
        let warm = service::pipeline(args, &db, false).await?;
        db.drop().await?;
        eprintln!("    pipeline without a warm-up {:.0}, after one {:.0} deliveries/s", cold.rate, warm.rate);
        add("pipeline_new_deliveries_per_sec", cold.rate);
        add("pipeline_new_ratio", cold.rate / warm.rate);
    }
    for (k, v) in figures {
        put(results, k, median(v));
    }
    Ok(())
}
