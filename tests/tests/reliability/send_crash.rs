//! A real `airlock-worker` SIGKILLed between the send attempt and its receipt: the email is
//! parked and never resent; the webhook is resent with the same Idempotency-Key.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use nix::sys::signal::Signal;
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

async fn approved(app: &TestApp, body: serde_json::Value) -> String {
    let id = app.submit(body).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    id
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn sigkill_between_attempt_and_receipt(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    // Score and approve both with an in-process worker while the switch is off.
    let (stop, worker) = app.start_worker("w-prep");
    let email = approved(&app, TestApp::email(&run, "e1", "Invoice 42")).await;
    let hook = approved(&app, app.webhook(&run, "h1", 42)).await;
    stop.cancel();
    worker.await.unwrap().unwrap();

    // A real worker that freezes right after each effect, before recording it.
    let mut env = app.env_pairs();
    env.push(("AIRLOCK_FAULTS", "send.after_effect=pause"));
    let mut doomed = KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env));
    app.set_switch(true).await;
    app.smtp.wait_for(1, WAIT).await;
    let hooks = &app.hooks;
    harness::wait_for("the webhook to be called", WAIT, || async move { (!hooks.hits().is_empty()).then_some(()) })
        .await;
    for id in [&email, &hook] {
        let d = app.delivery(id).await;
        assert_eq!(d["state"], "sending", "the effect happened, the receipt did not");
        assert!(d["receipt"].is_null());
    }
    harness::signal(&doomed.0, Signal::SIGKILL);
    harness::wait_exit(&mut doomed.0, Duration::from_secs(10));

    // A healthy worker takes over once the lease expires.
    let _healthy = KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &app.env_pairs()));
    let d = app.wait_state(&email, DeliveryState::Parked, WAIT).await;
    assert!(d["receipt"].is_null());
    let attempts = d["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "never resent");
    assert_eq!(attempts[0]["outcome"], "lease_expired");
    let h = app.wait_state(&hook, DeliveryState::Sent, WAIT).await;

    let hits = app.hooks.hits();
    assert_eq!(hits.len(), 2, "the webhook was resent once");
    assert_eq!(hits[0].idempotency_key, hits[1].idempotency_key, "with the same key");
    assert_eq!(hits[0].idempotency_key.as_deref(), h["idempotency_key"].as_str());
    assert_eq!(hits[0].body, hits[1].body);
    // The parked email is still one message at the relay.
    let parked_job: String = sqlx::query_scalar(
        "SELECT state::text FROM jobs WHERE payload->>'delivery_id' = $1 AND kind = 'delivery.send'",
    )
    .bind(&email)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(parked_job, "parked");
    assert_eq!(app.smtp.accepted().len(), 1);
}
