//! The operator's send switch and queue pauses, from the command line and over HTTP: each
//! action audited with its reason, the `send` queue left to the switch, and a paused queue
//! that workers really stop claiming from until it is resumed.

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(30);

/// Runs `airlock-admin ARGS` against the test's database; returns success and stdout.
fn admin(url: &str, args: &[&str]) -> (bool, String) {
    let out = harness::spawn("airlock-admin", args, url, &[("USER", "ops")]).wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn audit(pool: &PgPool) -> Vec<(String, String, String, String)> {
    sqlx::query_as("SELECT action, actor, target_id, coalesce(reason, '') FROM audit_log ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_send_switch_and_queue_pauses_from_the_command_line_are_audited(pool: PgPool) {
    let url = harness::database_url(&pool);
    let (ok, out) = admin(&url, &["switch", "status"]);
    assert!(ok && out.starts_with("send switch off"), "{out}");
    // A reason is required.
    assert!(!admin(&url, &["switch", "on"]).0);
    let (ok, out) = admin(&url, &["switch", "on", "--reason", "relay checked"]);
    assert!(ok && out.starts_with("send switch on (set by cli:ops"), "{out}");
    let (ok, out) = admin(&url, &["switch", "status", "--json"]);
    let s: Value = serde_json::from_str(&out).unwrap();
    assert!(ok);
    assert_eq!((s["enabled"].as_bool(), s["reason"].as_str()), (Some(true), Some("relay checked")));
    // The switch on lets workers claim sends.
    assert!(!airlock_queue::paused_queues(&pool).await.unwrap().contains(&"send".to_string()));

    assert!(admin(&url, &["queues", "pause", "default", "--reason", "relay maintenance"]).0);
    assert_eq!(airlock_queue::paused_queues(&pool).await.unwrap(), vec!["default".to_string()]);
    let (ok, out) = admin(&url, &["queues", "list"]);
    let line = out.lines().find(|l| l.starts_with("default ")).unwrap_or_else(|| panic!("{out}"));
    assert!(ok && line.contains("paused") && line.ends_with("relay maintenance"), "{out}");
    let (_, out) = admin(&url, &["queues", "list", "--json"]);
    let list: Value = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["default", "sandbox", "send"], "airlock's queues, empty or not");
    assert_eq!((list[0]["paused"].as_bool(), list[2]["paused"].as_bool()), (Some(true), Some(false)));
    // The send queue follows the switch, nothing else; a bad name is refused; nothing audited for either.
    assert!(!admin(&url, &["queues", "resume", "send", "--reason", "x"]).0);
    assert!(!admin(&url, &["queues", "pause", "a queue", "--reason", "x"]).0);
    assert!(!admin(&url, &["queues", "pause", "default", "--reason", " "]).0);
    assert!(admin(&url, &["queues", "resume", "default", "--reason", "maintenance over"]).0);
    assert!(airlock_queue::paused_queues(&pool).await.unwrap().is_empty());
    assert!(admin(&url, &["switch", "off", "--reason", "end of day"]).0);
    assert_eq!(airlock_queue::paused_queues(&pool).await.unwrap(), vec!["send".to_string()]);

    let actor = "cli:ops".to_string();
    let row = |a: &str, t: &str, r: &str| (a.to_string(), actor.clone(), t.to_string(), r.to_string());
    assert_eq!(
        audit(&pool).await,
        vec![
            row("send_switch.set", "send_enabled", "relay checked"),
            row("queue.pause", "default", "relay maintenance"),
            row("queue.resume", "default", "maintenance over"),
            row("send_switch.set", "send_enabled", "end of day"),
        ]
    );
    // The audit chain holds.
    let (ok, out) = admin(&url, &["audit", "verify"]);
    assert!(ok && out.trim() == "ok", "{out}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_queue_paused_over_http_is_not_claimed_from_until_it_is_resumed(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (_stop, _worker) = app.start_worker("pause-worker");
    let pause = format!("{}/admin/v1/queues/default/pause", app.admin);
    let resume = format!("{}/admin/v1/queues/default/resume", app.admin);
    let reason = json!({"reason": "scorer upgrade"});
    // Operators only, with a reason; the send queue is the switch's.
    assert_eq!(app.call("POST", &pause, Some(&app.reviewer), Some(reason.clone())).await.0, StatusCode::FORBIDDEN);
    assert_eq!(app.call("POST", &pause, Some(&app.operator), Some(json!({}))).await.0, StatusCode::BAD_REQUEST);
    let (s, v) = app
        .call("POST", &format!("{}/admin/v1/queues/send/resume", app.admin), Some(&app.operator), Some(reason.clone()))
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("INVALID_TRANSITION")), "{v}");
    let (s, v) = app.call("POST", &pause, Some(&app.operator), Some(reason.clone())).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!((v["name"].as_str(), v["paused"].as_bool()), (Some("default"), Some(true)), "{v}");

    // A submission's scoring job waits in the paused queue: the worker, polling every
    // 100 ms and re-reading the pauses at least every second, leaves it alone.
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "draft-1", "Paused")).await;
    let started = std::time::Instant::now();
    while started.elapsed() < airlock_queue::PAUSES_MAX_AGE * 3 {
        let attempts: i32 = sqlx::query_scalar("SELECT coalesce(max(attempt), 0) FROM jobs WHERE queue = 'default'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(attempts, 0, "a job of a paused queue was claimed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(app.delivery(&id).await["state"], "persisted");
    let (s, v) = app.call("GET", &format!("{}/admin/v1/queues", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK);
    let q = v["items"].as_array().unwrap().iter().find(|q| q["name"] == "default").cloned().unwrap();
    assert_eq!((q["paused"].as_bool(), q["reason"].as_str()), (Some(true), Some("scorer upgrade")), "{q}");
    assert_eq!(q["depth"]["available"], 1, "{q}");

    let (s, v) = app.call("POST", &resume, Some(&app.operator), Some(json!({"reason": "upgrade done"}))).await;
    assert_eq!((s, v["paused"].as_bool()), (StatusCode::OK, Some(false)), "{v}");
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    let actions: Vec<(String, String, String)> =
        sqlx::query_as("SELECT action, actor, reason FROM audit_log WHERE action LIKE 'queue.%' ORDER BY id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        actions,
        vec![
            ("queue.pause".into(), "otto".into(), "scorer upgrade".into()),
            ("queue.resume".into(), "otto".into(), "upgrade done".into())
        ]
    );
}
