//! `airlock-admin replay-eval`, a real process against a recorded run and a scripted
//! OpenAI-compatible server that answers like the recorded model except at one known
//! step: that step, and only it, is reported `diverged`; nothing of the run changes.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::time::Duration;

use airlock_tests::app::TestApp;
use airlock_tests::harness;
use airlock_tests::model::{ModelServer, Reply};
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

/// A recorded decision: the request (OpenAI chat form) and the answer recorded for it.
fn decision(question: &str, answer: &Value) -> Value {
    json!({
        "request": {"model": "recorded-model", "messages": [
            {"role": "system", "content": "Answer with one airlock.action.v1 JSON object."},
            {"role": "user", "content": question}]},
        "response": {"choices": [{"message": {"role": "assistant", "content": answer.to_string()}}]},
    })
}

/// Runs `airlock-admin` with `args` to its end, without blocking this runtime (the model
/// server runs in it); its exit code and stdout.
async fn admin(app: &TestApp, args: &[&str]) -> (i32, String) {
    let mut child = harness::spawn("airlock-admin", args, &app.db_url, &[]);
    let status = harness::wait_for("airlock-admin to exit", Duration::from_secs(60), || {
        let s = child.try_wait().unwrap();
        async move { s }
    })
    .await;
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    (status.code().unwrap_or(-1), out)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_step_where_the_new_model_diverges_and_only_it_is_reported(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let answers = [
        ("q1", json!({"type": "tool_call", "tool_id": "memory.read", "arguments": {}})),
        ("q2", json!({"type": "tool_call", "tool_id": "journal.search", "arguments": {"query": "invoices"}})),
        ("q3", json!({"type": "final", "text": "All done."})),
    ];
    for (i, (q, a)) in answers.iter().enumerate() {
        let body =
            json!({"epoch": 1, "step_id": format!("m{}", i + 1), "kind": "model_output", "data": decision(q, a)});
        let (s, v) = app.call("POST", &format!("{}/v1/runs/{run}/steps", app.api), Some(&app.agent), Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let body = json!({"epoch": 1, "step_id": format!("t{}", i + 1), "kind": "tool_result", "data": {"n": i}});
        app.call("POST", &format!("{}/v1/runs/{run}/steps", app.api), Some(&app.agent), Some(body)).await;
    }
    // A decision recorded without its request cannot be asked again: it is left out.
    let body = json!({"epoch": 1, "step_id": "m4", "kind": "model_output", "data": {"text": "no request"}});
    app.call("POST", &format!("{}/v1/runs/{run}/steps", app.api), Some(&app.agent), Some(body)).await;
    let before: (i64, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_steps WHERE run_id = $1::uuid), (SELECT updated_at FROM runs WHERE id = $1::uuid)",
    )
    .bind(&run)
    .fetch_one(&app.pool)
    .await
    .unwrap();

    // The new model answers as the recorded one did, but for q2, where it ends instead —
    // with the same words in another key order and spacing elsewhere (still the same action).
    let model = ModelServer::start().await.unwrap();
    model.respond_with(|req| {
        let q = req["messages"].as_array().and_then(|m| m.last()).and_then(|m| m["content"].as_str()).unwrap_or("");
        match q {
            "q1" => Reply::text(r#"{"arguments": {}, "tool_id": "memory.read", "type": "tool_call"}"#),
            "q2" => Reply::action(json!({"type": "final", "text": "Nothing to search."})),
            "q3" => Reply::text("  {\"type\":\"final\",\"text\":\"All done.\"}\n"),
            _ => Reply::Status(500),
        }
    });
    let (code, out) =
        admin(&app, &["replay-eval", "--run", &run, "--endpoint", &model.endpoint(), "--model", "candidate", "--json"])
            .await;
    assert_eq!(code, 0, "{out}");
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    let verdicts: Vec<(&str, &str)> = report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step_id"].as_str().unwrap(), s["verdict"].as_str().unwrap()))
        .collect();
    assert_eq!(verdicts, vec![("m1", "same"), ("m2", "diverged"), ("m3", "same")], "{report}");
    assert_eq!(report["steps"][1]["recorded"]["tool_id"], "journal.search");
    assert_eq!(report["steps"][1]["candidate"]["type"], "final");
    assert_eq!((report["same"].clone(), report["diverged"].clone()), (json!(2), json!(1)));
    // Each decision was asked with its recorded messages, of the model named.
    let asked = model.requests();
    assert_eq!(asked.len(), 3);
    assert!(asked.iter().all(|r| r["model"] == "candidate" && r["messages"][0]["role"] == "system"));

    // The same as lines.
    let (code, out) =
        admin(&app, &["replay-eval", "--run", &run, "--endpoint", &model.endpoint(), "--model", "candidate"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("step m1 (seq 1): same") && out.contains("step m2 (seq 3): diverged"), "{out}");
    assert!(out.contains("3 decisions: 2 same, 1 diverged"), "{out}");

    // Nothing of the run changed.
    let after: (i64, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_steps WHERE run_id = $1::uuid), (SELECT updated_at FROM runs WHERE id = $1::uuid)",
    )
    .bind(&run)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(after, before, "replay-eval writes nothing");

    // Only a loopback endpoint is asked.
    for bad in ["http://localhost:1", "https://127.0.0.1:1", "http://10.0.0.1:1"] {
        let (code, _) = admin(&app, &["replay-eval", "--run", &run, "--endpoint", bad, "--model", "m"]).await;
        assert_ne!(code, 0, "{bad}");
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_recorded_turn_replays_and_the_round_where_the_fake_diverges_is_reported(pool: PgPool) {
    let (app, model, _w) = crate::turns::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let call = |q: &str| json!({"type": "tool_call", "tool_id": "journal.search", "arguments": {"query": q}});
    model.push([
        Reply::action(call("one")),
        Reply::action(call("two")),
        Reply::action(json!({"type": "final", "text": "done"})),
    ]);
    let body = json!({"step_id": "t", "model": "local", "input": "Look twice.", "tools": ["journal.search"]});
    let id = crate::turns::new_turn(&app, &run, body).await;
    let t = crate::turns::wait_turn(&app, &id, &["completed", "failed", "model_protocol_error"]).await;
    assert_eq!(t["state"], "completed", "{t}");

    // The candidate answers each recorded request as the recorded model did, but round 2.
    let fake = ModelServer::start().await.unwrap();
    fake.respond_with(move |req| {
        let answers = req["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "assistant").count();
        match answers {
            0 => Reply::action(call("one")),
            1 => Reply::action(json!({"type": "final", "text": "enough"})),
            _ => Reply::action(json!({"type": "final", "text": "done"})),
        }
    });
    let (code, out) =
        admin(&app, &["replay-eval", "--run", &run, "--endpoint", &fake.endpoint(), "--model", "candidate", "--json"])
            .await;
    assert_eq!(code, 0, "{out}");
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    let verdicts: Vec<(&str, &str)> = report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step_id"].as_str().unwrap(), s["verdict"].as_str().unwrap()))
        .collect();
    assert_eq!(verdicts, vec![("t/r1/model", "same"), ("t/r2/model", "diverged"), ("t/r3/model", "same")], "{report}");
    // Each round was asked with the request the turn recorded for it.
    let recorded = model.requests();
    let asked = fake.requests();
    assert_eq!(asked.len(), 3);
    for (a, r) in asked.iter().zip(&recorded) {
        assert_eq!(a["messages"], r["messages"]);
    }
}
