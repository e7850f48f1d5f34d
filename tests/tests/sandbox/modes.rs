//! Sandboxed tasks end to end, through HTTP, with an in-process worker running real
//! commands: each selection mode, bounds and scopes, escalation to an operator and the
//! operator's choice resuming the task, limits that stop a run, and the review of choices.
#![allow(clippy::unwrap_used)]

use crate::support::{assert_invariants, choose, create, post, view, wait_state};
use airlock_queue::{self as queue, JobState};
use airlock_sandbox::state::TaskState;
use airlock_sandbox::store;
use airlock_tests::app::TestApp;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// A per-test run directory, so each suite can check that runs clean up after themselves.
fn work_dir() -> String {
    std::env::temp_dir().join(format!("airlock-sandbox-test-{}", Uuid::new_v4())).display().to_string()
}

async fn start(pool: PgPool, extra: &[(&str, &str)]) -> (TestApp, String) {
    let dir = work_dir();
    let mut env: Vec<(&str, &str)> = vec![("AIRLOCK__SANDBOX__WORK_DIR", dir.as_str())];
    env.extend_from_slice(extra);
    let app = TestApp::start(pool, &env).await;
    (app, dir)
}

/// Jobs of `kind` serving `task`.
async fn jobs_of(pool: &PgPool, kind: &str, task: Uuid) -> Vec<queue::Job> {
    sqlx::query_as("SELECT * FROM jobs WHERE kind = $1 AND payload->>'task_id' = $2")
        .bind(kind)
        .bind(task.to_string())
        .fetch_all(pool)
        .await
        .unwrap()
}

fn assert_clean(dir: &str) {
    crate::support::assert_no_run_dirs(dir);
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn agent_mode_runs_within_bounds_and_is_denied_outside(pool: PgPool) {
    let (app, dir) = start(pool, &[("AIRLOCK__SANDBOX__AGENTS__AGENT-2__ALLOWED_TIERS", "light")]).await;
    let (stop, worker) = app.start_worker("w-agent");

    let id = create(
        &app,
        json!({"command": ["sh", "-c", "echo hi; echo oops >&2"], "mode": "agent", "requested_tier": "light",
               "reason": "a one-liner"}),
    )
    .await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let d = &v["decision"];
    assert_eq!(
        (d["requested"].as_str(), d["chosen"].as_str(), d["mode"].as_str(), d["chooser"].as_str()),
        (Some("light"), Some("light"), Some("agent"), Some("agent:agent-1"))
    );
    assert!(d["reason"].as_str().unwrap().contains("a one-liner"), "{d}");
    let o = &v["outcome"];
    assert_eq!(o["exit_code"], 0);
    assert_eq!(o["timed_out"], false);
    assert_eq!(o["killed_for"], Value::Null);
    assert!(o["duration_ms"].as_u64().is_some() && o["peak_rss_kib"].as_u64().is_some(), "{o}");
    assert_eq!(o["output_bytes"], 8, "hi\\n + oops\\n");
    assert_eq!(v["output"]["stdout"], "hi\n");
    assert_eq!(v["output"]["stderr"], "oops\n");
    assert_eq!(v["run_count"], 1);

    // No tier named: the agent's default (standard).
    let id = create(&app, json!({"command": ["true"], "mode": "agent"})).await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!((v["decision"]["requested"].as_str(), v["decision"]["chosen"].as_str()), (None, Some("standard")));

    // heavy needs approval: agent mode denies it, the decision is logged, nothing runs.
    let id = create(&app, json!({"command": ["true"], "mode": "agent", "requested_tier": "heavy"})).await;
    let v = wait_state(&app, id, TaskState::Denied).await;
    let d = &v["decision"];
    assert_eq!(
        (d["verdict"].as_str(), d["chosen"].as_str(), d["chooser"].as_str()),
        (Some("denied"), None, Some("platform"))
    );
    assert!(d["reason"].as_str().unwrap().contains("out of bounds"), "{d}");
    assert_eq!(v["outcome"], Value::Null);
    assert!(jobs_of(&app.pool, "sandbox.run", id).await.is_empty(), "a denied task never runs");

    // agent-2 may use light only.
    let (s, v) =
        post(&app, &app.other_agent, json!({"command": ["true"], "mode": "agent", "requested_tier": "standard"})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let other = Uuid::parse_str(v["id"].as_str().unwrap()).unwrap();
    crate::support::wait_db(&app, other, TaskState::Denied).await;
    let decisions = store::decisions_of(&app.pool, other).await.unwrap();
    assert!(decisions[0].reason.contains("may use only light"), "{}", decisions[0].reason);

    // An agent sees only its own tasks.
    let (s, _) = app.call("GET", &format!("{}/v1/tasks/{other}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn platform_mode_uses_kind_size_and_history(pool: PgPool) {
    let (app, dir) = start(
        pool,
        &[
            ("AIRLOCK__SANDBOX__PLATFORM__KINDS__LINT", "light"),
            ("AIRLOCK__SANDBOX__PLATFORM__HISTORY_MIN_SAMPLES", "2"),
        ],
    )
    .await;
    let (stop, worker) = app.start_worker("w-platform");

    // The platform ignores the agent's request and applies its rules.
    let lint =
        create(&app, json!({"command": ["true"], "mode": "platform", "kind": "lint", "requested_tier": "standard"}))
            .await;
    let v = wait_state(&app, lint, TaskState::Succeeded).await;
    let d = &v["decision"];
    assert_eq!(
        (d["chosen"].as_str(), d["chooser"].as_str(), d["requested"].as_str()),
        (Some("light"), Some("platform"), Some("standard"))
    );
    assert!(d["reason"].as_str().unwrap().contains("kind `lint`"), "{d}");

    let small = create(&app, json!({"command": ["true"], "mode": "platform", "size": "small"})).await;
    assert_eq!(wait_state(&app, small, TaskState::Succeeded).await["decision"]["chosen"], "light");

    // No rule applies to `build` yet: the default tier, twice; then history right-sizes it.
    for _ in 0..2 {
        let id =
            create(&app, json!({"command": ["sh", "-c", "echo built"], "mode": "platform", "kind": "build"})).await;
        let v = wait_state(&app, id, TaskState::Succeeded).await;
        assert_eq!(v["decision"]["chosen"], "standard");
        assert!(v["decision"]["reason"].as_str().unwrap().contains("default tier"), "{}", v["decision"]);
    }
    let id = create(&app, json!({"command": ["sh", "-c", "echo built"], "mode": "platform", "kind": "build"})).await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    assert_eq!(v["decision"]["chosen"], "light");
    assert!(v["decision"]["reason"].as_str().unwrap().starts_with("history: 2 similar tasks"), "{}", v["decision"]);

    // A large task maps to heavy, which a machine may not grant: it goes to an operator.
    let large = create(&app, json!({"command": ["true"], "mode": "platform", "size": "large"})).await;
    let v = wait_state(&app, large, TaskState::AwaitingChoice).await;
    assert_eq!(v["decision"]["verdict"], "escalated");
    assert!(v["decision"]["reason"].as_str().unwrap().contains("size large"), "{}", v["decision"]);

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn human_mode_waits_for_an_operator_whose_choice_resumes_the_task(pool: PgPool) {
    let (app, dir) = start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-human");

    let id = create(
        &app,
        json!({"command": ["sh", "-c", "echo $AIRLOCK_TIER"], "mode": "human", "requested_tier": "light",
                                 "reason": "needs a person"}),
    )
    .await;
    let v = wait_state(&app, id, TaskState::AwaitingChoice).await;
    assert_eq!(
        (v["decision"]["verdict"].as_str(), v["decision"]["chooser"].as_str()),
        (Some("escalated"), Some("platform"))
    );
    assert!(jobs_of(&app.pool, "sandbox.run", id).await.is_empty(), "nothing runs before the choice");

    // The admin queue shows it.
    let (s, q) = app
        .call("GET", &format!("{}/admin/v1/tasks?state=awaiting_choice", app.admin), Some(&app.operator), None)
        .await;
    assert_eq!(s, StatusCode::OK, "{q}");
    assert_eq!(q["items"].as_array().unwrap().len(), 1);
    assert_eq!(q["items"][0]["id"], id.to_string());

    // Refusals leave nothing behind.
    let decisions_before = store::decisions_of(&app.pool, id).await.unwrap().len();
    let (s, _) = choose(&app, &app.reviewer, id, json!({"tier": "light"})).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "a reviewer cannot choose tiers");
    let (s, v) = choose(&app, &app.operator, id, json!({"tier": "enormous", "note": "bigger"})).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION")), "{v}");
    let (s, _) = choose(&app, &app.operator, id, json!({"deny": true})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a refusal needs a note");
    assert_eq!(store::decisions_of(&app.pool, id).await.unwrap().len(), decisions_before);

    // The operator picks standard; the task resumes and runs there.
    let (s, v) = choose(&app, &app.operator, id, json!({"tier": "standard", "note": "standard is fine"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "queued");
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let d = &v["decision"];
    assert_eq!(
        (
            d["requested"].as_str(),
            d["chosen"].as_str(),
            d["mode"].as_str(),
            d["chooser"].as_str(),
            d["reason"].as_str()
        ),
        (Some("light"), Some("standard"), Some("human"), Some("human:otto"), Some("standard is fine"))
    );
    assert_eq!(v["output"]["stdout"], "standard\n");
    assert_eq!(v["outcome"]["exit_code"], 0);

    // Once chosen, it cannot be chosen again.
    let (s, v) = choose(&app, &app.operator, id, json!({"tier": "light", "note": "again"})).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("INVALID_TRANSITION")));

    // The choice is audited.
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action = 'sandbox.choose' AND target_id = $1 AND actor = 'otto'",
    )
    .bind(id.to_string())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);

    // An operator can also refuse, with a note.
    let other = create(&app, json!({"command": ["true"], "mode": "human"})).await;
    wait_state(&app, other, TaskState::AwaitingChoice).await;
    let (s, v) = choose(&app, &app.operator, other, json!({"deny": true, "note": "not today"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let v = view(&app, other).await;
    assert_eq!(v["state"], "denied");
    assert_eq!(
        (v["decision"]["verdict"].as_str(), v["decision"]["chooser"].as_str()),
        (Some("denied"), Some("human:otto"))
    );

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn hybrid_enforces_bounds_escalates_exceptions_and_the_report_shows_over_provisioning(pool: PgPool) {
    // light reserves 5 minutes, standard 30: a quota of 12 holds light but not standard.
    let (app, dir) = start(pool, &[("AIRLOCK__SANDBOX__AGENTS__AGENT-1__QUOTA_MINUTES_PER_DAY", "12")]).await;
    let (stop, worker) = app.start_worker("w-hybrid");

    // Within bounds: the agent's proposal stands.
    let ok = create(&app, json!({"command": ["true"], "mode": "hybrid", "requested_tier": "light"})).await;
    let v = wait_state(&app, ok, TaskState::Succeeded).await;
    assert_eq!(
        (v["decision"]["chosen"].as_str(), v["decision"]["chooser"].as_str()),
        (Some("light"), Some("agent:agent-1"))
    );

    // Over the quota: escalated, not denied.
    let over_quota = create(&app, json!({"command": ["true"], "mode": "hybrid", "requested_tier": "standard"})).await;
    let v = wait_state(&app, over_quota, TaskState::AwaitingChoice).await;
    assert!(v["decision"]["reason"].as_str().unwrap().contains("quota"), "{}", v["decision"]);

    // Not an allowed tier (and one that needs approval): escalated to an operator, who
    // approves heavy. A one-liner on heavy is what the report must call over-provisioned.
    let heavy = create(
        &app,
        json!({"command": ["sh", "-c", "echo small job"], "mode": "hybrid", "requested_tier": "heavy",
                                    "reason": "I think this is big"}),
    )
    .await;
    let v = wait_state(&app, heavy, TaskState::AwaitingChoice).await;
    assert_eq!(v["decision"]["verdict"], "escalated");
    let (s, v) = choose(&app, &app.operator, heavy, json!({"tier": "heavy", "note": "approved"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let v = wait_state(&app, heavy, TaskState::Succeeded).await;
    assert_eq!((v["decision"]["chosen"].as_str(), v["decision"]["mode"].as_str()), (Some("heavy"), Some("hybrid")));

    let (s, r) = app.call("GET", &format!("{}/admin/v1/sandbox/report", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let over = r["over_provisioned"].as_array().unwrap();
    assert_eq!(over.len(), 1, "{r}");
    assert_eq!(over[0]["task_id"], heavy.to_string());
    assert_eq!((over[0]["tier"].as_str(), over[0]["suggested_tier"].as_str()), (Some("heavy"), Some("light")));
    assert_eq!(over[0]["chooser"], "human:otto");
    let row = r["rows"].as_array().unwrap().iter().find(|x| x["tier"] == "heavy").unwrap();
    assert_eq!(
        (row["mode"].as_str(), row["runs"].as_u64(), row["over_provisioned"].as_u64()),
        (Some("hybrid"), Some(1), Some(1))
    );
    assert!(r["under_provisioned"].as_array().unwrap().is_empty());

    // Every decision is in the log, newest first, with outcomes where there was a run.
    let (s, page) =
        app.call("GET", &format!("{}/admin/v1/sandbox/decisions?limit=2", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{page}");
    let first = page["items"].as_array().unwrap().clone();
    assert_eq!(first.len(), 2);
    assert_eq!(first[0]["task_id"], heavy.to_string(), "newest first: the operator's choice");
    assert_eq!(first[0]["outcome"]["exit_code"], 0);
    let next = page["next"].as_str().unwrap();
    let (_, page) = app
        .call(
            "GET",
            &format!("{}/admin/v1/sandbox/decisions?limit=100&cursor={next}", app.admin),
            Some(&app.operator),
            None,
        )
        .await;
    let rest = page["items"].as_array().unwrap();
    assert_eq!(first.len() + rest.len(), 4, "light chosen, standard escalated, heavy escalated, heavy chosen");
    assert_eq!(page["next"], Value::Null);

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_run_over_its_tier_memory_or_time_is_stopped_recorded_and_not_retried(pool: PgPool) {
    let (app, dir) = start(
        pool,
        &[
            ("AIRLOCK__SANDBOX__TIERS__LIGHT__MEMORY_MB", "64"),
            ("AIRLOCK__SANDBOX__TIERS__BRIEF__CPUS", "1"),
            ("AIRLOCK__SANDBOX__TIERS__BRIEF__MEMORY_MB", "256"),
            ("AIRLOCK__SANDBOX__TIERS__BRIEF__TIMEOUT_SECONDS", "1"),
            ("AIRLOCK__SANDBOX__TIERS__BRIEF__COST_PER_MINUTE", "0.02"),
            ("AIRLOCK__SANDBOX__AGENTS__AGENT-1__ALLOWED_TIERS", "light,brief,standard"),
        ],
    )
    .await;
    let (stop, worker) = app.start_worker("w-limits");

    // Processes of this test only carry its marker: a `sleep` of a duration no other test
    // uses (so another suite's sleeps running beside it are never counted).
    let nap = format!("30.{}", Uuid::new_v4().as_u128() % 1_000_000_000);
    let slow = create(
        &app,
        json!({"command": ["sh", "-c", format!("sleep {nap} & sleep {nap}")], "mode": "agent", "requested_tier": "brief"}),
    )
    .await;
    let hungry = create(
        &app,
        json!({"command": ["sh", "-c", "head -c 400000000 /dev/zero | tail"], "mode": "agent", "requested_tier": "light"}),
    )
    .await;

    let v = wait_state(&app, slow, TaskState::TimedOut).await;
    let o = &v["outcome"];
    assert_eq!((o["timed_out"].as_bool(), o["killed_for"].as_str()), (Some(true), Some("timeout")), "{o}");
    let ms = o["duration_ms"].as_u64().unwrap();
    assert!((1000..5000).contains(&ms), "stopped at the tier's timeout, took {ms} ms");

    let v = wait_state(&app, hungry, TaskState::Failed).await;
    let o = &v["outcome"];
    assert_eq!((o["timed_out"].as_bool(), o["killed_for"].as_str()), (Some(false), Some("memory")), "{o}");
    assert!(o["peak_rss_kib"].as_u64().unwrap() > 64 * 1024, "{o}");
    assert_eq!(o["exit_code"], Value::Null, "killed by a signal");
    assert_eq!(o["signal"], 9);

    // Recorded, not retried: one start, one attempt, the job completed.
    for id in [slow, hungry] {
        let jobs = jobs_of(&app.pool, "sandbox.run", id).await;
        assert_eq!(jobs.len(), 1);
        assert_eq!((jobs[0].state, jobs[0].attempt), (JobState::Completed, 1));
        assert_eq!(store::runs_of(&app.pool, id).await.unwrap().len(), 1);
    }

    // The review calls both under-provisioned and suggests a larger tier.
    let (s, r) = app.call("GET", &format!("{}/admin/v1/sandbox/report", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK);
    let under = r["under_provisioned"].as_array().unwrap();
    assert_eq!(under.len(), 2, "{r}");
    let find = |id: Uuid| under.iter().find(|f| f["task_id"] == id.to_string()).unwrap().clone();
    assert_eq!(
        (find(slow)["killed_for"].as_str(), find(slow)["suggested_tier"].as_str()),
        (Some("timeout"), Some("light"))
    );
    assert_eq!(
        (find(hungry)["killed_for"].as_str(), find(hungry)["suggested_tier"].as_str()),
        (Some("memory"), Some("brief"))
    );

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
    // The killed runs left no process behind: their sandboxes' PID namespaces are gone.
    let left = crate::support::processes_with(&format!("sleep\0{nap}"));
    assert!(left.is_empty(), "a killed run's process survived: {left:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn bad_input_leaves_no_rows_and_scopes_decide_context_and_secrets(pool: PgPool) {
    let keyring = std::env::temp_dir().join(format!("airlock-keyring-{}", Uuid::new_v4()));
    std::fs::write(&keyring, "API_TOKEN=s3cret-value\n").unwrap();
    let keyring_path = keyring.display().to_string();
    let (app, dir) = start(
        pool,
        &[
            ("AIRLOCK__CAPSULES__KEYRING_FILE", keyring_path.as_str()),
            ("AIRLOCK__SANDBOX__AGENTS__AGENT-1__SECRETS", "API_TOKEN,MISSING_TOKEN"),
        ],
    )
    .await;

    for body in [
        json!({}),
        json!({"command": []}),
        json!({"command": [""]}),
        json!({"command": ["true"], "mode": "boss"}),
        json!({"command": ["true"], "requested_tier": "enormous"}),
        json!({"command": ["true"], "effect": "non_repeatable"}),
        json!({"command": ["true"], "env": {"API_TOKEN": "literal"}}),
        json!({"command": ["true"], "env": {"AIRLOCK_TIER": "x"}}),
        json!({"command": ["true"], "secrets": ["not a name"]}),
        // Nothing that steers how programs load or are found, as a literal or a secret.
        json!({"command": ["true"], "env": {"LD_PRELOAD": "/task/evil.so"}}),
        json!({"command": ["true"], "env": {"PATH": "/task/bin"}}),
        json!({"command": ["true"], "env": {"BASH_ENV": "/task/rc"}}),
        json!({"command": ["true"], "secrets": ["LD_LIBRARY_PATH"]}),
        json!({"command": ["true"], "size": "huge"}),
        json!({"command": ["true"], "surprise": 1}),
        json!({"command": "true"}),
    ] {
        let (s, v) = post(&app, &app.agent, body.clone()).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION")), "{body} -> {v}");
    }
    let (s, _) = post(&app, &app.operator, json!({"command": ["true"]})).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "only agents submit tasks");
    let (tasks, decisions, jobs): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM sandbox_tasks), (SELECT count(*) FROM sandbox_decisions), (SELECT count(*) FROM jobs)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((tasks, decisions, jobs), (0, 0, 0), "no row written by any refused request");

    let (stop, worker) = app.start_worker("w-scopes");
    let run = app.create_run(0).await;

    // Its own context, and a secret in its scope that the keyring holds.
    let id = create(
        &app,
        json!({"command": ["sh", "-c", "echo \"$API_TOKEN|$GREETING\"; cat \"$AIRLOCK_CONTEXT_DIR/agent-1/runs.json\"; \
                                        echo; env | cut -d= -f1 | sort | tr '\\n' ' '"],
               "mode": "hybrid", "requested_tier": "light", "context": ["agent-1"], "secrets": ["API_TOKEN"],
               "env": {"GREETING": "hello"}}),
    )
    .await;
    let v = wait_state(&app, id, TaskState::Succeeded).await;
    let out = v["output"]["stdout"].as_str().unwrap();
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("s3cret-value|hello"));
    assert!(out.contains(&run), "the agent's context (its runs) is mounted: {out}");
    let names = out.lines().last().unwrap();
    for leaked in ["DATABASE_URL", "CARGO_MANIFEST_DIR", "RUST_BACKTRACE"] {
        assert!(!names.split(' ').any(|n| n == leaked), "{leaked} leaked into the sandbox: {names}");
    }
    // Reviewers see secret names, never values (only the command's own output holds one here).
    let (_, admin_view) =
        app.call("GET", &format!("{}/admin/v1/tasks/{id}", app.admin), Some(&app.operator), None).await;
    assert_eq!(admin_view["secrets"], json!(["API_TOKEN"]));
    let mut without_output = admin_view.clone();
    without_output["output"] = Value::Null;
    assert!(!without_output.to_string().contains("s3cret-value"), "{without_output}");

    // Another agent's context, or a secret outside its scope: denied, and logged.
    for body in [
        json!({"command": ["true"], "mode": "hybrid", "requested_tier": "light", "context": ["agent-2"]}),
        json!({"command": ["true"], "mode": "human", "secrets": ["OTHER_TOKEN"]}),
    ] {
        let id = create(&app, body).await;
        let v = wait_state(&app, id, TaskState::Denied).await;
        assert!(v["decision"]["reason"].as_str().unwrap().contains("scope"), "{}", v["decision"]);
    }

    // A secret in scope that this worker's keyring lacks: the run cannot start; it fails
    // with the reason and the command never runs.
    let id = create(
        &app,
        json!({"command": ["true"], "mode": "agent", "requested_tier": "light", "secrets": ["MISSING_TOKEN"]}),
    )
    .await;
    let v = wait_state(&app, id, TaskState::Failed).await;
    assert!(v["error"].as_str().unwrap().contains("MISSING_TOKEN"), "{v}");
    assert_eq!((v["outcome"].clone(), v["run_count"].as_i64()), (Value::Null, Some(0)), "it never started");

    stop.cancel();
    worker.await.unwrap().unwrap();
    assert_invariants(&app.pool).await;
    assert_clean(&dir);
    let _ = std::fs::remove_file(keyring);
}
