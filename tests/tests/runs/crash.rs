//! Crash convergence: a real agent process (`airlock-scripted-agent`, speaking the agent
//! API) is killed at every boundary of its script in turn — before and after each step
//! record, effect begin, external write and outcome — then started again (it claims the
//! run, reads its log and goes on). Every run must converge to the terminal state and the
//! log of an uncrashed run; at the receiver, each idempotent effect is applied under one
//! key, and the non-repeatable one happens at most once. A kill between beginning the
//! non-repeatable effect and recording its outcome leaves the run `waiting`: that is the
//! correct end, and a human settles it (confirmed done when the receiver has it, else one
//! more attempt), after which the run converges too.
//!
//! `every_boundary_has_a_row` fails when the script gains a boundary without a row here.
//! The random variant kills the agent at random boundaries several times per run.
#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, Rng};
use airlock_tests::scripted;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

/// How a run ends once the agent was killed at a boundary and started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The restarted agent finishes the run.
    Completes,
    /// The non-repeatable effect was begun and its outcome is unknown: a human decides.
    WaitsForHuman,
}

/// The end each boundary leads to.
const ROWS: &[(&str, End)] = &[
    ("before:claim", End::Completes),
    ("after:claim", End::Completes),
    ("before:read_log", End::Completes),
    ("after:read_log", End::Completes),
    ("before:record:plan", End::Completes),
    ("after:record:plan", End::Completes),
    ("before:begin:charge", End::Completes),
    ("after:begin:charge", End::Completes),
    ("before:write:charge", End::Completes),
    ("after:write:charge", End::Completes),
    ("before:outcome:charge", End::Completes),
    ("after:outcome:charge", End::Completes),
    ("before:record:observe", End::Completes),
    ("after:record:observe", End::Completes),
    ("before:begin:notify", End::Completes),
    ("after:begin:notify", End::WaitsForHuman),
    ("before:write:notify", End::WaitsForHuman),
    ("after:write:notify", End::WaitsForHuman),
    ("before:outcome:notify", End::WaitsForHuman),
    ("after:outcome:notify", End::Completes),
    ("before:submit:report", End::Completes),
    ("after:submit:report", End::Completes),
    ("before:record:final", End::Completes),
    ("after:record:final", End::Completes),
    ("before:complete", End::Completes),
    ("after:complete", End::Completes),
];

#[test]
fn every_boundary_has_a_row() {
    let boundaries = scripted::boundaries();
    for b in &boundaries {
        assert!(ROWS.iter().any(|(r, _)| r == b), "boundary `{b}` has no row: add one with the end it leads to");
    }
    for (r, _) in ROWS {
        assert!(boundaries.iter().any(|b| b == r), "row `{r}` is not a boundary of the script");
    }
}

const WAIT: Duration = Duration::from_secs(60);

/// Runs the agent once on `run`, killed at `crash_at` if given; its exit code (or the
/// signal that ended it, as `-signal`). Waits without blocking the runtime: the API the
/// agent calls runs in this process.
async fn agent(app: &TestApp, run: &str, crash_at: Option<&str>) -> i32 {
    let env: Vec<(&str, &str)> = crash_at.map(|c| vec![("AIRLOCK_AGENT_CRASH_AT", c)]).unwrap_or_default();
    let receiver = app.hooks.origin();
    let mut child = harness::spawn(
        "airlock-scripted-agent",
        &["--api", &app.api, "--token", &app.agent, "--run", run, "--receiver", &receiver],
        &app.db_url,
        &env,
    );
    let status = harness::wait_for("the scripted agent to exit", WAIT, || {
        let status = child.try_wait().expect("waiting for the agent");
        async move { status }
    })
    .await;
    status.code().unwrap_or_else(|| -status.signal().unwrap_or(0))
}

async fn new_run(app: &TestApp) -> String {
    app.create_run(0).await
}

/// The run as its agent sees it.
async fn run_view(app: &TestApp, run: &str) -> Value {
    let (s, v) = app.call("GET", &format!("{}/v1/runs/{run}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// The run's log as `(step_id, kind, data)`, with the run's own ids and keys replaced by
/// placeholders, so the logs of two runs compare.
async fn log_of(app: &TestApp, run: &str) -> Vec<(String, String, String)> {
    let (s, v) = app.call("GET", &format!("{}/v1/runs/{run}/steps?limit=1000", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let keys = keys(app, run).await;
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let mut data = s["data"].to_string().replace(run, "<run>");
            for (name, key) in &keys {
                data = data.replace(key.as_str(), &format!("<{name}>"));
            }
            if s["kind"] == "delivery" {
                data = "<delivery>".into();
            }
            (s["step_id"].as_str().unwrap().into(), s["kind"].as_str().unwrap().into(), data)
        })
        .collect()
}

/// The idempotency keys of the run's effects, by step.
async fn keys(app: &TestApp, run: &str) -> Vec<(String, String)> {
    sqlx::query_as("SELECT DISTINCT step_id, idempotency_key FROM run_effects WHERE run_id = $1::uuid ORDER BY step_id")
        .bind(run)
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

/// Settles the run's waiting effect as a careful human would: confirmed done (with what
/// the receiver shows) when the receiver has the request, else one more attempt.
async fn settle(app: &TestApp, run: &str) {
    let keys = keys(app, run).await;
    let key = keys.iter().find(|(s, _)| s == "notify").map(|(_, k)| k.clone()).unwrap();
    let arrived = app.hooks.hits().iter().any(|h| h.path == "/notify" && h.idempotency_key.as_deref() == Some(&key));
    let body = if arrived {
        json!({"resolution": "confirmed_done", "note": "the receiver has it", "result": {"status": 200, "key": key}})
    } else {
        json!({"resolution": "retry", "note": "the receiver has no such request"})
    };
    let url = format!("{}/admin/v1/runs/{run}/effects/notify/resolve", app.admin);
    let (s, v) = app.call("POST", &url, Some(&app.reviewer), Some(body)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// Checks what the receiver saw of `run`: every charge under the run's one charge key,
/// exactly one notify, and the run's one report delivery.
async fn check_receiver(app: &TestApp, run: &str, case: &str) {
    let keys = keys(app, run).await;
    let key = |step: &str| keys.iter().find(|(s, _)| s == step).map(|(_, k)| k.clone()).unwrap();
    let (charge, notify) = (key("charge"), key("notify"));
    let hits = app.hooks.hits();
    let charges: Vec<_> = hits.iter().filter(|h| h.idempotency_key.as_deref() == Some(&charge)).collect();
    assert!(!charges.is_empty() && charges.iter().all(|h| h.path == "/charge"), "{case}: charged under its key");
    let notified = hits.iter().filter(|h| h.idempotency_key.as_deref() == Some(&notify)).count();
    assert_eq!(notified, 1, "{case}: the non-repeatable effect happened exactly once");
    let reports: i64 =
        sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE run_id = $1::uuid AND step_id = 'report'")
            .bind(run)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(reports, 1, "{case}: one report delivery");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_agent_killed_at_every_boundary_converges(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    // The reference: a run nobody kills.
    let reference = new_run(&app).await;
    assert_eq!(agent(&app, &reference, None).await, 0, "the uncrashed run completes");
    let want_log = log_of(&app, &reference).await;
    let want = run_view(&app, &reference).await;
    assert_eq!(want["state"], "completed");
    assert_eq!(
        want_log.iter().map(|(s, _, _)| s.as_str()).collect::<Vec<_>>(),
        ["plan", "charge", "observe", "notify", "report", "final"]
    );
    check_receiver(&app, &reference, "reference").await;

    let mut table = Vec::new();
    for (boundary, end) in ROWS {
        let run = new_run(&app).await;
        let killed = agent(&app, &run, Some(boundary)).await;
        assert_eq!(killed, -(nix::sys::signal::Signal::SIGABRT as i32), "{boundary}: the agent was killed there");
        let again = agent(&app, &run, None).await;
        let waited = match (end, again) {
            (End::Completes, 0) => false,
            (End::WaitsForHuman, 3) => {
                let r = run_view(&app, &run).await;
                assert_eq!(
                    (r["state"].clone(), r["waiting_on"].clone()),
                    (json!("waiting"), json!("effect:notify")),
                    "{boundary}"
                );
                settle(&app, &run).await;
                assert_eq!(agent(&app, &run, None).await, 0, "{boundary}: after the human, the run completes");
                true
            }
            (end, code) => panic!("{boundary}: expected {end:?}, the restarted agent exited {code}"),
        };
        let r = run_view(&app, &run).await;
        assert_eq!(r["state"], "completed", "{boundary}");
        assert_eq!(log_of(&app, &run).await, want_log, "{boundary}: the same log as an uncrashed run");
        let result = r["result"].to_string().replace(&run, "<run>");
        let mut result = result;
        for (name, key) in keys(&app, &run).await {
            result = result.replace(&key, &format!("<{name}>"));
        }
        let mut want_result = want["result"].to_string();
        for (name, key) in keys(&app, &reference).await {
            want_result = want_result.replace(&key, &format!("<{name}>"));
        }
        assert_eq!(result, want_result, "{boundary}: the same result");
        check_receiver(&app, &run, boundary).await;
        table.push(format!("| {boundary} | {:?} | {} |", end, if waited { "settled by a human" } else { "" }));
    }
    println!("| killed at | end | |\n| --- | --- | --- |\n{}", table.join("\n"));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_agent_killed_at_random_boundaries_again_and_again_converges(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let reference = new_run(&app).await;
    assert_eq!(agent(&app, &reference, None).await, 0);
    let want_log = log_of(&app, &reference).await;
    let boundaries = scripted::boundaries();
    let seed = std::env::var("AIRLOCK_RUNS_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(42u64);
    let mut rng = Rng(seed);
    for round in 0..6 {
        let run = new_run(&app).await;
        let mut kills = 0;
        // Up to five kills, each at a boundary the agent reaches again (a boundary it has
        // passed for good, like an outcome already recorded, lets it run on).
        loop {
            let crash_at = (kills < 5).then(|| boundaries[rng.range(0, boundaries.len() as u64 - 1) as usize].clone());
            let code = agent(&app, &run, crash_at.as_deref()).await;
            match code {
                0 => break,
                3 => settle(&app, &run).await,
                c if c == -(nix::sys::signal::Signal::SIGABRT as i32) => kills += 1,
                c => panic!("seed {seed} round {round}: the agent exited {c}"),
            }
            if crash_at.is_none() && code != 3 {
                break;
            }
        }
        let r = run_view(&app, &run).await;
        assert_eq!(r["state"], "completed", "seed {seed} round {round}");
        assert_eq!(log_of(&app, &run).await, want_log, "seed {seed} round {round}: the same log");
        check_receiver(&app, &run, &format!("seed {seed} round {round}")).await;
    }
}
