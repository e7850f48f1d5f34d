//! The send gate, decided at transaction A and nowhere else: a send whose job was claimed
//! while sending was on is refused once the switch went off before its transaction A, and
//! a sender or a webhook origin removed from the configuration after approval is refused at
//! send time. Each case drives transaction A directly, after the change, so the order is
//! fixed by the test, not by timing; each is checked for one send and for a batch.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_core::config::Config;
use airlock_core::ids::DeliveryId;
use airlock_delivery::pipeline::{self, SendStart};
use airlock_delivery::state::DeliveryState;
use airlock_queue::{self as queue, ClaimFilter, JobState, Lease};
use airlock_tests::app::TestApp;
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(30);

/// Approved deliveries (emails from the verified sender, webhooks to the allowed origin),
/// the switch on, and their send jobs claimed by a probe, in delivery order.
async fn claimed_sends(app: &TestApp, emails: usize, webhooks: usize) -> Vec<(Lease, DeliveryId)> {
    let (stop, worker) = app.start_worker("w-score");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..emails {
        ids.push(app.submit(TestApp::email(&run, &format!("e{i}"), "Gate")).await);
    }
    for i in 0..webhooks {
        ids.push(app.submit(app.webhook(&run, &format!("w{i}"), i as u64)).await);
    }
    for id in &ids {
        app.wait_state(id, DeliveryState::AwaitingApproval, WAIT).await;
    }
    stop.cancel();
    worker.await.unwrap().unwrap();
    for id in &ids {
        app.approve(id).await;
    }
    app.set_switch(true).await;
    let sends = ClaimFilter { queues: Some(vec![pipeline::SEND_QUEUE.into()]) };
    let jobs = queue::claim_batch(&app.pool, "probe", &sends, ids.len() as i64, Duration::from_secs(60)).await.unwrap();
    assert_eq!(jobs.len(), ids.len(), "every send job is claimed");
    let mut claimed: Vec<(Lease, DeliveryId)> =
        jobs.iter().map(|j| (j.lease(), j.payload["delivery_id"].as_str().unwrap().parse().unwrap())).collect();
    claimed.sort_by_key(|(_, id)| *id);
    claimed
}

/// What a refused or held-back start left behind: attempts, the delivery's state, and the
/// job's state and effect mark.
async fn left(app: &TestApp, lease: Lease, id: DeliveryId) -> (i64, DeliveryState, JobState, bool) {
    let attempts: i64 = sqlx::query_scalar("SELECT count(*) FROM send_attempts WHERE delivery_id = $1")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let d = airlock_delivery::store::get(&app.pool, id).await.unwrap().unwrap();
    let job = queue::get(&app.pool, lease.id()).await.unwrap();
    (attempts, d.state, job.state, job.effect_started_at.is_some())
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_send_claimed_before_the_switch_went_off_is_held_back_at_transaction_a(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let claimed = claimed_sends(&app, 2, 1).await;
    // The switch goes off after every job was claimed, before any transaction A.
    app.set_switch(false).await;
    let (one, batch) = claimed.split_first().unwrap();
    let r = pipeline::begin_send(&app.pool, &app.config, one.0, "probe", one.1).await;
    assert!(matches!(r, Ok(SendStart::SwitchOff)), "{r:?}");
    let starts = pipeline::begin_send_many(&app.pool, &app.config, "probe", batch).await;
    assert!(starts.iter().all(|r| matches!(r, Ok(SendStart::SwitchOff))), "{starts:?}");
    for (lease, id) in &claimed {
        assert_eq!(
            left(&app, *lease, *id).await,
            (0, DeliveryState::Approved, JobState::Running, false),
            "nothing started: no attempt, no effect mark, still approved"
        );
    }
    assert_eq!(
        app.smtp.accepted().len() + app.smtp.dropped_after_data().len() + app.hooks.hits().len(),
        0,
        "nothing reached the outside"
    );

    // On again: the same held sends start.
    app.set_switch(true).await;
    let starts = pipeline::begin_send_many(&app.pool, &app.config, "probe", &claimed).await;
    assert!(starts.iter().all(|r| matches!(r, Ok(SendStart::Started { .. }))), "{starts:?}");
}

/// The test configuration with `key` set to `value`, as a worker restarted with it reads it.
fn reconfigured(app: &TestApp, key: &str, value: &str) -> Config {
    let mut env = app.env.clone();
    env.retain(|(k, _)| k != key);
    env.push((key.into(), value.into()));
    Config::from_sources(None, &env).unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_sender_removed_after_approval_is_refused_at_send_time(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let claimed = claimed_sends(&app, 3, 0).await;
    // agent@example.com is no longer a verified sender (only the @airlock.test domain is).
    let cfg = reconfigured(&app, "AIRLOCK__DELIVERY__SENDERS", "@airlock.test");
    let (one, batch) = claimed.split_first().unwrap();
    let r = pipeline::begin_send(&app.pool, &cfg, one.0, "probe", one.1).await;
    assert!(matches!(&r, Ok(SendStart::Refused(why)) if why.contains("email.from")), "{r:?}");
    let starts = pipeline::begin_send_many(&app.pool, &cfg, "probe", batch).await;
    assert!(starts.iter().all(|r| matches!(r, Ok(SendStart::Refused(_)))), "{starts:?}");
    for (lease, id) in &claimed {
        assert_eq!(
            left(&app, *lease, *id).await,
            (0, DeliveryState::Failed, JobState::Failed, false),
            "refused: no attempt, the delivery and its job failed"
        );
    }
    assert!(app.smtp.accepted().is_empty() && app.smtp.connections() == 0, "nothing reached the relay");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_webhook_origin_removed_after_approval_is_refused_at_send_time(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let claimed = claimed_sends(&app, 1, 2).await;
    // The receiver's origin leaves both the list and its endpoint entry.
    let mut cfg = reconfigured(&app, "AIRLOCK__DELIVERY__WEBHOOK_ORIGINS", "https://elsewhere.example");
    cfg.delivery.webhook_endpoints.clear();
    let starts = pipeline::begin_send_many(&app.pool, &cfg, "probe", &claimed).await;
    let mut webhooks = 0;
    for ((lease, id), start) in claimed.iter().zip(&starts) {
        let d = airlock_delivery::store::get(&app.pool, *id).await.unwrap().unwrap();
        match d.channel {
            airlock_delivery::artifact::Channel::Webhook => {
                webhooks += 1;
                assert!(matches!(start, Ok(SendStart::Refused(why)) if why.contains("webhook.url")), "{start:?}");
                assert_eq!(left(&app, *lease, *id).await, (0, DeliveryState::Failed, JobState::Failed, false));
            }
            // The email in the same batch is not affected by the webhook policy.
            airlock_delivery::artifact::Channel::Email => {
                assert!(matches!(start, Ok(SendStart::Started { .. })), "{start:?}");
                assert_eq!(left(&app, *lease, *id).await, (1, DeliveryState::Sending, JobState::Running, true));
            }
        }
    }
    assert_eq!(webhooks, 2);
    assert!(app.hooks.hits().is_empty(), "nothing reached a receiver");
}
