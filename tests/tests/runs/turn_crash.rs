//! Crash convergence of agent turns: a real worker process is killed (the process aborts
//! on the spot, as with SIGKILL) at every step boundary of a scripted four-round turn —
//! each boundary at each round it is met —, and a second worker takes the turn over. Every
//! time the turn ends as a run without the crash does, the model is asked once per round
//! (twice only for the round whose reply was lost before it was recorded), an idempotent
//! tool is re-issued only with the same key, and each delivery exists once.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use airlock_core::fault::TURN_POINTS;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use airlock_tests::model::{ModelServer, Reply};
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::turns::{get_turn, new_turn, turn_env, wait_turn};

/// Each boundary, with the hits of it that fall in the scripted turn (the rounds at which
/// it is met).
const MATRIX: &[(&str, u32)] = &[
    ("turn.model.replied", 4),
    ("turn.model.recorded", 4),
    ("turn.tool.begun", 3),
    ("turn.tool.called", 3),
    ("turn.tool.result", 3),
    ("turn.deliver.submitted", 1),
];

#[test]
fn every_turn_fault_point_has_a_row() {
    for p in TURN_POINTS {
        assert!(MATRIX.iter().any(|(m, _)| m == p), "turn fault point `{p}` has no row");
    }
    for (m, _) in MATRIX {
        assert!(TURN_POINTS.contains(m), "`{m}` is not a turn fault point");
    }
}

/// The round a request is for: one more than the answers it carries.
fn round_of(req: &Value) -> usize {
    req["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant").count() + 1
}

fn script(round: usize) -> Reply {
    let a = match round {
        1 => {
            json!({"type": "tool_call", "tool_id": "crm_update", "arguments": {"customer": "ACME", "note": "renewal"}})
        }
        2 => json!({"type": "tool_call", "tool_id": "delivery.email", "arguments": {
            "from": "agent@example.com", "to": ["a@example.org"], "subject": "Renewal", "text": "Your renewal is ready."}}),
        3 => json!({"type": "tool_call", "tool_id": "journal.search", "arguments": {"query": "renewal"}}),
        _ => json!({"type": "final", "text": "Renewal handled."}),
    };
    Reply::action(a)
}

fn worker(app: &TestApp, faults: Option<&str>) -> KillOnDrop {
    let mut env = app.env_pairs();
    if let Some(f) = faults {
        env.push(("AIRLOCK_FAULTS", f));
    }
    KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env))
}

async fn count(pool: &PgPool, sql: &str, run: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).bind(run).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_worker_killed_at_every_boundary_of_a_turn_converges(pool: PgPool) {
    let model = ModelServer::start().await.unwrap();
    model.respond_with(|req| script(round_of(req)));
    let env = turn_env(&model);
    let mut extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    extra.extend([("AIRLOCK__WORKER__RESCUE_INTERVAL_SECONDS", "1")]);
    let app = TestApp::start(pool, &extra).await;
    let mut cases: Vec<(String, &str, u32)> = vec![("no crash".into(), "", 0)];
    for (point, hits) in MATRIX {
        for n in 1..=*hits {
            cases.push((format!("{point}@{n}"), point, n));
        }
    }
    for (case, point, n) in cases {
        let run = app.create_run(0).await;
        let (asked_before, hits_before) = (model.requests().len(), app.hooks.hits().len());
        let mut body = json!({"step_id": "renew", "model": "local", "input": "Renew ACME.",
            "tools": ["crm_update", "delivery.email", "journal.search"],
            "deliver": {"channel": "email", "email": {"from": "agent@example.com", "to": ["b@example.org"], "subject": "Done"}}});
        body["instructions"] = json!(format!("Case {case}."));
        let id = new_turn(&app, &run, body).await;
        if n > 0 {
            let spec = format!("{point}=abort@{n}");
            let mut a = worker(&app, Some(&spec));
            // Waited for without blocking this runtime: the model server runs in it.
            let status = harness::wait_for(&format!("{case}: the worker to die"), Duration::from_secs(60), || {
                let s = a.0.try_wait().unwrap();
                async move { s }
            })
            .await;
            assert!(!status.success(), "{case}: the worker was to die at its fault point");
            assert_ne!(get_turn(&app, &id).await["state"], "completed", "{case}: died before the end");
        }
        let _b = worker(&app, None);
        let t = wait_turn(
            &app,
            &id,
            &["completed", "failed", "cancelled", "model_unavailable", "model_protocol_error", "budget_exhausted"],
        )
        .await;
        assert_eq!(t["state"], "completed", "{case}: {t}");
        assert_eq!(t["final"]["text"], "Renewal handled.", "{case}");
        assert_eq!((t["rounds"].as_i64(), t["tool_calls"].as_i64()), (Some(4), Some(3)), "{case}: {t}");
        assert!(t["delivery_id"].is_string(), "{case}");

        // The model: once a round, twice for the round whose reply died unrecorded.
        let mut per_round: BTreeMap<usize, usize> = BTreeMap::new();
        for r in &model.requests()[asked_before..] {
            *per_round.entry(round_of(r)).or_default() += 1;
        }
        let lost = (point == "turn.model.replied").then_some(n as usize);
        for round in 1..=4 {
            let want = if lost == Some(round) { 2 } else { 1 };
            assert_eq!(per_round.get(&round).copied().unwrap_or(0), want, "{case}: round {round} asked {per_round:?}");
        }
        // The idempotent tool: once, or again with the same key when its outcome was lost.
        let crm: Vec<_> = app.hooks.hits()[hits_before..].iter().filter(|h| h.path == "/crm").cloned().collect();
        let reissued = n == 1 && (point == "turn.tool.begun" || point == "turn.tool.called");
        assert_eq!(crm.len(), if reissued && point == "turn.tool.called" { 2 } else { 1 }, "{case}");
        let keys: std::collections::HashSet<_> = crm.iter().map(|h| h.idempotency_key.clone().unwrap()).collect();
        assert_eq!(keys.len(), 1, "{case}: one key for the call, on every attempt");
        // Each delivery once; the log as one execution writes it.
        assert_eq!(
            count(&app.pool, "SELECT count(*) FROM deliveries WHERE run_id = $1::uuid", &run).await,
            2,
            "{case}"
        );
        let kinds: Vec<(String, i64)> = sqlx::query_as(
            "SELECT kind::text, count(*) FROM run_steps WHERE run_id = $1::uuid GROUP BY kind ORDER BY kind::text",
        )
        .bind(&run)
        .fetch_all(&app.pool)
        .await
        .unwrap();
        let kinds: BTreeMap<String, i64> = kinds.into_iter().collect();
        let want: BTreeMap<String, i64> = [("delivery", 2), ("effect", 1), ("model_output", 4), ("tool_result", 3)]
            .map(|(k, v)| (k.to_string(), v))
            .into();
        assert_eq!(kinds, want, "{case}");
        assert_eq!(
            count(&app.pool, "SELECT count(*) FROM run_effects WHERE run_id = $1::uuid AND event = 'succeeded'", &run)
                .await,
            1,
            "{case}"
        );
    }
}
