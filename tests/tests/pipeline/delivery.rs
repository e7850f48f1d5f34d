//! The delivery pipeline end to end, through HTTP, with real workers, a real SMTP server
//! over STARTTLS (test CA) and a real webhook receiver.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use airlock_delivery::policy;
use airlock_delivery::state::DeliveryState;
use airlock_delivery::store;
use airlock_queue::{self as queue, ClaimFilter};
use airlock_tests::app::TestApp;
use airlock_tests::smtp::Fault;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn happy_path_through_http_waits_for_the_switch_and_sends_once(pool: PgPool) {
    // Scores below 0.99 go to review, so this email takes the accept step.
    let app = TestApp::start(pool, &[("AIRLOCK__SCORING__REVIEW_THRESHOLD", "0.99")]).await;
    let (stop, worker) = app.start_worker("w-happy");

    let run = app.create_run(10).await;
    let mut body = TestApp::email(&run, "draft-1", "Your order has shipped");
    body["email"]["to"] = json!(["bob@unknown.example"]);
    let id = app.submit(body).await;

    let d = app.wait_state(&id, DeliveryState::InReview, WAIT).await;
    assert!(d["score"]["value"].as_f64().unwrap() < 0.99);
    assert!(!d["score"]["reasons"].as_array().unwrap().is_empty(), "the score explains itself");

    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/deliveries/{id}/accept", app.admin),
            Some(&app.reviewer),
            Some(json!({"note": "fine"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "awaiting_approval");
    let d = app.approve(&id).await;
    assert_eq!(d["state"], "approved");

    // The switch is off: the send job exists but cannot be claimed, and nothing goes out.
    let claimable = queue::claim_batch(
        &app.pool,
        "probe",
        &ClaimFilter { queues: Some(vec!["send".into()]) },
        10,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(claimable.is_empty(), "no send may be claimed while the switch is off");
    let d = app.delivery(&id).await;
    assert_eq!(d["state"], "approved", "waits as approved");
    assert!(app.smtp.accepted().is_empty());

    app.set_switch(true).await;
    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    let received = app.smtp.wait_for(1, WAIT).await;
    assert_eq!(received.len(), 1, "exactly one message at the relay");
    let expected_id = policy::message_id(
        d["idempotency_key"].as_str().unwrap(),
        &airlock_delivery::artifact::EmailAddress::parse("agent@example.com").unwrap(),
    );
    assert_eq!(
        received[0].message_id.as_deref().map(|m| m.trim_matches(|c| c == '<' || c == '>')),
        Some(expected_id.trim_matches(|c| c == '<' || c == '>'))
    );
    assert!(received[0].tls, "sent over TLS");
    assert_eq!(received[0].rcpt_to, vec!["bob@unknown.example"]);

    let receipt = &d["receipt"];
    assert_eq!(receipt["channel"], "email");
    assert_eq!(receipt["message_id"], json!(expected_id));
    assert_eq!(receipt["payload_sha256"], d["artifact_sha256"]);
    assert!(receipt["attested_by"].is_null());
    assert!(receipt["provider_response"].as_str().unwrap().starts_with("250"));

    let events: Vec<(String, String)> = d["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["to"].as_str().unwrap().to_string(), e["actor"].as_str().unwrap().to_string()))
        .collect();
    let states: Vec<&str> = events.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(states, ["persisted", "scored", "in_review", "awaiting_approval", "approved", "sending", "sent"]);
    assert_eq!(events[0].1, "agent:agent-1");
    assert!(events[1].1.starts_with("system:scorer"));
    assert_eq!(events[3].1, "reviewer:rita");
    assert_eq!(events[4].1, "reviewer:rita");
    assert_eq!(events[5].1, "worker:w-happy");
    assert_eq!(events[6].1, "worker:w-happy");

    // The agent sees its delivery (without the artifact body), the event chain verifies.
    let (s, v) = app.call("GET", &format!("{}/v1/deliveries/{id}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["state"], "sent");
    assert!(v.get("artifact").is_none());
    let uuid: airlock_core::ids::DeliveryId = id.parse().unwrap();
    let evs = airlock_delivery::store::events(&app.pool, uuid).await.unwrap();
    assert_eq!(airlock_delivery::store::verify_chain(uuid, &evs), None);

    // Every human action is in the audit log.
    let (s, audit) = app.call("GET", &format!("{}/admin/v1/audit", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK);
    let actions: Vec<&str> = audit["items"].as_array().unwrap().iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["send_switch.set", "delivery.approve", "delivery.accept"]);
    assert_eq!(airlock_core::audit::verify(&app.pool).await.unwrap(), None);

    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn submissions_are_idempotent_and_budgeted(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(2).await;
    let url = format!("{}/v1/deliveries", app.api);

    let body = TestApp::email(&run, "s1", "Hello there");
    let (s, first) = app.call("POST", &url, Some(&app.agent), Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(first["state"], "persisted");
    let (s, again) = app.call("POST", &url, Some(&app.agent), Some(body.clone())).await;
    assert_eq!(s, StatusCode::OK, "same artifact: same delivery");
    assert_eq!(again["id"], first["id"]);
    assert_eq!(again["idempotency_key"], first["idempotency_key"]);

    let mut changed = body.clone();
    changed["email"]["subject"] = json!("Hello again");
    let (s, v) = app.call("POST", &url, Some(&app.agent), Some(changed)).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["code"], "IDEMPOTENCY_CONFLICT");

    let (s, _) = app.call("POST", &url, Some(&app.agent), Some(TestApp::email(&run, "s2", "Second"))).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, v) = app.call("POST", &url, Some(&app.agent), Some(TestApp::email(&run, "s3", "Third"))).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(v["error"]["code"], "BUDGET_EXHAUSTED");
    // A step that has its delivery is answered with it, budget or not.
    let (s, again) = app.call("POST", &url, Some(&app.agent), Some(body.clone())).await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!(again["id"], first["id"]);

    let (s, r) = app.call("GET", &format!("{}/v1/runs/{run}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(r["budget"]["used"]["steps"], 2);
    assert_eq!(r["budget"]["limit"]["max_steps"], 2);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&app.pool).await.unwrap();
    assert_eq!(n, 2, "refused submissions wrote nothing");

    // Another agent sees neither the run nor the delivery.
    let id = first["id"].as_str().unwrap();
    let (s, _) = app.call("GET", &format!("{}/v1/deliveries/{id}", app.api), Some(&app.other_agent), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = app.call("GET", &format!("{}/v1/runs/{run}", app.api), Some(&app.other_agent), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = app.call("POST", &url, Some(&app.other_agent), Some(TestApp::email(&run, "x", "Hi"))).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v) = app.call("POST", &url, Some(&app.other_agent), Some(body.clone())).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another agent's step: {v}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_deliverys_key_is_the_derivation_of_its_run_and_step_and_no_other(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let url = format!("{}/v1/deliveries", app.api);
    // The store's derivation and the service's agree, on ASCII and on multi-byte step ids.
    let mut keys = Vec::new();
    for step in ["s1", "étape-ü-\u{1F642}-\u{4E2D}"] {
        let (s, v) = app.call("POST", &url, Some(&app.agent), Some(TestApp::email(&run, step, "Hello"))).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let key = v["idempotency_key"].as_str().unwrap().to_string();
        assert_eq!(key, policy::idempotency_key(&run.parse().unwrap(), step));
        let derived: String = sqlx::query_scalar("SELECT 'dlv_' || airlock_effect_key($1::uuid, $2)")
            .bind(&run)
            .bind(step)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(derived, key);
        keys.push((v["id"].as_str().unwrap().to_string(), key));
    }

    // No row carries a key that is not its own: not another step's (two deliveries sharing
    // one key), not one made up.
    let refused = |e: sqlx::Error| e.as_database_error().and_then(|d| d.constraint().map(str::to_string));
    let stolen = sqlx::query("UPDATE deliveries SET idempotency_key = $1 WHERE id = $2::uuid")
        .bind(&keys[0].1)
        .bind(&keys[1].0)
        .execute(&app.pool)
        .await
        .map_err(refused);
    assert_eq!(stolen.unwrap_err().as_deref(), Some("deliveries_idempotency_key_derived"));
    let copied = sqlx::query(
        "INSERT INTO deliveries (id, run_id, step_id, agent, channel, idempotency_key, artifact_sha256,
                                 submitted_sha256, effect_class, event_hash)
         SELECT gen_random_uuid(), run_id, 'another', agent, channel, idempotency_key, artifact_sha256,
                submitted_sha256, effect_class, event_hash
         FROM deliveries WHERE id = $1::uuid",
    )
    .bind(&keys[0].0)
    .execute(&app.pool)
    .await
    .map_err(refused);
    assert_eq!(copied.unwrap_err().as_deref(), Some("deliveries_idempotency_key_derived"));
    for made_up in ["", "dlv_", "dlv_00000000000000000000000000000000", &keys[0].1.to_uppercase()] {
        let r = sqlx::query("UPDATE deliveries SET idempotency_key = $1 WHERE id = $2::uuid")
            .bind(made_up)
            .bind(&keys[0].0)
            .execute(&app.pool)
            .await
            .map_err(refused);
        assert_eq!(r.unwrap_err().as_deref(), Some("deliveries_idempotency_key_derived"), "{made_up:?}");
    }
    let now: Vec<String> = sqlx::query_scalar("SELECT idempotency_key FROM deliveries ORDER BY created_at")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(now, keys.iter().map(|k| k.1.clone()).collect::<Vec<_>>(), "nothing changed");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_same_submission_at_once_makes_one_delivery_and_spends_one_step(pool: PgPool) {
    let app = Arc::new(TestApp::start(pool, &[]).await);
    let run = app.create_run(0).await;
    let url = format!("{}/v1/deliveries", app.api);
    let body = TestApp::email(&run, "s1", "Hello there");
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (app, url, body) = (app.clone(), url.clone(), body.clone());
        calls.spawn(async move { app.call("POST", &url, Some(&app.agent), Some(body)).await });
    }
    let answers: Vec<(StatusCode, Value)> = calls.join_all().await;
    let created = answers.iter().filter(|(s, _)| *s == StatusCode::CREATED).count();
    assert_eq!(created, 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|(s, v)| (*s == StatusCode::CREATED || *s == StatusCode::OK) && v["id"] == answers[0].1["id"])
    );
    let (deliveries, jobs, used): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM deliveries), (SELECT count(*) FROM jobs WHERE kind = 'delivery.score'),
                (SELECT used_steps FROM runs)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((deliveries, jobs, used), (1, 1, 1), "one delivery, one scoring, one step spent");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn bad_input_is_refused_with_nothing_written(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__DELIVERY__MAX_ARTIFACT_BYTES", "4096")]).await;
    let run = app.create_run(0).await;
    let url = format!("{}/v1/deliveries", app.api);
    let good = TestApp::email(&run, "s", "Subject");
    let cases: Vec<(serde_json::Value, u16, &str)> = vec![
        (json!({"run_id": run, "step_id": "s", "channel": "fax"}), 400, "VALIDATION"),
        (
            {
                let mut b = good.clone();
                b["extra"] = json!(1);
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["email"]["to"] = json!(["not an address"]);
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["email"]["bcc"] = json!([]);
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["email"]["from"] = json!("mallory@evil.example");
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["email"]["subject"] = json!("a\r\nBcc: x@y.z");
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["run_id"] = json!("nope");
                b
            },
            400,
            "VALIDATION",
        ),
        (
            {
                let mut b = good.clone();
                b["email"]["text"] = json!("x".repeat(5000));
                b
            },
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            json!({"run_id": run, "step_id": "w", "channel": "webhook",
                "webhook": {"url": "https://evil.example/x", "body": {}}}),
            400,
            "VALIDATION",
        ),
    ];
    for (body, status, code) in cases {
        let (s, v) = app.call("POST", &url, Some(&app.agent), Some(body.clone())).await;
        assert_eq!(s.as_u16(), status, "{body} -> {v}");
        assert_eq!(v["error"]["code"], code, "{body}");
    }
    // Not JSON at all, and a huge body.
    let resp = app
        .http
        .post(&url)
        .bearer_auth(&app.agent)
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let resp = app
        .http
        .post(&url)
        .bearer_auth(&app.agent)
        .header("content-type", "application/json")
        .body(vec![b' '; 200_000])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // No token, a bad token, a reviewer token on the agent API.
    let (s, v) = app.call("POST", &url, None, Some(good.clone())).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("UNAUTHENTICATED")));
    let (s, _) = app.call("POST", &url, Some("alk_forged"), Some(good.clone())).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = app.call("POST", &url, Some(&app.reviewer), Some(good)).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    let (d, r): (i64, i64) = sqlx::query_as("SELECT (SELECT count(*) FROM deliveries), (SELECT used_steps FROM runs)")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!((d, r), (0, 0), "nothing written, no budget spent");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn approval_rules_and_roles(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-rules");
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "a", "Quarterly report")).await;
    let d = app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    let sha = d["artifact_sha256"].as_str().unwrap().to_string();
    let approve_url = format!("{}/admin/v1/deliveries/{id}/approve", app.admin);

    // An agent can never approve, even its own delivery.
    let (s, v) = app
        .call("POST", &approve_url, Some(&app.agent), Some(json!({"artifact_sha256": sha, "note": "checked"})))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("FORBIDDEN")));

    // A reviewer edits; approving the hash they saw before the edit is stale.
    let mut edited = d["artifact"].clone();
    edited["email"]["subject"] = json!("Quarterly report (corrected)");
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/deliveries/{id}/edit", app.admin),
            Some(&app.reviewer),
            Some(json!({"artifact": edited, "note": "typo"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let new_sha = v["artifact_sha256"].as_str().unwrap().to_string();
    assert_ne!(new_sha, sha);
    let (s, v) = app
        .call("POST", &approve_url, Some(&app.reviewer), Some(json!({"artifact_sha256": sha, "note": "checked"})))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("STALE_ARTIFACT")));
    let (s, v) = app
        .call("POST", &approve_url, Some(&app.reviewer), Some(json!({"artifact_sha256": new_sha, "note": "checked"})))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Approving twice is an invalid transition.
    let (s, v) = app
        .call("POST", &approve_url, Some(&app.reviewer), Some(json!({"artifact_sha256": new_sha, "note": "checked"})))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("INVALID_TRANSITION")));

    // A reviewer reads the switch but cannot flip it.
    let switch = format!("{}/admin/v1/send-enabled", app.admin);
    let (s, v) = app.call("GET", &switch, Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["enabled"], false, "sending is off by default");
    let (s, _) = app.call("PUT", &switch, Some(&app.reviewer), Some(json!({"enabled": true, "reason": "x"}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = app.call("PUT", &switch, Some(&app.agent), Some(json!({"enabled": true, "reason": "x"}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = app.call("PUT", &switch, Some(&app.operator), Some(json!({"enabled": true}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a flip needs a reason");
    let (s, v) = app.call("GET", &switch, Some(&app.reviewer), None).await;
    assert_eq!((s, v["enabled"].as_bool()), (StatusCode::OK, Some(false)));

    // Reject needs a reason; rejected is final; cancel only before sending.
    let id2 = app.submit(TestApp::email(&run, "b", "Another one")).await;
    app.wait_state(&id2, DeliveryState::AwaitingApproval, WAIT).await;
    let reject = format!("{}/admin/v1/deliveries/{id2}/reject", app.admin);
    let (s, _) = app.call("POST", &reject, Some(&app.reviewer), Some(json!({}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, v) = app.call("POST", &reject, Some(&app.reviewer), Some(json!({"reason": "off-topic"}))).await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("rejected")));
    let (s, _) = app
        .call(
            "POST",
            &format!("{}/v1/deliveries/{id2}/cancel", app.api),
            Some(&app.agent),
            Some(json!({"reason": "x"})),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/v1/deliveries/{id}/cancel", app.api),
            Some(&app.agent),
            Some(json!({"reason": "no longer needed"})),
        )
        .await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("cancelled")), "{v}");
    let jobs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'delivery.send' AND state = 'cancelled'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(jobs, 1, "its send job is cancelled with it");

    stop.cancel();
    worker.await.unwrap().unwrap();
}

/// A delivery's view, read in one statement, shows what each of its rows says: the
/// version a reviewer edited and the one its agent submitted, the latest score, every
/// event, every attempt and the receipt, decoded to the same values their own statements
/// give; its agent sees it without the artifact, another agent not at all.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_delivery_is_shown_as_its_rows_say(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-shown");
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "shown", "Quarterly report")).await;
    let d = app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    let submitted = d["artifact"].clone();
    let mut edited = submitted.clone();
    edited["email"]["subject"] = json!("Quarterly report (corrected)");
    let url = format!("{}/admin/v1/deliveries/{id}/edit", app.admin);
    let (s, v) = app.call("POST", &url, Some(&app.reviewer), Some(json!({"artifact": edited, "note": "typo"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!((&v["artifact"], &v["submitted_artifact"]), (&edited, &submitted), "the edit answers both versions");
    app.set_switch(true).await;
    app.approve(&id).await;
    app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    stop.cancel();
    worker.await.unwrap().unwrap();

    let (s, v) = app.call("GET", &format!("{}/admin/v1/deliveries/{id}", app.admin), Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let uuid: uuid::Uuid = id.parse().unwrap();
    let events = store::events(&app.pool, uuid.into()).await.unwrap();
    assert!(events.len() >= 6, "scored, reviewed, edited, approved, sending, sent: {events:?}");
    assert_eq!(v["events"], serde_json::to_value(&events).unwrap(), "every event, oldest first");
    let attempts = store::attempts(&app.pool, uuid.into()).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(v["attempts"], serde_json::to_value(&attempts).unwrap());
    let (value, reasons, scorer, threshold): (f64, Value, String, f64) = sqlx::query_as(
        "SELECT value, reasons, scorer, threshold FROM scores WHERE delivery_id = $1 ORDER BY created_at DESC, id DESC LIMIT 1",
    )
    .bind(uuid)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(v["score"], json!({"value": value, "reasons": reasons, "scorer": scorer, "threshold": threshold}));
    let (message_id, payload, sent_at): (Option<String>, String, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT message_id, payload_sha256, sent_at FROM receipts WHERE delivery_id = $1")
            .bind(uuid)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(v["receipt"]["message_id"], json!(message_id));
    assert_eq!(v["receipt"]["payload_sha256"], json!(payload));
    assert_eq!(v["receipt"]["sent_at"], json!(sent_at), "to the microsecond");
    assert_eq!((&v["artifact"], &v["submitted_artifact"]), (&edited, &submitted));
    assert_eq!(v["submitted_sha256"], d["artifact_sha256"]);
    assert_eq!(v["state"], "sent");

    // Its agent: the same journey without the artifact; another agent: nothing.
    let own = format!("{}/v1/deliveries/{id}", app.api);
    let (s, mine) = app.call("GET", &own, Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK, "{mine}");
    assert_eq!((&mine["events"], &mine["receipt"]), (&v["events"], &v["receipt"]));
    assert_eq!(mine["score"], json!({"value": value, "reasons": reasons}));
    assert!(mine.get("artifact").is_none() && mine.get("attempts").is_none(), "{mine}");
    let (s, theirs) = app.call("GET", &own, Some(&app.other_agent), None).await;
    assert_eq!((s, theirs["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("NOT_FOUND")), "{theirs}");
    let (s, _) = app
        .call("GET", &format!("{}/admin/v1/deliveries/{}", app.admin, uuid::Uuid::now_v7()), Some(&app.reviewer), None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

/// Approves a fresh delivery with the switch on; returns its id.
async fn approved_email(app: &TestApp, run: &str, step: &str) -> String {
    let id = app.submit(TestApp::email(run, step, &format!("Message {step}"))).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    id
}

async fn attempts(app: &TestApp, id: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(outcome, 'open') FROM send_attempts WHERE delivery_id = $1 ORDER BY started_at, id",
    )
    .bind(uuid::Uuid::parse_str(id).unwrap())
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn smtp_faults_end_in_the_designed_state_and_never_duplicate(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-faults");
    let run = app.create_run(0).await;

    struct Case {
        name: &'static str,
        fault: Fault,
        end: DeliveryState,
        accepted: usize,
        attempts: &'static [&'static str],
    }
    let cases = [
        Case {
            name: "drop-before-mail",
            fault: Fault::DropBeforeMail,
            end: DeliveryState::Sent,
            accepted: 1,
            attempts: &["not_delivered", "sent"],
        },
        Case {
            name: "drop-after-rcpt",
            fault: Fault::DropAfterRcpt,
            end: DeliveryState::Sent,
            accepted: 1,
            attempts: &["not_delivered", "sent"],
        },
        Case {
            name: "drop-after-data",
            fault: Fault::DropAfterData,
            end: DeliveryState::Parked,
            accepted: 0,
            attempts: &["ambiguous"],
        },
        Case {
            name: "421-at-mail",
            fault: Fault::ReplyAtMail(421, "try later".into()),
            end: DeliveryState::Sent,
            accepted: 1,
            attempts: &["not_delivered", "sent"],
        },
        Case {
            name: "450-at-rcpt",
            fault: Fault::ReplyAtRcpt(450, "mailbox busy".into()),
            end: DeliveryState::Sent,
            accepted: 1,
            attempts: &["not_delivered", "sent"],
        },
        Case {
            name: "550-at-rcpt",
            fault: Fault::ReplyAtRcpt(550, "no such user".into()),
            end: DeliveryState::Failed,
            accepted: 0,
            attempts: &["failed"],
        },
        Case {
            name: "554-after-data",
            fault: Fault::ReplyAtDataEnd(554, "rejected".into()),
            end: DeliveryState::Failed,
            accepted: 0,
            attempts: &["failed"],
        },
    ];
    for case in cases {
        let before = app.smtp.accepted().len();
        app.smtp.push_faults([case.fault.clone()]);
        let id = approved_email(&app, &run, case.name).await;
        let d = app.wait_state(&id, case.end, WAIT).await;
        let after = app.smtp.accepted().len();
        assert_eq!(after - before, case.accepted, "{}: messages accepted", case.name);
        assert_eq!(attempts(&app, &id).await, case.attempts, "{}: attempts", case.name);
        match case.end {
            DeliveryState::Sent => assert!(!d["receipt"].is_null(), "{}", case.name),
            _ => assert!(d["receipt"].is_null(), "{}: no receipt", case.name),
        }
    }
    // The parked one stays parked: nothing resends it on its own.
    let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'delivery.send' AND state = 'parked'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(parked, 1);
    for (mid, n) in app.smtp.accepted_by_message_id() {
        assert_eq!(n, 1, "message {mid} accepted {n} times");
    }
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn parked_deliveries_are_settled_by_a_human(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-parked");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for step in ["p1", "p2", "p3"] {
        app.smtp.push_faults([Fault::DropAfterData]);
        let id = approved_email(&app, &run, step).await;
        app.wait_state(&id, DeliveryState::Parked, WAIT).await;
        ids.push(id);
    }
    let resolve = |id: &str| format!("{}/admin/v1/deliveries/{id}/resolve", app.admin);
    let (s, _) =
        app.call("POST", &resolve(&ids[0]), Some(&app.agent), Some(json!({"resolution": "resend", "note": "x"}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = app.call("POST", &resolve(&ids[0]), Some(&app.reviewer), Some(json!({"resolution": "resend"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a resolution needs a note");
    let (s, _) = app
        .call("POST", &resolve(&ids[0]), Some(&app.reviewer), Some(json!({"resolution": "maybe", "note": "x"})))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    // confirmed_sent: the human found it at the relay by Message-ID.
    let (s, v) = app
        .call(
            "POST",
            &resolve(&ids[0]),
            Some(&app.reviewer),
            Some(json!({"resolution": "confirmed_sent", "note": "found in relay log"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "sent");
    assert_eq!(v["receipt"]["attested_by"], "rita");
    assert!(v["receipt"]["message_id"].as_str().unwrap().contains(v["idempotency_key"].as_str().unwrap()));

    // resend: an explicit authorisation of a possible duplicate.
    let (s, v) = app
        .call(
            "POST",
            &resolve(&ids[1]),
            Some(&app.reviewer),
            Some(json!({"resolution": "resend", "note": "not in relay log"})),
        )
        .await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("approved")), "{v}");
    let d = app.wait_state(&ids[1], DeliveryState::Sent, WAIT).await;
    assert!(d["receipt"]["attested_by"].is_null());
    assert_eq!(attempts(&app, &ids[1]).await, ["ambiguous", "sent"]);

    // cancel.
    let (s, v) = app
        .call(
            "POST",
            &resolve(&ids[2]),
            Some(&app.reviewer),
            Some(json!({"resolution": "cancel", "note": "customer called"})),
        )
        .await;
    assert_eq!((s, v["state"].as_str()), (StatusCode::OK, Some("cancelled")));
    let (s, _) = app
        .call("POST", &resolve(&ids[2]), Some(&app.reviewer), Some(json!({"resolution": "cancel", "note": "again"})))
        .await;
    assert_eq!(s, StatusCode::CONFLICT);

    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs WHERE state IN ('available', 'running', 'parked')")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(live, 0, "every send job ended with its delivery");
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn webhooks_are_signed_keyed_and_retried_with_the_same_key(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-hooks");
    let run = app.create_run(0).await;

    // 503 then 429 then 200: three requests, one key, one receipt.
    app.hooks.push_statuses([503, 429]);
    let id = app.submit(app.webhook(&run, "h1", 1)).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    let hits = app.hooks.hits();
    assert_eq!(hits.len(), 3);
    let key = d["idempotency_key"].as_str().unwrap();
    assert!(hits.iter().all(|h| h.idempotency_key.as_deref() == Some(key)), "the same key on every retry");
    for h in &hits {
        assert!(policy::verify_webhook_signature(
            airlock_tests::app::WEBHOOK_SECRET.as_bytes(),
            h.signature.as_deref().unwrap(),
            &h.body
        ));
        assert_eq!(serde_json::from_slice::<serde_json::Value>(&h.body).unwrap(), json!({"order": 1}));
    }
    assert_eq!(attempts(&app, &id).await, ["not_delivered", "not_delivered", "sent"]);
    assert!(d["receipt"]["provider_response"].as_str().unwrap().starts_with("200"));

    // A 4xx other than 408/429 is permanent.
    app.hooks.push_statuses([422]);
    let id = app.submit(app.webhook(&run, "h2", 2)).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    app.wait_state(&id, DeliveryState::Failed, WAIT).await;
    assert_eq!(attempts(&app, &id).await, ["failed"]);
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn tls_is_required_and_verified(pool: PgPool) {
    // No CA file: the test relay's certificate is not trusted.
    let app =
        TestApp::start(pool, &[("AIRLOCK__SMTP__CA_FILE", ""), ("AIRLOCK__DELIVERY__MAX_SEND_ATTEMPTS", "1")]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-tls");
    let run = app.create_run(0).await;
    let id = approved_email(&app, &run, "t1").await;
    app.wait_state(&id, DeliveryState::Failed, WAIT).await;
    assert!(app.smtp.accepted().is_empty(), "nothing sent to an untrusted server");
    let detail: String = sqlx::query_scalar("SELECT detail FROM send_attempts WHERE delivery_id = $1")
        .bind(uuid::Uuid::parse_str(&id).unwrap())
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(detail.to_lowercase().contains("certificate"), "{detail}");
    stop.cancel();
    worker.await.unwrap().unwrap();

    // Plaintext to a host that is not loopback is refused, by configuration and by the client.
    let mut smtp = app.config.smtp.clone();
    smtp.host = "smtp.example.com".into();
    smtp.tls = airlock_core::config::SmtpTls::None;
    smtp.allow_plaintext_loopback = true;
    assert!(matches!(
        airlock_channels::email::SmtpSender::from_config(&smtp),
        Err(airlock_channels::email::SmtpSetupError::PlaintextRefused)
    ));
    smtp.host = "127.0.0.1".into();
    smtp.allow_plaintext_loopback = false;
    assert!(airlock_channels::email::SmtpSender::from_config(&smtp).is_err(), "needs the explicit flag");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_relay_without_starttls_gets_nothing(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__DELIVERY__MAX_SEND_ATTEMPTS", "1")]).await;
    let plain = airlock_tests::smtp::SmtpServer::start(airlock_tests::smtp::SmtpOptions::plain()).await.unwrap();
    let mut cfg = (*app.config).clone();
    cfg.smtp.port = plain.port();
    let sender = airlock_channels::email::SmtpSender::from_config(&cfg.smtp).unwrap();
    let email = match airlock_delivery::artifact::Artifact::from_json(
        &json!({"channel": "email", "email": {"from": "agent@example.com", "to": ["a@example.org"], "subject": "s", "text": "t"}}),
        &Default::default(),
    )
    .unwrap()
    {
        airlock_delivery::artifact::Artifact::Email { email } => email,
        _ => unreachable!(),
    };
    let (env, bytes) = airlock_channels::email::build_message(&email, "<k@example.com>").unwrap();
    let outcome = sender.send(&env, &bytes).await;
    assert!(matches!(outcome, airlock_delivery::outcome::EffectOutcome::NotDelivered { .. }), "{outcome:?}");
    assert!(plain.accepted().is_empty());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn switch_off_during_a_burst_stops_new_sends(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__WORKER__CONCURRENCY", "1")]).await;
    let (stop, worker) = app.start_worker("w-burst");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(approved_email(&app, &run, &format!("b{i}")).await);
    }
    app.set_switch(true).await;
    // Let some go out, then flip off mid-burst.
    app.smtp.wait_for(3, WAIT).await;
    app.set_switch(false).await;
    let started_at_flip: i64 =
        sqlx::query_scalar("SELECT count(*) FROM send_attempts").fetch_one(&app.pool).await.unwrap();

    // Wait until nothing is in flight: every delivery is sent or waiting as approved, and no
    // send job is running.
    let pool = app.pool.clone();
    airlock_tests::harness::wait_for("the burst to settle", WAIT, || {
        let pool = pool.clone();
        async move {
            let (sending, running): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM deliveries WHERE state = 'sending'), \
                        (SELECT count(*) FROM jobs WHERE state = 'running')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            (sending == 0 && running == 0).then_some(())
        }
    })
    .await;
    let (attempts_now, sent, approved): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM send_attempts), \
                (SELECT count(*) FROM deliveries WHERE state = 'sent'), \
                (SELECT count(*) FROM deliveries WHERE state = 'approved')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(attempts_now, started_at_flip, "no send started after the flip committed");
    assert_eq!(sent, started_at_flip, "every started send finished");
    assert_eq!(sent + approved, 40, "the rest wait, none lost");
    assert!(approved > 0, "the flip stopped the burst");
    assert_eq!(app.smtp.accepted().len() as i64, sent);

    // Back on: the rest go out, each once.
    app.set_switch(true).await;
    for id in &ids {
        app.wait_state(id, DeliveryState::Sent, WAIT).await;
    }
    assert_eq!(app.smtp.accepted().len(), 40);
    assert!(app.smtp.accepted_by_message_id().values().all(|n| *n == 1));
    stop.cancel();
    worker.await.unwrap().unwrap();
}

/// Transactions A and B are fenced on the lease: under a lease that is not held, neither
/// writes anything (no attempt, no effect mark, no receipt, no closed attempt, no move),
/// and under the held lease both go through.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn send_transactions_write_nothing_under_a_lost_lease(pool: PgPool) {
    use airlock_delivery::outcome::EffectOutcome;
    use airlock_delivery::pipeline::{self, PipelineError, SendStart};
    use airlock_queue::QueueError;

    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-score");
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "fenced", "Fenced")).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    stop.cancel();
    worker.await.unwrap().unwrap();
    app.approve(&id).await;
    app.set_switch(true).await;
    let delivery_id: airlock_core::ids::DeliveryId = id.parse().unwrap();
    let sends = ClaimFilter { queues: Some(vec!["send".into()]) };
    let job = queue::claim_batch(&app.pool, "probe", &sends, 1, Duration::from_secs(30)).await.unwrap().remove(0);
    let held = job.lease();
    let lost = airlock_tests::harness::lease_never_held(&app.pool, held).await;

    let counts = || async {
        let row: (i64, i64, i64, bool, String, String) = sqlx::query_as(
            r#"SELECT (SELECT count(*) FROM send_attempts WHERE delivery_id = $1),
                      (SELECT count(*) FROM send_attempts WHERE delivery_id = $1 AND outcome IS NOT NULL),
                      (SELECT count(*) FROM receipts WHERE delivery_id = $1),
                      (SELECT effect_started_at IS NOT NULL FROM jobs WHERE id = $2),
                      (SELECT state::text FROM jobs WHERE id = $2),
                      (SELECT state::text FROM deliveries WHERE id = $1)"#,
        )
        .bind(delivery_id)
        .bind(held.id())
        .fetch_one(&app.pool)
        .await
        .unwrap();
        row
    };
    fn lease_lost<T>(r: &Result<T, PipelineError>) -> bool {
        matches!(r, Err(PipelineError::Queue(QueueError::LeaseLost { .. })))
    }

    let r = pipeline::begin_send(&app.pool, &app.config, lost, "probe", delivery_id).await;
    assert!(lease_lost(&r), "{r:?}");
    assert_eq!(counts().await, (0, 0, 0, false, "running".into(), "approved".into()), "A wrote nothing");

    let Ok(SendStart::Started { delivery, attempt_id, .. }) =
        pipeline::begin_send(&app.pool, &app.config, held, "probe", delivery_id).await
    else {
        panic!("transaction A under the held lease starts the send");
    };
    assert_eq!(counts().await, (1, 0, 0, true, "running".into(), "sending".into()));

    let sent = EffectOutcome::Sent { message_id: Some("<m@example.com>".into()), response: "250 ok".into() };
    let r = pipeline::record_outcome(&app.pool, lost, "probe", &delivery, attempt_id, &sent).await;
    assert!(lease_lost(&r), "{r:?}");
    assert_eq!(counts().await, (1, 0, 0, true, "running".into(), "sending".into()), "B wrote nothing");

    let state = pipeline::record_outcome(&app.pool, held, "probe", &delivery, attempt_id, &sent).await.unwrap();
    assert_eq!(state, DeliveryState::Sent);
    assert_eq!(counts().await, (1, 1, 1, false, "completed".into(), "sent".into()));
}

/// With connections kept open, messages one after another share one connection; a kept
/// connection the relay has closed meanwhile is noticed before use (NOOP), and the message
/// goes out once over a new one, with no failed attempt.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn smtp_connections_are_reused_and_a_closed_one_is_replaced(pool: PgPool) {
    use airlock_tests::smtp::{SmtpOptions, SmtpServer};

    let app = TestApp::start(pool, &[("AIRLOCK__SMTP__MAX_IDLE_CONNECTIONS", "2")]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-reuse");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let id = approved_email(&app, &run, &format!("reuse-{i}")).await;
        app.wait_state(&id, DeliveryState::Sent, WAIT).await;
        ids.push(id);
    }
    assert_eq!(app.smtp.accepted().len(), 3);
    assert_eq!(app.smtp.connections(), 1, "three messages, one after another, over one connection");

    // The relay goes away and comes back on the same port: the kept connection is dead.
    app.smtp.stop();
    let relay = loop {
        match SmtpServer::start_on(app.smtp.addr(), SmtpOptions::starttls(app.ca.clone())).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let id = approved_email(&app, &run, "after-restart").await;
    app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    assert_eq!(relay.accepted().len(), 1, "sent once, to the relay that is there");
    assert_eq!(relay.connections(), 1);
    assert_eq!(attempts(&app, &id).await, ["sent"], "the dead connection cost no attempt");
    for id in &ids {
        assert_eq!(attempts(&app, id).await, ["sent"]);
    }
    stop.cancel();
    worker.await.unwrap().unwrap();
}

/// Sends started and recorded together share one transaction A and one transaction B, with
/// the same writes as one by one: an attempt, a start event, then a receipt, a closed
/// attempt, a completed job and a sent delivery each. A batch with a lease that is not held
/// (or a delivery no longer approved) is decided one send at a time: nothing is written
/// under the lost lease, the cancelled delivery is not started, the others go through.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn sends_started_and_recorded_together_write_what_one_by_one_would(pool: PgPool) {
    use airlock_core::ids::DeliveryId as Uuid;
    use airlock_delivery::outcome::EffectOutcome;
    use airlock_delivery::pipeline::{self, PipelineError, SendOutcome, SendStart};
    use airlock_delivery::store::{self, Actor};
    use airlock_queue::{Lease, QueueError};

    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-score");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..7 {
        let id = app.submit(TestApp::email(&run, &format!("t{i}"), "Together")).await;
        app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
        ids.push(id);
    }
    stop.cancel();
    worker.await.unwrap().unwrap();
    for id in &ids {
        app.approve(id).await;
    }
    app.set_switch(true).await;
    let sends = ClaimFilter { queues: Some(vec!["send".into()]) };
    let claim = |n: i64| {
        let app = &app;
        let sends = &sends;
        async move {
            let jobs = queue::claim_batch(&app.pool, "probe", sends, n, Duration::from_secs(60)).await.unwrap();
            assert_eq!(jobs.len() as i64, n);
            jobs.iter()
                .map(|j| (j.lease(), j.payload["delivery_id"].as_str().unwrap().parse().unwrap()))
                .collect::<Vec<(Lease, Uuid)>>()
        }
    };
    let transactions = |table: &'static str, ids: Vec<Uuid>| {
        let app = &app;
        async move {
            let sql = format!("SELECT count(DISTINCT xmin::text) FROM {table} WHERE delivery_id = ANY ($1)");
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(&ids).fetch_one(&app.pool).await.unwrap();
            n
        }
    };
    let story = |id: Uuid| {
        let app = &app;
        async move {
            let row: (String, i64, i64, i64) = sqlx::query_as(
                r#"SELECT (SELECT state::text FROM deliveries WHERE id = $1),
                          (SELECT count(*) FROM send_attempts WHERE delivery_id = $1),
                          (SELECT count(*) FROM send_attempts WHERE delivery_id = $1 AND outcome = 'sent'),
                          (SELECT count(*) FROM receipts WHERE delivery_id = $1)"#,
            )
            .bind(id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
            assert_eq!(store::verify_chain(id, &store::events(&app.pool, id).await.unwrap()), None);
            row
        }
    };
    let sent = |lease: Lease, start: SendStart| {
        let SendStart::Started { delivery, attempt_id, .. } = start else {
            panic!("started: {start:?}");
        };
        let message_id = format!("<{}@example.com>", delivery.id);
        SendOutcome {
            lease,
            delivery,
            attempt_id,
            outcome: EffectOutcome::Sent { message_id: Some(message_id), response: "250 ok".into() },
        }
    };

    // Four sends together: one transaction A, one transaction B.
    let items = claim(4).await;
    let ids4: Vec<Uuid> = items.iter().map(|(_, id)| *id).collect();
    let starts = pipeline::begin_send_many(&app.pool, &app.config, "probe", &items).await;
    assert_eq!(transactions("send_attempts", ids4.clone()).await, 1);
    let outcomes: Vec<SendOutcome> =
        items.iter().zip(starts).map(|((lease, _), start)| sent(*lease, start.unwrap())).collect();
    for id in &ids4 {
        assert_eq!(story(*id).await, ("sending".into(), 1, 0, 0));
    }
    let recorded = pipeline::record_many(&app.pool, "probe", &outcomes).await;
    assert!(recorded.iter().all(|r| matches!(r, Ok(DeliveryState::Sent))), "{recorded:?}");
    assert_eq!(transactions("receipts", ids4.clone()).await, 1);
    for id in &ids4 {
        assert_eq!(story(*id).await, ("sent".into(), 1, 1, 1));
    }

    // Three more: one lease lost, one delivery cancelled meanwhile.
    let mut items = claim(3).await;
    items[0].0 = airlock_tests::harness::lease_never_held(&app.pool, items[0].0).await;
    let d = store::get(&app.pool, items[1].1).await.unwrap().unwrap();
    let mut tx = app.pool.begin().await.unwrap();
    store::transition(
        &mut tx,
        &d,
        airlock_delivery::state::Action::Cancel,
        &Actor::system("test"),
        Some("x"),
        json!({}),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut starts = pipeline::begin_send_many(&app.pool, &app.config, "probe", &items).await.into_iter();
    let lost = starts.next().unwrap();
    assert!(matches!(lost, Err(PipelineError::Queue(QueueError::LeaseLost { .. }))), "{lost:?}");
    assert!(matches!(starts.next().unwrap(), Ok(SendStart::Nothing)));
    let third = sent(items[2].0, starts.next().unwrap().unwrap());
    assert_eq!(story(items[0].1).await, ("approved".into(), 0, 0, 0), "nothing under the lost lease");
    assert_eq!(story(items[1].1).await, ("cancelled".into(), 0, 0, 0));

    // Recording with a lost lease among them: one by one, nothing for the lost one.
    let ghost =
        SendOutcome { lease: airlock_tests::harness::lease_never_held(&app.pool, third.lease).await, ..third.clone() };
    let recorded = pipeline::record_many(&app.pool, "probe", &[ghost, third.clone()]).await;
    assert!(matches!(recorded[0], Err(PipelineError::Queue(QueueError::LeaseLost { .. }))), "{recorded:?}");
    assert!(matches!(recorded[1], Ok(DeliveryState::Sent)), "{recorded:?}");
    assert_eq!(story(items[2].1).await, ("sent".into(), 1, 1, 1));
}
