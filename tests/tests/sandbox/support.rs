//! Helpers shared by the sandbox suites: submitting tasks, waiting for their states, and the
//! invariants every suite checks at the end.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use airlock_sandbox::state::TaskState;
use airlock_sandbox::store;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

pub const WAIT: Duration = Duration::from_secs(30);

/// Submits a task as `token`; returns the status and body.
pub async fn post(app: &TestApp, token: &str, body: Value) -> (StatusCode, Value) {
    app.call("POST", &format!("{}/v1/tasks", app.api), Some(token), Some(body)).await
}

/// Submits a task as the agent; returns its id.
pub async fn create(app: &TestApp, body: Value) -> Uuid {
    let (s, v) = post(app, &app.agent, body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "selecting");
    Uuid::parse_str(v["id"].as_str().unwrap()).unwrap()
}

/// The agent's view of its task.
pub async fn view(app: &TestApp, id: Uuid) -> Value {
    let (s, v) = app.call("GET", &format!("{}/v1/tasks/{id}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// Waits for the task to reach `state`; returns the agent's view.
pub async fn wait_state(app: &TestApp, id: Uuid, state: TaskState) -> Value {
    wait_db(app, id, state).await;
    view(app, id).await
}

/// Waits for the task to reach `state` (failing at once if it ends in another one).
pub async fn wait_db(app: &TestApp, id: Uuid, state: TaskState) {
    let pool = app.pool.clone();
    harness::wait_for(&format!("task {id} to be {state}"), WAIT, || {
        let pool = pool.clone();
        async move {
            let t = store::get_task(&pool, id).await.unwrap().unwrap();
            assert!(
                !(t.state.is_terminal() && t.state != state),
                "task {id} ended {} while waiting for {state}: {:?}",
                t.state,
                t.error
            );
            (t.state == state).then_some(())
        }
    })
    .await;
}

/// The operator's choice for a task.
pub async fn choose(app: &TestApp, token: &str, id: Uuid, body: Value) -> (StatusCode, Value) {
    app.call("POST", &format!("{}/admin/v1/tasks/{id}/choose", app.admin), Some(token), Some(body)).await
}

/// Invariants that hold for every task at rest:
/// - every task past `selecting` has a decision, and at most one decision settled it;
/// - every task that ran has its outcome on the one chosen decision, and as many run rows
///   as starts, all closed, exactly one of them `finished`;
/// - nothing is running or left open.
pub async fn assert_invariants(pool: &PgPool) {
    let tasks: Vec<(Uuid, TaskState, i32)> =
        sqlx::query_as("SELECT id, state, run_count FROM sandbox_tasks").fetch_all(pool).await.unwrap();
    for (id, state, run_count) in tasks {
        let decisions = store::decisions_of(pool, id).await.unwrap();
        if state != TaskState::Selecting {
            assert!(!decisions.is_empty(), "task {id} ({state}) has no decision");
        }
        let settled = decisions.iter().filter(|d| d.chosen_tier.is_some() || d.verdict.as_str() == "denied").count();
        assert!(settled <= 1, "task {id} was settled {settled} times");
        let runs = store::runs_of(pool, id).await.unwrap();
        assert_eq!(runs.len() as i32, run_count, "task {id}: one run row per start");
        if matches!(state, TaskState::Succeeded | TaskState::TimedOut) || (state == TaskState::Failed && run_count > 0)
        {
            let chosen = decisions.iter().find(|d| d.chosen_tier.is_some()).unwrap();
            if runs.iter().any(|r| r.result.as_deref() == Some("finished")) {
                assert!(chosen.outcome_at.is_some(), "task {id}: the outcome is on its decision");
            }
            assert!(runs.iter().all(|r| r.ended_at.is_some()), "task {id}: a run is left open");
            assert!(
                runs.iter().filter(|r| r.result.as_deref() == Some("finished")).count() <= 1,
                "task {id}: more than one run finished"
            );
        }
        assert_ne!(state, TaskState::Running, "task {id} is still running");
    }
}

/// No run directory is left under a sandbox work directory (which holds one directory per
/// worker process, each holding that worker's runs in progress).
pub fn assert_no_run_dirs(work_dir: &str) {
    let runs: Vec<String> = std::fs::read_dir(work_dir)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|worker| std::fs::read_dir(worker.path()).into_iter().flatten().flatten())
        .map(|run| run.path().display().to_string())
        .collect();
    assert!(runs.is_empty(), "run directories left behind: {runs:?}");
}

/// Host processes whose command line contains `marker`.
pub fn processes_with(marker: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}
