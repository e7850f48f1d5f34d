//! Sandboxed tasks with real processes: a worker SIGKILLed during selection and during a
//! run (the jobs are rescued per their effect class, and a lost run's command does not
//! outlive its worker), and the `airlock-admin sandbox report` command.
//!
//! Needs the binaries: `cargo build --workspace --bins` (as `scripts/test` does).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::support::{WAIT, assert_invariants, choose, create, wait_state};
use airlock_queue::{self as queue, JobState};
use airlock_sandbox::state::TaskState;
use airlock_sandbox::store;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use nix::sys::signal::Signal;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

async fn job_of(pool: &PgPool, kind: &str, task: Uuid) -> Option<queue::Job> {
    sqlx::query_as("SELECT * FROM jobs WHERE kind = $1 AND payload->>'task_id' = $2")
        .bind(kind)
        .bind(task.to_string())
        .fetch_optional(pool)
        .await
        .unwrap()
}

fn spawn_worker(app: &TestApp, extra: &[(&str, &str)]) -> KillOnDrop {
    let mut env = app.env_pairs();
    env.extend_from_slice(extra);
    KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env))
}

fn kill(worker: &mut KillOnDrop) {
    harness::signal(&worker.0, Signal::SIGKILL);
    harness::wait_exit(&mut worker.0, Duration::from_secs(10));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn selection_survives_a_worker_sigkill(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    // This worker claims the select job, then stops dead before deciding anything.
    let mut first = spawn_worker(&app, &[("AIRLOCK_FAULTS", "job.after_claim=pause")]);
    let id = create(&app, json!({"command": ["true"], "mode": "hybrid", "requested_tier": "light"})).await;
    let held = harness::wait_for("the select job to be claimed", WAIT, || {
        let pool = app.pool.clone();
        async move { job_of(&pool, "sandbox.select", id).await.filter(|j| j.state == JobState::Running) }
    })
    .await;
    kill(&mut first);

    // Another worker rescues the select job (it has no effect: it is simply run again).
    let _second = spawn_worker(&app, &[]);
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!(v["decision"]["chosen"], "light");
    let select = job_of(&app.pool, "sandbox.select", id).await.unwrap();
    assert_eq!((select.state, select.attempt), (JobState::Completed, held.attempt + 1));
    assert_eq!(store::decisions_of(&app.pool, id).await.unwrap().len(), 1, "decided exactly once");
    let run = job_of(&app.pool, "sandbox.run", id).await.unwrap();
    assert_eq!((run.state, run.attempt), (JobState::Completed, 1));
    assert_eq!(v["run_count"], 1, "ran exactly once");
    assert_invariants(&app.pool).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_run_survives_a_worker_sigkill_and_its_command_dies_with_the_worker(pool: PgPool) {
    let work_dir = std::env::temp_dir().join(format!("airlock-sandbox-test-{}", Uuid::new_v4())).display().to_string();
    let app = TestApp::start(pool, &[("AIRLOCK__SANDBOX__WORK_DIR", work_dir.as_str())]).await;
    // The run is isolated: the host sees it only through its run directory (`/task` inside)
    // and its processes, which carry a marker of this test in their arguments.
    let marker = format!("airlock-run-{}", Uuid::new_v4());
    let mut first = spawn_worker(&app, &[]);
    let id = create(
        &app,
        json!({"command": ["sh", "-c", "echo \"start $AIRLOCK_RUN $AIRLOCK_IDEMPOTENCY_KEY\"; : > started; sleep 2; echo end", marker],
               "mode": "agent", "requested_tier": "light", "effect": "idempotent"}),
    )
    .await;
    harness::wait_for("the first run to start", WAIT, || {
        let work_dir = work_dir.clone();
        async move { run_files(&work_dir, "started").first().map(|_| ()) }
    })
    .await;
    assert!(!crate::support::processes_with(&marker).is_empty(), "the first run is seen running");
    kill(&mut first);
    // The worker's death takes the whole sandbox with it, without waiting for anyone.
    harness::wait_for("the first run's processes to die with their worker", Duration::from_secs(5), || {
        let marker = marker.clone();
        async move { crate::support::processes_with(&marker).is_empty().then_some(()) }
    })
    .await;

    // The idempotent run job is rescued after its lease expires and run again elsewhere.
    let _second = spawn_worker(&app, &[]);
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!(v["output"]["stdout"], format!("start 2 {id}\nend\n"), "the rerun carries the same idempotency key");
    assert_eq!(v["run_count"], 2);
    assert_eq!(v["outcome"]["exit_code"], 0);
    let runs = store::runs_of(&app.pool, id).await.unwrap();
    let results: Vec<&str> = runs.iter().map(|r| r.result.as_deref().unwrap()).collect();
    assert_eq!(results, ["lost", "finished"]);
    assert_ne!(runs[0].worker, runs[1].worker);
    let run = job_of(&app.pool, "sandbox.run", id).await.unwrap();
    assert_eq!((run.state, run.attempt, run.effect_class), (JobState::Completed, 2, queue::EffectClass::Idempotent));
    assert_eq!(store::decisions_of(&app.pool, id).await.unwrap().len(), 1, "one decision, one outcome");
    assert_invariants(&app.pool).await;
    // The killed worker's run directory was removed by the next worker on this host.
    crate::support::assert_no_run_dirs(&work_dir);
    let _ = std::fs::remove_dir_all(work_dir);
}

/// Files named `name` in the working directories of the runs under a work directory.
fn run_files(work_dir: &str, name: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(work_dir)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|worker| std::fs::read_dir(worker.path()).into_iter().flatten().flatten())
        .map(|run| run.path().join("work").join(name))
        .filter(|p| p.exists())
        .collect()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn report_command_shows_a_light_task_on_heavy_as_over_provisioned(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-report");
    let id = create(&app, json!({"command": ["echo", "tiny"], "mode": "human", "kind": "greeting"})).await;
    wait_state(&app, id, TaskState::AwaitingChoice).await;
    let (s, v) = choose(&app, &app.operator, id, json!({"tier": "heavy", "note": "just in case"})).await;
    assert_eq!(s, reqwest::StatusCode::OK, "{v}");
    wait_state(&app, id, TaskState::Succeeded).await;
    stop.cancel();
    worker.await.unwrap().unwrap();

    let env = app.env_pairs();
    let out = harness::spawn("airlock-admin", &["sandbox", "report"], &app.db_url, &env).wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("over-provisioned (used far less than the tier): 1"), "{text}");
    let line = text.lines().find(|l| l.contains(&id.to_string())).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains("tier heavy") && line.contains("human:otto") && line.ends_with("-> light"), "{line}");
    assert!(text.contains("under-provisioned (stopped by a limit of the tier): 0"), "{text}");

    let out = harness::spawn("airlock-admin", &["sandbox", "report", "--json"], &app.db_url, &env)
        .wait_with_output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["over_provisioned"][0]["task_id"], id.to_string());
    assert_eq!(r["rows"][0]["tier"], "heavy");
    assert_eq!(r["rows"][0]["mode"], "human");
}
