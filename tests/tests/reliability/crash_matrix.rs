//! Step-boundary crash injection: one row per (fault point, stage) where a real
//! `airlock-worker` process is made to abort — `std::process::abort`, as abrupt as a
//! SIGKILL — exactly at that boundary, then a healthy worker is started and the suite
//! checks that each delivery converged to the end state the design promises, with exactly
//! the right number of messages at the SMTP server and requests at the webhook receiver,
//! and that every invariant of [`airlock_tests::invariants`] holds.
//!
//! Every row uses its own database and its own processes, so nextest runs them in
//! parallel. `every_fault_point_has_a_row` fails when a boundary is added to
//! `airlock_core::fault::POINTS` without a row here.
//!
//! Stages: `Score` crashes the worker while it scores (the send switch is off, so only
//! score jobs run); `Send` while it sends (deliveries were scored and approved by a
//! standing grant beforehand); `Rescue` while it rescues the sends of a worker that was
//! SIGKILLed after its effects. `Score` and `Send` rows crash one worker per delivery (a
//! worker with one slot takes one job), so both the email and the webhook meet the fault.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_core::fault::POINTS;
use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use airlock_tests::{invariants, reliability};
use nix::sys::signal::Signal;
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Score,
    Send,
    Rescue,
}

/// What one delivery must end as.
#[derive(Debug)]
struct Expect {
    state: DeliveryState,
    /// Messages accepted by the SMTP server, or requests received by the webhook receiver,
    /// for this delivery (webhook retries all carry the same key and body).
    received: usize,
    /// Outcomes of its send attempts, in order.
    attempts: &'static [&'static str],
}

#[derive(Debug)]
struct Row {
    name: &'static str,
    point: &'static str,
    stage: Stage,
    email: Expect,
    webhook: Expect,
}

/// Declares the matrix once: the table (for the coverage check) and one test per row.
macro_rules! matrix {
    ($($name:ident: $point:literal while $stage:ident
        => email $es:ident $er:literal [$($ea:literal),*], webhook $ws:ident $wr:literal [$($wa:literal),*];)*) => {
        const MATRIX: &[Row] = &[$(Row {
            name: stringify!($name),
            point: $point,
            stage: Stage::$stage,
            email: Expect { state: DeliveryState::$es, received: $er, attempts: &[$($ea),*] },
            webhook: Expect { state: DeliveryState::$ws, received: $wr, attempts: &[$($wa),*] },
        }),*];
        $(
            #[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
            async fn $name(pool: PgPool) {
                run_row(pool, MATRIX.iter().find(|r| r.name == stringify!($name)).unwrap()).await;
            }
        )*
    };
}

// The design's promise at each boundary. An email whose effect may have started when its
// worker died is parked for a human (never resent); a webhook is resent with the same
// Idempotency-Key; a crash anywhere else only delays the delivery.
matrix! {
    claimed_while_scoring: "job.after_claim" while Score
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    claimed_while_sending: "job.after_claim" while Send
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    score_before_commit: "score.before_commit" while Score
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    score_after_commit: "score.after_commit" while Score
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    before_complete_while_scoring: "job.before_complete" while Score
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    after_complete_while_scoring: "job.after_complete" while Score
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    send_after_attempt_commit: "send.after_attempt_commit" while Send
        => email Parked 0 ["lease_expired"], webhook Sent 1 ["lease_expired", "sent"];
    send_after_effect: "send.after_effect" while Send
        => email Parked 1 ["lease_expired"], webhook Sent 2 ["lease_expired", "sent"];
    send_after_receipt_commit: "send.after_receipt_commit" while Send
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    before_complete_while_sending: "job.before_complete" while Send
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    after_complete_while_sending: "job.after_complete" while Send
        => email Sent 1 ["sent"], webhook Sent 1 ["sent"];
    rescue_before_commit: "rescue.before_commit" while Rescue
        => email Parked 1 ["lease_expired"], webhook Sent 2 ["lease_expired", "sent"];
}

#[test]
fn every_fault_point_has_a_row() {
    for point in POINTS {
        assert!(
            MATRIX.iter().any(|r| r.point == *point),
            "fault point `{point}` has no row in the crash matrix: add one with the end state the design promises"
        );
    }
    for row in MATRIX {
        assert!(POINTS.contains(&row.point), "row {} names `{}`, which is not a fault point", row.name, row.point);
    }
}

async fn spawn_worker(app: &TestApp, extra: &[(&str, &str)]) -> KillOnDrop {
    let mut env = app.env_pairs();
    env.extend_from_slice(extra);
    KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env))
}

/// How many jobs of `kind` were claimed at least once.
async fn claimed(app: &TestApp, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = $1 AND attempt >= 1")
        .bind(kind)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn run_row(pool: PgPool, row: &Row) {
    let app = TestApp::start(pool, &[]).await;
    reliability::grant_everything(&app).await;
    let run = app.create_run(0).await;
    let submit = async || {
        let email = app.submit(TestApp::email(&run, "e1", "Invoice 42")).await;
        let hook = app.submit(app.webhook(&run, "h1", 42)).await;
        (email, hook)
    };

    // Bring both deliveries to the stage under test.
    let (email, hook) = match row.stage {
        Stage::Score => submit().await,
        Stage::Send | Stage::Rescue => {
            let (stop, worker) = app.start_worker("w-prep");
            let ids = submit().await;
            for id in [&ids.0, &ids.1] {
                app.wait_state(id, DeliveryState::Approved, WAIT).await;
            }
            stop.cancel();
            worker.await.unwrap().unwrap();
            app.set_switch(true).await;
            ids
        }
    };
    if row.stage == Stage::Rescue {
        // A worker that performs both effects, freezes before recording them, and is killed.
        let mut sender = spawn_worker(&app, &[("AIRLOCK_FAULTS", "send.after_effect=pause")]).await;
        app.smtp.wait_for(1, WAIT).await;
        let hooks = &app.hooks;
        harness::wait_for("the webhook call", WAIT, || async move { (!hooks.hits().is_empty()).then_some(()) }).await;
        harness::signal(&sender.0, Signal::SIGKILL);
        reliability::wait_exit(&mut sender.0, WAIT).await;
    }

    // The crash: each doomed worker aborts at the first time it reaches the point.
    let spec = format!("{}=abort", row.point);
    let rounds = if row.stage == Stage::Rescue { 1 } else { 2 };
    for round in 0..rounds {
        let mut doomed = spawn_worker(&app, &[("AIRLOCK_FAULTS", &spec), ("AIRLOCK__WORKER__CONCURRENCY", "1")]).await;
        let status = reliability::wait_exit(&mut doomed.0, WAIT).await;
        assert!(reliability::aborted(&status), "{}: round {round} ended with {status:?}, not at the fault", row.name);
    }
    match row.stage {
        Stage::Score => assert_eq!(claimed(&app, "delivery.score").await, 2, "{}: both scores crashed", row.name),
        Stage::Send => assert_eq!(claimed(&app, "delivery.send").await, 2, "{}: both sends crashed", row.name),
        Stage::Rescue => {
            let running: i64 =
                sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'delivery.send' AND state = 'running'")
                    .fetch_one(&app.pool)
                    .await
                    .unwrap();
            assert_eq!(running, 2, "{}: the crashed rescue moved nothing", row.name);
        }
    }
    if row.stage == Stage::Score {
        app.set_switch(true).await;
    }

    // Recovery by a healthy worker.
    let _healthy = spawn_worker(&app, &[]).await;
    app.wait_state(&email, row.email.state, WAIT).await;
    app.wait_state(&hook, row.webhook.state, WAIT).await;
    reliability::settle(&app.pool, WAIT).await;

    let email_key = reliability::key_of(&app.pool, &email).await;
    let hook_key = reliability::key_of(&app.pool, &hook).await;
    assert_eq!(reliability::state_of(&app.pool, &email).await, row.email.state, "{}: email", row.name);
    assert_eq!(reliability::state_of(&app.pool, &hook).await, row.webhook.state, "{}: webhook", row.name);
    assert_eq!(reliability::accepted_for(&app, &email_key), row.email.received, "{}: messages accepted", row.name);
    let (requests, bodies) = reliability::hits_for(&app, &hook_key);
    assert_eq!(requests, row.webhook.received, "{}: webhook requests", row.name);
    assert_eq!(bodies, 1, "{}: every request carried the same body", row.name);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &email).await, row.email.attempts, "{}: email", row.name);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &hook).await, row.webhook.attempts, "{}: webhook", row.name);
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}
