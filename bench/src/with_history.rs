//! The `history` part: the figures that must not grow with an installation's history,
//! measured on a database holding a month of it (`airlock_bench::history`) and on an
//! empty one, in turn within each repetition, so that each ratio compares two runs minutes
//! apart, with no reader beside either. Then, on the history alone and in runs of their
//! own, what a reviewer's reads take under the pipeline's load and beside the steady rate;
//! the plans of the review queue's read; and how often the service read a history table
//! whole while it was measured.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;

use airlock_bench::history::{self, History};
use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::deliveries::list_statement;
use airlock_delivery::store::shown::SHOWN_SQL;
use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sqlx::postgres::PgPoolOptions;

use crate::{Args, Db, drain_on, median, percentile, put, runs, service};

/// What one side (empty, or with the history) measured in one repetition.
struct Side {
    pipeline: service::PipelineRun,
    steady: service::Steady,
    runs: runs::RunsFigures,
    drain: f64,
    /// With the history: the reviewer's reads, under the pipeline's load and beside the
    /// steady rate, each measured in a run of its own after the ones the ratios compare.
    reads: Option<(service::Reads, service::Reads)>,
    /// With the history: the sequential scans of each history table while the service
    /// ran (the drain's own counting aside).
    scans: Vec<(String, i64)>,
}

/// Jobs in the per-job drain of each side.
const DRAIN_JOBS: i64 = 20_000;

async fn side(args: &Args, db: &mut Db, with_history: bool) -> anyhow::Result<Side> {
    // Each side starts just after a checkpoint. Dropping the empty side's database forces
    // one, and creating it does not: without this, the history's side would start after
    // one whenever it runs second, and pay the pages first written after it (each a whole
    // page in the WAL) that the empty side in that place does not.
    sqlx::query("CHECKPOINT").execute(&db.admin).await.context("a checkpoint before the side")?;
    let before = if with_history { Some(seq_scans(db).await?) } else { None };
    if !with_history {
        db.pool = own_pool(&db.url).await?;
    }
    // The figures the ratios compare run alike on both sides: no reader beside them.
    let pipeline = service::pipeline(args, db, false).await?;
    let rate = (args.steady_rate, args.steady_seconds, args.relay_ms);
    let steady = service::steady(args, db, rate, false).await?;
    let runs = runs::runs(args, db).await?;
    let mut reads = None;
    if with_history {
        let under_pipeline = service::pipeline(args, db, true).await?.reads.context("read beside the pipeline")?;
        let at_steady = service::steady(args, db, rate, true).await?.reads.context("read beside the steady rate")?;
        reads = Some((under_pipeline, at_steady));
    }
    let mut scans = Vec::new();
    if with_history {
        scans = seq_scans(db).await?.since(&before.context("read before")?);
    }
    let (drain, _) = drain_on(args, db, DRAIN_JOBS, 1, crate::Mode::PerJob).await?;
    Ok(Side { pipeline, steady, runs, drain, reads, scans })
}

/// The tables and indexes a steady delivery reads more blocks of with the history than
/// without, most first (medians over the repetitions): where the history's extra work goes.
fn touched_report(touched: BTreeMap<String, [Vec<f64>; 2]>) -> String {
    let mut rows: Vec<(String, f64, f64)> = touched
        .into_iter()
        .map(|(name, [with, without])| {
            let m = |v: Vec<f64>| if v.is_empty() { 0.0 } else { median(v) };
            (name, m(with), m(without))
        })
        .collect();
    rows.sort_by(|a, b| (b.1 - b.2).total_cmp(&(a.1 - a.2)));
    let mut out = String::from(
        "\nBlocks read per steady delivery (shared buffers or outside them), the tables and indexes \
         that grew most with the history:\n\n| table or index | with the history | empty |\n| --- | --- | --- |\n",
    );
    for (name, with, without) in rows.iter().take(20) {
        out.push_str(&format!("| `{name}` | {with:.1} | {without:.1} |\n"));
    }
    let sum = |f: fn(&(String, f64, f64)) -> f64| rows.iter().map(f).sum::<f64>();
    out.push_str(&format!("| all | {:.1} | {:.1} |\n\n", sum(|r| r.1), sum(|r| r.2)));
    out
}

fn p99(v: &[f64]) -> f64 {
    percentile(v, 0.99)
}

/// Runs the part; returns the report of plans and scans printed beside the table.
pub async fn measure(args: &Args, reps: usize, results: &mut Map<String, Value>) -> anyhow::Result<String> {
    if let Some(name) = &args.history_db {
        return reads_only(args, reps, name).await;
    }
    let h = History {
        deliveries: args.history_deliveries,
        in_review: args.history_in_review,
        run_steps: args.history_run_steps,
        jobs: args.history_jobs,
    };
    eprintln!(
        "history: {} finished deliveries, {} in review, {} run steps, {} finished jobs",
        h.deliveries, h.in_review, h.run_steps, h.jobs
    );
    let mut hist = Db::create(args, "history").await?;
    let t = Instant::now();
    let took = history::load(&hist.pool, h, "history").await?;
    let load = t.elapsed().as_secs_f64();
    let parts: Vec<String> = took.iter().map(|(what, s)| format!("{what} {s:.0} s")).collect();
    eprintln!("  written in {load:.0} s ({})", parts.join(", "));
    put(results, "history_load_seconds", load);
    let bytes: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())").fetch_one(&hist.pool).await?;
    put(results, "history_database_mib", bytes as f64 / 1048576.0);

    let mut report = plans(&hist).await?;
    let mut figures: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut scans: BTreeMap<String, i64> = BTreeMap::new();
    // Per table and index: the blocks read for per steady delivery, with the history and without.
    let mut touched: BTreeMap<String, [Vec<f64>; 2]> = BTreeMap::new();
    // Each kind of the reviewer's reads, every sample of every repetition.
    let mut pooled: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for i in 0..reps {
        // Which side goes first alternates, so a drift of the machine's speed over the
        // repetition does not favour one side.
        let history_first = i % 2 == 1;
        let (mut empty, mut full) = (None, None);
        for with in [history_first, !history_first] {
            if with {
                eprintln!("  repetition {}: with the history", i + 1);
                full = Some(side(args, &mut hist, true).await?);
            } else {
                eprintln!("  repetition {}: on an empty database", i + 1);
                let mut db = Db::create(args, "empty").await?;
                empty = Some(side(args, &mut db, false).await?);
                db.drop().await?;
            }
        }
        let (e, f) = (empty.expect("measured"), full.expect("measured"));
        for (table, n) in &f.scans {
            *scans.entry(table.clone()).or_default() += n;
        }
        let (reads, at50) = f.reads.as_ref().expect("read on the history's side");
        eprintln!(
            "    pipeline {:.0} against {:.0} deliveries/s; approve to sent p99 {:.1} against {:.1} ms; \
             submission p99 {:.1} against {:.1} ms; run steps {:.0} against {:.0}/s; drain {:.0} against {:.0} jobs/s; \
             admin list p99 {:.1} ms, page 100 p99 {:.1} ms, get p99 {:.1} ms under the pipeline, \
             {:.1}, {:.1}, {:.1} ms beside the steady rate (the history's side first: {})",
            f.pipeline.rate,
            e.pipeline.rate,
            p99(&f.steady.approve_to_sent_ms),
            p99(&e.steady.approve_to_sent_ms),
            p99(&f.steady.submit_ms),
            p99(&e.steady.submit_ms),
            f.runs.steps_per_sec,
            e.runs.steps_per_sec,
            f.drain,
            e.drain,
            p99(&reads.list_ms),
            p99(&reads.page100_ms),
            p99(&reads.get_ms),
            p99(&at50.list_ms),
            p99(&at50.page100_ms),
            p99(&at50.get_ms),
            history_first,
        );
        eprintln!(
            "    floors: admin /healthz p99 {:.1} ms, SELECT 1 p99 {:.1} ms, the list's statement p99 {:.1} ms under the \
             pipeline; {:.1}, {:.1}, {:.1} ms beside the steady rate",
            p99(&reads.healthz_ms),
            p99(&reads.select1_ms),
            p99(&reads.statement_ms),
            p99(&at50.healthz_ms),
            p99(&at50.select1_ms),
            p99(&at50.statement_ms),
        );
        let mut add = |k: &str, v: f64| figures.entry(k.to_string()).or_default().push(v);
        add("pipeline_history_deliveries_per_sec", f.pipeline.rate);
        add("pipeline_empty_deliveries_per_sec", e.pipeline.rate);
        add("pipeline_history_ratio", f.pipeline.rate / e.pipeline.rate);
        add("pipeline_submission_p99_history_ratio", p99(&f.pipeline.submit_ms) / p99(&e.pipeline.submit_ms));
        add("submission_p99_ms", p99(&f.steady.submit_ms));
        add("submission_p99_empty_ms", p99(&e.steady.submit_ms));
        add("submission_p99_history_ratio", p99(&f.steady.submit_ms) / p99(&e.steady.submit_ms));
        add("submission_to_scored_p99_ms", p99(&f.steady.scored_ms));
        add("submission_to_scored_p99_empty_ms", p99(&e.steady.scored_ms));
        add("approve_to_sent_p50_ms", percentile(&f.steady.approve_to_sent_ms, 0.5));
        add("approve_to_sent_p99_ms", p99(&f.steady.approve_to_sent_ms));
        add("approve_to_sent_p99_empty_ms", p99(&e.steady.approve_to_sent_ms));
        add("approve_to_sent_p99_history_ratio", p99(&f.steady.approve_to_sent_ms) / p99(&e.steady.approve_to_sent_ms));
        for (suffix, r) in [("", reads), ("_at_steady", at50)] {
            let kinds = [
                ("admin_list", &r.list_ms),
                ("admin_list_page100", &r.page100_ms),
                ("admin_get", &r.get_ms),
                ("admin_healthz", &r.healthz_ms),
                ("select1", &r.select1_ms),
                ("admin_list_statement", &r.statement_ms),
            ];
            for (kind, ms) in kinds {
                pooled.entry(format!("{kind}{suffix}")).or_default().extend(ms.iter().copied());
            }
        }
        add("run_steps_per_sec_history", f.runs.steps_per_sec);
        add("run_steps_per_sec_empty", e.runs.steps_per_sec);
        add("run_steps_history_ratio", f.runs.steps_per_sec / e.runs.steps_per_sec);
        add("drain_history_jobs_per_sec", f.drain);
        add("drain_history_ratio", f.drain / e.drain);
        for (side, io) in [("history", f.steady.io), ("empty", e.steady.io)] {
            let mut add_io = |what: &str, v: f64| {
                figures.entry(format!("steady_{what}_per_delivery_{side}")).or_default().push(v);
            };
            add_io("wal_kib", io.wal_bytes / 1024.0);
            add_io("wal_fpi", io.wal_fpi);
            add_io("wal_records", io.wal_records);
            add_io("blocks_read", io.blks_read);
            add_io("blocks_hit", io.blks_hit);
        }
        for (side, t) in [(0, &f.steady.touched), (1, &e.steady.touched)] {
            for (name, v) in &t.0 {
                touched.entry(name.clone()).or_default()[side].push(*v);
            }
        }
    }
    for (k, v) in figures {
        put(results, &k, median(v));
    }
    // A read's percentiles over every repetition's samples at once: one repetition's
    // pipeline lasts seconds, and the p99 of its few dozen reads of a kind is their worst.
    for (kind, mut ms) in pooled {
        ms.sort_by(f64::total_cmp);
        put(results, &format!("{kind}_p99_ms"), p99(&ms));
        put(results, &format!("{kind}_p50_ms"), percentile(&ms, 0.5));
        put(results, &format!("{kind}_samples"), ms.len() as f64);
    }
    if !results.contains_key("run_steps_per_sec") {
        let v = results["run_steps_per_sec_empty"].as_f64().unwrap_or(f64::NAN);
        put(results, "run_steps_per_sec", v);
    }
    report.push_str(&touched_report(touched));
    let read_whole: Vec<String> = scans.iter().map(|(table, n)| format!("{table} {n}")).collect();
    report.push_str(&format!(
        "Sequential scans of the history's tables while the service ran on it ({} repetitions of the pipeline, \
         the steady rate, the run steps and the reviewer's reads): {}\n",
        reps,
        read_whole.join(", ")
    ));
    // The event log's partitions apart: the history's own (the first, made by the migration
    // and filled by the loader) and those the service's deliveries filled while measured.
    let end = seq_scans(&mut hist).await?;
    let parts: Vec<String> = end
        .0
        .iter()
        .filter(|r| r.table == "delivery_events" && r.name != r.table)
        .map(|r| format!("{} {} ({} pages)", r.name, r.seq_scans, r.pages))
        .collect();
    report.push_str(&format!("Of which the event log's partitions, as they end: {}\n", parts.join(", ")));
    if args.keep_history {
        eprintln!("  the history's database is kept: {}", hist.name);
    } else {
        hist.drop().await?;
    }
    Ok(report)
}

/// `--history-db`: the reviewer's reads alone, on a history already loaded, beside the
/// pipeline's work at each of `--read-rates` and then under the saturating pipeline; each
/// repetition's p50/p99 of each kind, ms. Each run adds its deliveries to the history.
async fn reads_only(args: &Args, reps: usize, name: &str) -> anyhow::Result<String> {
    let db = Db::open(args, name).await?;
    let mut report = String::from("The reviewer's reads beside the pipeline, p50/p99 ms:\n");
    let paces = args.read_rates.iter().map(|&r| Some((r, args.steady_seconds))).chain([None]);
    for i in 0..reps {
        for pace in paces.clone() {
            let run = service::pipeline_at(args, &db, true, pace).await?;
            let r = run.reads.context("read beside the pipeline")?;
            let q = |v: &[f64]| format!("{:.1}/{:.1}", percentile(v, 0.5), p99(v));
            let load = match pace {
                Some((rate, _)) => format!("submitted at {rate}/s"),
                None => "saturating".to_string(),
            };
            let line = format!(
                "repetition {}, {load}: pipeline {:.0} deliveries/s, journey p50/p99 {:.0}/{:.0} ms; \
                 list {}, page 100 {}, get {} ({} each); /healthz {}, SELECT 1 {}, the list's statement {}",
                i + 1,
                run.rate,
                run.p50,
                run.p99,
                q(&r.list_ms),
                q(&r.page100_ms),
                q(&r.get_ms),
                r.list_ms.len(),
                q(&r.healthz_ms),
                q(&r.select1_ms),
                q(&r.statement_ms),
            );
            eprintln!("  {line}");
            report.push_str(&line);
            report.push('\n');
        }
    }
    db.pool.close().await;
    Ok(report)
}

/// The review queue's read, first page and page 100, in the generic plan (the one a
/// connection keeps after five executions, unless its fresh plans cost less), executed on
/// the history.
async fn plans(db: &Db) -> anyhow::Result<String> {
    let (at, id): (DateTime<Utc>, uuid::Uuid) = sqlx::query_as(
        "SELECT created_at, id FROM deliveries WHERE state = 'in_review' ORDER BY created_at, id OFFSET 4949 LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await?;
    let mut conn = db.pool.acquire().await?;
    let mut out = String::new();
    sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await?;
    for (page, after) in [("first page", None), ("page 100", Some((at, id.into())))] {
        let statement = list_statement(&[DeliveryState::InReview], after, 51);
        let sql = statement.sql();
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE list AS {}", sql.as_str()))).execute(&mut *conn).await?;
        let args = match after {
            None => "'in_review'".to_string(),
            Some(_) => format!("'in_review', '{}', '{id}'", at.to_rfc3339()),
        };
        let plan: Vec<String> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, BUFFERS) EXECUTE list({args})")))
                .fetch_all(&mut *conn)
                .await?;
        out.push_str(&format!(
            "GET /admin/v1/deliveries?state=in_review, {page}, generic plan:\n{}\n\n",
            plan.join("\n")
        ));
        sqlx::query("DEALLOCATE list").execute(&mut *conn).await?;
    }
    // A delivery of the history as its view reads it, and the claim over the history's
    // finished jobs as a worker runs it (in a transaction rolled back: an EXPLAIN ANALYZE
    // of it claims).
    let what = "GET /admin/v1/deliveries/{id}, a delivery of the history with all its view shows (events from the hot log and the archive)";
    sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE shown AS {SHOWN_SQL}"))).execute(&mut *conn).await?;
    let plan = explain(&mut conn, "shown", &format!("'{id}', true, NULL, NULL")).await?;
    out.push_str(&format!("{what}, generic plan:\n{}\n\n", plan.join("\n")));
    sqlx::query("DEALLOCATE shown").execute(&mut *conn).await?;
    // The worker's claim, as its connections plan it (`airlock_core::db::queue_plans`).
    airlock_core::db::set_queue_plans(&mut conn).await?;
    let prepare = format!("PREPARE claim AS {}", airlock_queue::CLAIM_SQL);
    sqlx::query(sqlx::AssertSqlSafe(prepare)).execute(&mut *conn).await?;
    let plan = explain(&mut conn, "claim", "'bench-plan', NULL, '{}', 10, 30, NULL, NULL, NULL, '{0,1,2,3}'").await?;
    out.push_str(&format!(
        "a worker's claim, unbounded, beside the history's finished jobs, generic plan:\n{}\n\n",
        plan.join("\n")
    ));
    sqlx::query("DEALLOCATE claim").execute(&mut *conn).await?;
    sqlx::query("RESET ALL").execute(&mut *conn).await?;
    Ok(out)
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of the statement prepared as `name` with `args`, in a
/// transaction rolled back.
async fn explain(conn: &mut sqlx::PgConnection, name: &str, args: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query("BEGIN").execute(&mut *conn).await?;
    let plan = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, BUFFERS) EXECUTE {name}({args})")))
        .fetch_all(&mut *conn)
        .await;
    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
    plan
}

/// The bench's own connections on either side: its waits and the reads of its results are
/// planned with `enable_seqscan = off`, so that the history's count of sequential scans is
/// the service's alone (a join over a few thousand ids may otherwise read a table whole).
async fn own_pool(url: &str) -> Result<sqlx::PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(20)
        .after_connect(|conn, _| {
            Box::pin(async move { sqlx::query("SET enable_seqscan = off").execute(conn).await.map(drop) })
        })
        .connect(url)
        .await
}

/// Sequential scans so far of each table the history fills. The bench's own sessions are
/// closed first and their ends awaited, so every count has been written out.
async fn seq_scans(db: &mut Db) -> anyhow::Result<history::Scans> {
    db.pool.close().await;
    db.pool = own_pool(&db.url).await?;
    let start = Instant::now();
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        .fetch_one(&db.pool)
        .await?;
        if others == 0 {
            break;
        }
        anyhow::ensure!(start.elapsed() < Duration::from_secs(60), "{others} sessions did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(history::seq_scans(&db.pool).await?)
}
