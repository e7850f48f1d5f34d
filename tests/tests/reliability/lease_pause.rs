//! A worker frozen past its lease, then thawed: it can neither send nor complete, and the
//! new holder's outcome stands.
//!
//! The frozen worker is a real `airlock-worker` that stops itself with SIGSTOP at a fault
//! point (`AIRLOCK_FAULTS=point=stop`), exactly as a paused VM or a stopped process would
//! stop at that instruction: its heartbeats stop with it, so its lease runs out by the
//! database clock. A second worker rescues the job and settles it. Then the first worker is
//! sent SIGCONT and stopped gracefully, and the suite checks that it added nothing: no
//! connection to the relay or request to the receiver, no event, no receipt.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use airlock_tests::{invariants, reliability};
use nix::sys::signal::Signal;
use serde_json::Value;
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Channel {
    Email,
    Webhook,
}

/// What the run must end as once the frozen worker has been thawed and has stopped.
struct Expect {
    state: DeliveryState,
    /// Messages accepted, or webhook requests received, in total.
    received: usize,
    attempts: &'static [&'static str],
    /// Whether the frozen worker started an attempt (transaction A) before it froze.
    frozen_started: bool,
}

async fn events_by(app: &TestApp, id: &str, pid: u32) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM delivery_events WHERE delivery_id = $1 AND actor LIKE $2")
        .bind(uuid::Uuid::parse_str(id).unwrap())
        .bind(format!("%-{pid}-%"))
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

fn effects(app: &TestApp, channel: Channel) -> (usize, usize) {
    match channel {
        Channel::Email => (app.smtp.connections(), app.smtp.accepted().len()),
        Channel::Webhook => (app.hooks.hits().len(), app.hooks.hits().len()),
    }
}

async fn frozen_past_the_lease(pool: PgPool, point: &str, channel: Channel, expect: Expect) {
    let app = TestApp::start(pool, &[("AIRLOCK__WORKER__SHUTDOWN_GRACE_SECONDS", "5")]).await;
    reliability::grant_everything(&app).await;
    let run = app.create_run(0).await;
    let (stop, prep) = app.start_worker("w-prep");
    let id = match channel {
        Channel::Email => app.submit(TestApp::email(&run, "e1", "Invoice 42")).await,
        Channel::Webhook => app.submit(app.webhook(&run, "h1", 42)).await,
    };
    app.wait_state(&id, DeliveryState::Approved, WAIT).await;
    stop.cancel();
    prep.await.unwrap().unwrap();
    app.set_switch(true).await;

    // The first holder freezes at the boundary.
    let spec = format!("{point}=stop");
    let mut env = app.env_pairs();
    env.extend([("AIRLOCK_FAULTS", spec.as_str()), ("AIRLOCK__WORKER__CONCURRENCY", "1")]);
    let mut frozen = KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env));
    reliability::wait_stopped(&frozen.0, WAIT).await;
    let frozen_pid = frozen.0.id();
    assert_eq!(
        reliability::attempt_outcomes(&app.pool, &id).await.len(),
        usize::from(expect.frozen_started),
        "where the first holder froze"
    );

    // A second worker takes over once the lease has run out, and settles the delivery.
    let second = KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &app.env_pairs()));
    let settled = app.wait_state(&id, expect.state, WAIT).await;
    reliability::settle(&app.pool, WAIT).await;
    let effects_before = effects(&app, channel);
    let events_before = events_by(&app, &id, frozen_pid).await;

    // Thaw the first holder, then let it stop by itself.
    harness::signal(&frozen.0, Signal::SIGCONT);
    harness::signal(&frozen.0, Signal::SIGTERM);
    let status = reliability::wait_exit(&mut frozen.0, WAIT).await;
    assert!(status.success(), "the thawed worker stops cleanly: {status:?}");

    assert_eq!(effects(&app, channel), effects_before, "the thawed worker sent nothing, not even a connection");
    assert_eq!(events_by(&app, &id, frozen_pid).await, events_before, "the thawed worker recorded nothing");
    let d = app.delivery(&id).await;
    assert_eq!(d["state"], settled["state"], "the new holder's outcome stands");
    assert_eq!(d["receipt"], settled["receipt"]);
    if expect.state == DeliveryState::Sent {
        let worker = d["receipt"]["worker"].as_str().unwrap();
        assert!(worker.contains(&format!("-{}-", second.0.id())), "receipt by the new holder: {worker}");
        assert!(d["receipt"]["attempt"].as_i64().unwrap() >= 2, "under a newer lease epoch");
    } else {
        assert_eq!(d["receipt"], Value::Null);
    }
    let received = match channel {
        Channel::Email => app.smtp.accepted().len(),
        Channel::Webhook => app.hooks.hits().len(),
    };
    assert_eq!(received, expect.received);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, expect.attempts);
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn frozen_after_claim_cannot_start_the_send(pool: PgPool) {
    let expect = Expect { state: DeliveryState::Sent, received: 1, attempts: &["sent"], frozen_started: false };
    frozen_past_the_lease(pool, "job.after_claim", Channel::Email, expect).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn frozen_after_the_attempt_commit_sends_no_email(pool: PgPool) {
    // The attempt was committed, so the rescuer parks the email; the thawed worker must not
    // deliver it behind the human's back.
    let expect =
        Expect { state: DeliveryState::Parked, received: 0, attempts: &["lease_expired"], frozen_started: true };
    frozen_past_the_lease(pool, "send.after_attempt_commit", Channel::Email, expect).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn frozen_after_the_attempt_commit_calls_no_webhook(pool: PgPool) {
    let expect =
        Expect { state: DeliveryState::Sent, received: 1, attempts: &["lease_expired", "sent"], frozen_started: true };
    frozen_past_the_lease(pool, "send.after_attempt_commit", Channel::Webhook, expect).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn frozen_after_the_email_cannot_record_it(pool: PgPool) {
    let expect =
        Expect { state: DeliveryState::Parked, received: 1, attempts: &["lease_expired"], frozen_started: true };
    frozen_past_the_lease(pool, "send.after_effect", Channel::Email, expect).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn frozen_after_the_webhook_cannot_overwrite_the_new_receipt(pool: PgPool) {
    let expect =
        Expect { state: DeliveryState::Sent, received: 2, attempts: &["lease_expired", "sent"], frozen_started: true };
    frozen_past_the_lease(pool, "send.after_effect", Channel::Webhook, expect).await;
}
