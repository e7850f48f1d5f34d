//! Limits an agent cannot lift and suppressions: a submission past a rolling window is a
//! 429 with `Retry-After` and writes nothing; a suppressed recipient is refused at
//! submission and, when suppressed after approval, fails at send time with nothing sent.
//! Windows are exercised with real timestamps (rows moved back in time), never by waiting.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

/// Everything a submission writes, counted.
async fn written(pool: &PgPool) -> Vec<i64> {
    let mut out = Vec::new();
    for sql in [
        "SELECT count(*) FROM deliveries",
        "SELECT count(*) FROM delivery_events",
        "SELECT count(*) FROM delivery_recipients",
        "SELECT count(*) FROM artifacts",
        "SELECT count(*) FROM jobs",
        "SELECT count(*) FROM run_steps",
        "SELECT coalesce(sum(used_steps), 0)::bigint FROM runs",
        "SELECT count(*) FROM audit_log",
    ] {
        out.push(sqlx::query_scalar(sql).fetch_one(pool).await.unwrap());
    }
    out
}

/// Submits as `token`; the status, the body and the `Retry-After` header.
async fn submit_as(app: &TestApp, token: &str, body: Value) -> (StatusCode, Value, Option<u64>) {
    let resp = app.http.post(format!("{}/v1/deliveries", app.api)).bearer_auth(token).json(&body).send().await.unwrap();
    let status = resp.status();
    let after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
    (status, resp.json().await.unwrap_or(Value::Null), after)
}

async fn run_of(app: &TestApp, token: &str) -> String {
    let (s, v) =
        app.call("POST", &format!("{}/v1/runs", app.api), Some(token), Some(json!({"budget": {"max_steps": 0}}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn email_to(run: &str, step: &str, to: &[&str]) -> Value {
    let mut e = TestApp::email(run, step, "Your order");
    e["email"]["to"] = json!(to);
    e
}

/// Moves every row of the window back by `minutes`, as if that much time had passed.
async fn age(pool: &PgPool, minutes: i32) {
    sqlx::query("UPDATE deliveries SET created_at = created_at - make_interval(mins => $1)")
        .bind(minutes)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE delivery_recipients SET created_at = created_at - make_interval(mins => $1)")
        .bind(minutes)
        .execute(pool)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_agent_past_its_hourly_limit_is_answered_429_and_nothing_is_written(pool: PgPool) {
    let app = TestApp::start(
        pool,
        &[
            ("AIRLOCK__LIMITS__DELIVERIES_PER_HOUR", "3"),
            ("AIRLOCK__LIMITS__AGENTS__AGENT-2__DELIVERIES_PER_HOUR", "1"),
        ],
    )
    .await;
    let run = run_of(&app, &app.agent).await;
    for i in 0..2 {
        let (s, v, _) = submit_as(&app, &app.agent, app.webhook(&run, &format!("w{i}"), i)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (s, v, _) = submit_as(&app, &app.agent, TestApp::email(&run, "e0", "Hello")).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // The fourth in the hour, email or webhook: refused, with a time to come back, and
    // nothing of it is anywhere.
    let before = written(&app.pool).await;
    for body in [app.webhook(&run, "w9", 9), TestApp::email(&run, "e9", "Hello again")] {
        let (s, v, after) = submit_as(&app, &app.agent, body).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
        assert_eq!(v["error"]["code"], "RATE_LIMITED", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("limits.deliveries_per_hour"), "{v}");
        let after = after.expect("Retry-After");
        assert!((3500..=3600).contains(&after), "Retry-After {after}");
    }
    assert_eq!(written(&app.pool).await, before, "a refused submission wrote something");

    // A repeated submission of a step that has its delivery is not a new one.
    let (s, v, _) = submit_as(&app, &app.agent, TestApp::email(&run, "e0", "Hello")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Another agent has a window of its own, with its own limit.
    let other = run_of(&app, &app.other_agent).await;
    let (s, v, _) = submit_as(&app, &app.other_agent, app.webhook(&other, "o1", 1)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v, _) = submit_as(&app, &app.other_agent, app.webhook(&other, "o2", 2)).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");

    // Twenty minutes later the oldest is still in the window; an hour later it is not,
    // and the Retry-After said so.
    age(&app.pool, 20).await;
    let (s, _, after) = submit_as(&app, &app.agent, app.webhook(&run, "w9", 9)).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!((2300..=2400).contains(&after.unwrap()), "{after:?}");
    age(&app.pool, 41).await;
    let (s, v, _) = submit_as(&app, &app.agent, app.webhook(&run, "w9", 9)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn one_address_gets_at_most_its_daily_emails_across_agents(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__LIMITS__PER_RECIPIENT_PER_DAY", "2")]).await;
    let run = run_of(&app, &app.agent).await;
    let other = run_of(&app, &app.other_agent).await;
    let (s, v, _) = submit_as(&app, &app.agent, email_to(&run, "a", &["alice@example.org", "bob@example.org"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // The same address, however its domain is written, from another agent.
    let (s, v, _) = submit_as(&app, &app.other_agent, email_to(&other, "b", &["alice@EXAMPLE.org"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    let before = written(&app.pool).await;
    let (s, v, after) =
        submit_as(&app, &app.agent, email_to(&run, "c", &["carol@example.org", "Alice@example.org"])).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["error"]["code"], "RATE_LIMITED");
    assert!(v["error"]["message"].as_str().unwrap().contains("alice@example.org"), "{v}");
    assert!((86_000..=86_400).contains(&after.unwrap()), "{after:?}");
    assert_eq!(written(&app.pool).await, before, "a refused submission wrote something");

    // Others are not held back: bob had one, carol none; webhooks have no recipients.
    let (s, v, _) = submit_as(&app, &app.agent, email_to(&run, "d", &["bob@example.org", "carol@example.org"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v, _) = submit_as(&app, &app.agent, app.webhook(&run, "w", 1)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // A day later alice may be written to again.
    age(&app.pool, 24 * 60 + 1).await;
    let (s, v, _) = submit_as(&app, &app.agent, email_to(&run, "c", &["carol@example.org", "Alice@example.org"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

async fn suppress(app: &TestApp, token: &str, body: Value) -> (StatusCode, Value) {
    app.call("POST", &format!("{}/admin/v1/suppressions", app.admin), Some(token), Some(body)).await
}

async fn audit_count(app: &TestApp, action: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = $1")
        .bind(action)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn suppressed_recipients_are_refused_at_submission_and_never_sent(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-suppress");
    let run = app.create_run(0).await;

    // Two deliveries approved while the send switch is off: one to bob, one to alice.
    let to_bob = app.submit(email_to(&run, "bob", &["bob@example.org"])).await;
    let to_alice = app.submit(email_to(&run, "alice", &["alice@example.org"])).await;
    for id in [&to_bob, &to_alice] {
        app.wait_state(id, DeliveryState::AwaitingApproval, WAIT).await;
        app.approve(id).await;
    }

    // Only operators suppress; a suppression names one recipient and a reason.
    for token in [&app.agent, &app.reviewer] {
        let (s, _) = suppress(&app, token, json!({"address": "bob@example.org", "reason": "bounced"})).await;
        assert!(s == StatusCode::FORBIDDEN || s == StatusCode::UNAUTHORIZED, "{s}");
    }
    for bad in [
        json!({"address": "bob@example.org"}),
        json!({"address": "bob@example.org", "domain": "example.org", "reason": "x"}),
        json!({"reason": "x"}),
        json!({"address": "Bob <bob@example.org>", "reason": "x"}),
        json!({"domain": "exa mple.org", "reason": "x"}),
        json!({"address": "bob@example.org", "reason": "x\u{0}"}),
    ] {
        let (s, v) = suppress(&app, &app.operator, bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad} {v}");
    }
    assert_eq!(audit_count(&app, "suppression.create").await, 0);
    let (s, bob) = suppress(&app, &app.operator, json!({"address": "BOB@example.org", "reason": "hard bounce"})).await;
    assert_eq!(s, StatusCode::CREATED, "{bob}");
    assert_eq!(bob["value"], "bob@example.org");
    let (s, again) = suppress(&app, &app.operator, json!({"address": "bob@Example.org", "reason": "again"})).await;
    assert_eq!((s, &again["id"]), (StatusCode::OK, &bob["id"]));
    let (s, dom) = suppress(&app, &app.operator, json!({"domain": "@Blocked.example", "reason": "complaints"})).await;
    assert_eq!(s, StatusCode::CREATED, "{dom}");
    assert_eq!(audit_count(&app, "suppression.create").await, 2);

    // At submission: an address (in cc too), a domain and the domains under it; nothing written.
    let before = written(&app.pool).await;
    for (step, to, cc) in [
        ("s1", vec!["bob@example.org"], vec![]),
        ("s2", vec!["alice@example.org"], vec!["Bob@EXAMPLE.ORG"]),
        ("s3", vec!["x@blocked.example"], vec![]),
        ("s4", vec!["x@mail.blocked.example"], vec![]),
    ] {
        let mut body = email_to(&run, step, &to);
        body["email"]["cc"] = json!(cc);
        let (s, v, _) = submit_as(&app, &app.agent, body).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert_eq!(v["error"]["code"], "RECIPIENT_SUPPRESSED", "{v}");
    }
    assert_eq!(written(&app.pool).await, before, "a refused submission wrote something");
    // A domain that merely ends the same way is another domain.
    let (s, v, _) = submit_as(&app, &app.agent, email_to(&run, "s5", &["x@notblocked.example"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");

    // At send time: bob's delivery, approved before, fails in transaction A; alice's goes.
    app.set_switch(true).await;
    let failed = app.wait_state(&to_bob, DeliveryState::Failed, WAIT).await;
    app.wait_state(&to_alice, DeliveryState::Sent, WAIT).await;
    let accepted = app.smtp.wait_for(1, WAIT).await;
    assert_eq!(accepted.len(), 1, "exactly alice's message reaches the relay");
    assert!(accepted.iter().all(|m| !m.rcpt_to.iter().any(|r| r.to_lowercase().contains("bob@"))), "{accepted:?}");
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM send_attempts WHERE delivery_id = $1::uuid")
        .bind(&to_bob)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(attempts, 0, "no attempt was started for a suppressed recipient");
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM delivery_events WHERE delivery_id = $1::uuid AND to_state = 'failed'")
            .bind(&to_bob)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(reason.contains("bob@example.org is suppressed"), "{reason} {failed}");

    // Lifting is audited, once; then bob may be written to again.
    let url = format!("{}/admin/v1/suppressions/{}?reason=resolved", app.admin, bob["id"].as_str().unwrap());
    let (s, v) = app.call("DELETE", &url, Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["lifted_at"].is_string());
    let (s, _) = app.call("DELETE", &url, Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(audit_count(&app, "suppression.lift").await, 1);
    let (s, list) = app.call("GET", &format!("{}/admin/v1/suppressions", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
    let (s, v, _) = submit_as(&app, &app.agent, email_to(&run, "s1", &["bob@example.org"])).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(airlock_core::audit::verify(&app.pool).await.unwrap(), None);

    stop.cancel();
    worker.await.unwrap().unwrap();
}
