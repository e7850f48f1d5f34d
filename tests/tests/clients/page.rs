//! The reviewers' and operators' page in headless Chromium (playwright-core), against the
//! real admin and agent services, a real worker, Postgres and the SMTP server: a review
//! that ends with one message sent once an operator turns sending on in the page; a stale
//! approval explained, then an edit and an approval made in the page; a parked send
//! confirmed from the "Parked" view; model-written HTML that stays text; a turn's call granted from the
//! page and run once; and a queue of 1,000 items shown one page at a time.
//!
//! `AIRLOCK_PAGE_SCREENSHOTS=<dir>` makes the scenarios save their views there (the
//! pictures in `docs/page/` come from it).

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::browser::run_page_scenario;
use airlock_tests::harness;
use airlock_tests::model::{ModelServer, Reply};
use airlock_tests::smtp::Fault;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(30);
/// What one scenario may take, browser start included, on a loaded machine.
const SCENARIO: Duration = Duration::from_secs(120);

/// Items scoring below 0.9 wait for review: one recipient outside the known domains
/// (0.85) is enough.
const THRESHOLD: (&str, &str) = ("AIRLOCK__SCORING__REVIEW_THRESHOLD", "0.9");

fn page_env(app: &TestApp, extra: &[(&str, String)]) -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = vec![
        ("AIRLOCK_PAGE_URL", app.admin.clone()),
        ("AIRLOCK_PAGE_REVIEWER", app.reviewer.clone()),
        ("AIRLOCK_PAGE_OPERATOR", app.operator.clone()),
    ];
    if let Ok(dir) = std::env::var("AIRLOCK_PAGE_SCREENSHOTS") {
        env.push(("AIRLOCK_PAGE_SCREENSHOTS", dir));
    }
    for (k, v) in extra {
        env.push((leak(k), v.clone()));
    }
    env
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn email(run: &str, step: &str, to: &str, subject: &str, text: &str, html: Option<&str>) -> Value {
    json!({"run_id": run, "step_id": step, "channel": "email",
           "email": {"from": "agent@example.com", "to": [to], "cc": [], "subject": subject, "text": text, "html": html}})
}

async fn audit_actions(app: &TestApp) -> Vec<(String, String, Option<String>)> {
    let (s, v) = app.call("GET", &format!("{}/admin/v1/audit?limit=100", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap().to_string(),
                e["actor"].as_str().unwrap().to_string(),
                e["reason"].as_str().map(String::from),
            )
        })
        .collect()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_reviewer_accepts_and_approves_in_the_page_and_it_is_sent_once_an_operator_turns_sending_on(pool: PgPool) {
    let app = TestApp::start(pool, &[THRESHOLD]).await;
    let (_stop, _worker) = app.start_worker("page-worker");
    let run = app.create_run(0).await;
    let subject = "Quarterly figures for Bob";
    let id =
        app.submit(email(&run, "draft-1", "bob@elsewhere.net", subject, "Bob, the figures are attached.", None)).await;
    app.wait_state(&id, DeliveryState::InReview, WAIT).await;

    let out = run_page_scenario("review", &page_env(&app, &[("AIRLOCK_PAGE_SUBJECT", subject.into())]), SCENARIO).await;
    assert_eq!(out["scenario"], "review");

    // Approved in the page, sent after the switch went on in the page: exactly one message.
    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    let accepted = app.smtp.wait_for(1, WAIT).await;
    assert_eq!(accepted.len(), 1, "one message");
    assert_eq!(accepted[0].rcpt_to, vec!["bob@elsewhere.net".to_string()]);
    assert_eq!(accepted[0].message_id.as_deref().map(|m| format!("<{m}>")), d["message_id"].as_str().map(String::from));
    // Each human action is on record with the note written in the page, by its author.
    let audit = audit_actions(&app).await;
    let has = |action: &str, actor: &str, reason: &str| {
        audit.iter().any(|(a, b, c)| a == action && b == actor && c.as_deref() == Some(reason))
    };
    assert!(has("delivery.accept", "rita", "checked the recipient"), "{audit:?}");
    assert!(has("delivery.approve", "rita", "reads well"), "{audit:?}");
    assert!(has("send_switch.set", "otto", "morning check done"), "{audit:?}");
    assert!(has("queue.pause", "otto", "scorer upgrade") && has("queue.resume", "otto", "upgrade done"), "{audit:?}");
    assert!(
        has("grant.create", "otto", "weekly newsletter") && has("grant.revoke", "otto", "newsletter paused"),
        "{audit:?}"
    );
    assert!(airlock_queue::paused_queues(&app.pool).await.unwrap().is_empty());
    // The switch did not move without a reason: one flip only.
    assert_eq!(audit.iter().filter(|(a, ..)| a == "send_switch.set").count(), 1, "{audit:?}");
    // Nothing else was sent, a little later either.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(app.smtp.accepted().len(), 1);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_approval_of_a_version_edited_meanwhile_is_explained_then_the_reviewer_edits_and_approves_theirs(
    pool: PgPool,
) {
    let app = TestApp::start(pool, &[]).await;
    let (_stop, _worker) = app.start_worker("page-worker");
    let run = app.create_run(0).await;
    let subject = "Renewal terms";
    let id = app.submit(email(&run, "draft-1", "alice@example.org", subject, "The old terms.", None)).await;
    let d = app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    let mut artifact = d["artifact"].clone();
    artifact["email"]["text"] = json!("The new terms.");
    let edit = json!({"artifact": artifact, "note": "terms changed"}).to_string();

    run_page_scenario(
        "stale",
        &page_env(
            &app,
            &[
                ("AIRLOCK_PAGE_SUBJECT", subject.into()),
                ("AIRLOCK_PAGE_ID", id.clone()),
                ("AIRLOCK_PAGE_EDIT", edit),
                ("AIRLOCK_PAGE_TEXT", "The new terms, in plain words.".into()),
            ],
        ),
        SCENARIO,
    )
    .await;
    // One approval, of the version the reviewer wrote and read last.
    let d = app.delivery(&id).await;
    assert_eq!(d["state"], "approved", "{d}");
    assert_eq!(d["artifact"]["email"]["text"], "The new terms, in plain words.");
    let approved: Vec<String> =
        sqlx::query_scalar("SELECT artifact_sha256 FROM approvals WHERE delivery_id = $1::uuid")
            .bind(&id)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(approved, vec![d["artifact_sha256"].as_str().unwrap().to_string()]);
    let audit = audit_actions(&app).await;
    assert!(
        audit.iter().any(|(a, b, c)| a == "delivery.edit" && b == "rita" && c.as_deref() == Some("clearer wording"))
    );
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_parked_send_is_confirmed_from_the_parked_view_and_attested_by_the_reviewer(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    let (_stop, _worker) = app.start_worker("page-worker");
    let run = app.create_run(0).await;
    // The relay takes the message and drops the connection before answering: nobody knows.
    app.smtp.push_faults([Fault::DropAfterData]);
    let id = app.submit(email(&run, "draft-1", "alice@example.org", "Invoice 7", "Attached.", None)).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    let d = app.wait_state(&id, DeliveryState::Parked, WAIT).await;
    let message_id = d["message_id"].as_str().unwrap().to_string();

    run_page_scenario("parked", &page_env(&app, &[("AIRLOCK_PAGE_MESSAGE_ID", message_id)]), SCENARIO).await;
    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    assert_eq!(d["receipt"]["attested_by"], "rita", "{d}");
    // Confirmed, not resent: the relay saw it once.
    assert!(app.smtp.accepted().is_empty());
    assert_eq!(app.smtp.dropped_after_data().len(), 1);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn script_and_event_handlers_in_a_subject_and_body_stay_text(pool: PgPool) {
    let app = TestApp::start(pool, &[THRESHOLD]).await;
    let (_stop, _worker) = app.start_worker("page-worker");
    let run = app.create_run(0).await;
    let subject = r#"Hi <script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 1">"#;
    let text = r#"Body <img src=/nothing onerror="window.__pwned=1"> and <script>window.__pwned=1;alert(1)</script>"#;
    let html = r#"<p>Hello</p><img src=x onerror="window.__pwned=1;alert('x')"><script>window.__pwned=1</script><svg onload="window.__pwned=1"></svg>"#;
    let id = app.submit(email(&run, "draft-1", "bob@elsewhere.net", subject, text, Some(html))).await;
    app.wait_state(&id, DeliveryState::InReview, WAIT).await;

    let texts = [text, html].join("\u{1f}");
    let out = run_page_scenario(
        "xss",
        &page_env(&app, &[("AIRLOCK_PAGE_SUBJECT", subject.into()), ("AIRLOCK_PAGE_TEXTS", texts)]),
        SCENARIO,
    )
    .await;
    assert_eq!(out["inert"]["pwned"], 0, "{out}");
    assert_eq!(out["inert"]["images"], 0, "{out}");
    // Looking changed nothing.
    assert_eq!(app.delivery(&id).await["state"], "in_review");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_grant_from_the_page_resumes_the_turn_and_its_call_runs_once(pool: PgPool) {
    const WIRE_SCHEMA: &str = r#"{"type":"object","properties":{"amount":{"type":"integer","minimum":1},"to":{"type":"string"}},"required":["amount","to"],"additionalProperties":false}"#;
    let model = ModelServer::start().await.unwrap();
    let endpoint = model.endpoint();
    let app = TestApp::start(
        pool,
        &[
            ("AIRLOCK__MODELS__LOCAL__ENDPOINT", endpoint.as_str()),
            ("AIRLOCK__MODELS__LOCAL__MODEL", "scripted-1"),
            ("AIRLOCK__MODELS__LOCAL__TIMEOUT_SECONDS", "5"),
            ("AIRLOCK__TOOLS__WIRE_MONEY__URL", "{hooks}/wire"),
            ("AIRLOCK__TOOLS__WIRE_MONEY__EFFECT", "non_repeatable"),
            ("AIRLOCK__TOOLS__WIRE_MONEY__DESCRIPTION", "Sends money; cannot be undone."),
            ("AIRLOCK__TOOLS__WIRE_MONEY__SCHEMA", WIRE_SCHEMA),
        ],
    )
    .await;
    let (_stop, _worker) = app.start_worker("turn-worker");
    let run = app.create_run(0).await;
    model.push([
        Reply::action(
            json!({"type": "tool_call", "tool_id": "wire_money", "arguments": {"amount": 100, "to": "acct-1"}}),
        ),
        Reply::action(json!({"type": "final", "text": "paid"})),
    ]);
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/v1/runs/{run}/turns", app.api),
            Some(&app.agent),
            Some(json!({"step_id": "pay", "model": "local", "instructions": "Be brief.", "input": "Pay invoice 7.", "tools": ["wire_money"]})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let turn = v["id"].as_str().unwrap().to_string();
    let get_turn = || async {
        let (_, t) = app.call("GET", &format!("{}/v1/turns/{turn}", app.api), Some(&app.agent), None).await;
        t
    };
    let t = harness::wait_for("the turn to wait for a human", WAIT, || async {
        let t = get_turn().await;
        (t["state"] == "authorization_required").then_some(t)
    })
    .await;
    let sha = t["authorization"]["arguments_sha256"].as_str().unwrap().to_string();
    assert!(app.hooks.hits().is_empty());

    run_page_scenario("grant", &page_env(&app, &[("AIRLOCK_PAGE_SHA", sha)]), SCENARIO).await;

    let t = harness::wait_for("the turn to end", WAIT, || async {
        let t = get_turn().await;
        (t["state"] == "completed").then_some(t)
    })
    .await;
    assert_eq!(t["final"]["text"], "paid");
    let wires: Vec<_> = app.hooks.hits().into_iter().filter(|h| h.path == "/wire").collect();
    assert_eq!(wires.len(), 1, "the granted call ran once");
    assert_eq!(serde_json::from_slice::<Value>(&wires[0].body).unwrap(), json!({"amount": 100, "to": "acct-1"}));
    let audit = audit_actions(&app).await;
    assert!(
        audit
            .iter()
            .any(|(a, b, c)| a == "authorization.grant" && b == "rita" && c.as_deref() == Some("invoice 7 checked")),
        "{audit:?}"
    );
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn with_a_thousand_items_waiting_the_queue_shows_one_page_loaded_by_one_request(pool: PgPool) {
    let app = TestApp::start(pool, &[THRESHOLD]).await;
    let (_stop, _worker) = app.start_worker("page-worker");
    let run = app.create_run(0).await;
    for i in 0..1000 {
        let to = if i % 2 == 0 { "bob@elsewhere.net" } else { "alice@example.org" };
        app.submit(email(&run, &format!("bulk-{i}"), to, &format!("Item {i:04}"), "A line of text.", None)).await;
    }
    harness::wait_for("1,000 items to wait for a reviewer", Duration::from_secs(120), || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state IN ('in_review', 'awaiting_approval')")
                .fetch_one(&app.pool)
                .await
                .unwrap();
        (n == 1000).then_some(())
    })
    .await;

    let out = run_page_scenario("paging", &page_env(&app, &[]), SCENARIO).await;
    // The property that keeps the queue fast whatever its length: sign-in loads one page
    // (one request, 50 rows), and the next page only when asked.
    assert_eq!(out["first"], json!({"requests": 1, "rows": 50}), "{out}");
    assert_eq!(out["more"], json!({"requests": 2, "rows": 100}), "{out}");
    // Usable within a second on an idle machine; the bound is loose because the suites share
    // the machine's cores with the builds and each other, and the paging above is the check.
    let ms = out["usable_ms"].as_u64().unwrap();
    assert!(ms < 5000, "the queue took {ms} ms to show after sign-in");
    eprintln!("queue usable {ms} ms after sign-in with 1,000 items waiting");
}
