//! Helpers shared by the reliability suites (the step-boundary crash matrix, database
//! faults, lease pauses): waiting for real processes without blocking the runtime that
//! serves the SMTP server and the webhook receiver, telling a stopped process from a
//! running one, standing grants that approve every test delivery, and waiting for a run
//! to settle.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use airlock_delivery::state::DeliveryState;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::app::TestApp;
use crate::harness;

/// Waits for a child to exit, up to `timeout`, polling without blocking the runtime (the
/// in-process SMTP server and webhook receiver keep serving the child meanwhile). Kills it
/// and panics when it does not exit in time.
pub async fn wait_exit(child: &mut Child, timeout: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for child") {
            return status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("process {} did not exit within {timeout:?}", child.id());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True when the process died of SIGABRT, which is what an armed `abort` fault point does.
pub fn aborted(status: &ExitStatus) -> bool {
    status.signal() == Some(nix::sys::signal::Signal::SIGABRT as i32)
}

/// The state letter of a process from `/proc/PID/stat` (`R`, `S`, `T` for stopped, ...).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces; the state follows it.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next())
}

/// Waits until a child has stopped itself (SIGSTOP), up to `timeout`.
pub async fn wait_stopped(child: &Child, timeout: Duration) {
    let pid = child.id();
    harness::wait_for(&format!("process {pid} to stop"), timeout, || async move {
        (process_state(pid) == Some('T')).then_some(())
    })
    .await;
}

/// Standing grants for everything the test agent sends: email to `example.org` and
/// webhooks to the test receiver. Scoring then approves each delivery by itself.
pub async fn grant_everything(app: &TestApp) {
    let expires = (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339();
    let grants = [
        json!({"channel": "email", "agent_ids": ["agent-1"], "recipient_domains": ["example.org"],
               "min_score": 0.0, "expires_at": expires, "max_uses": 1_000_000,
               "reason": "reliability suite: approve every test email"}),
        json!({"channel": "webhook", "agent_ids": ["agent-1"], "webhook_origins": [app.hooks.origin()],
               "min_score": 0.0, "expires_at": expires, "max_uses": 1_000_000,
               "reason": "reliability suite: approve every test webhook"}),
    ];
    for g in grants {
        let (s, v) = app.call("POST", &format!("{}/admin/v1/grants", app.admin), Some(&app.operator), Some(g)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
}

/// Counts what is not settled yet: jobs still available or running, and deliveries in a
/// state that is neither terminal nor parked.
pub async fn unsettled(pool: &PgPool) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        r#"SELECT (SELECT count(*) FROM jobs WHERE state IN ('available', 'running')),
                  (SELECT count(*) FROM deliveries
                   WHERE state NOT IN ('sent', 'failed', 'parked', 'rejected', 'cancelled'))"#,
    )
    .fetch_one(pool)
    .await
}

/// Waits until no job is available or running and every delivery is terminal or parked.
pub async fn settle(pool: &PgPool, timeout: Duration) {
    harness::wait_for("every job and delivery to settle", timeout, || async move {
        matches!(unsettled(pool).await, Ok((0, 0))).then_some(())
    })
    .await;
}

/// A delivery's state, read straight from the database.
pub async fn state_of(pool: &PgPool, id: &str) -> DeliveryState {
    sqlx::query_scalar("SELECT state FROM deliveries WHERE id = $1")
        .bind(Uuid::parse_str(id).expect("delivery id"))
        .fetch_one(pool)
        .await
        .expect("delivery state")
}

/// A delivery's attempt outcomes in order (`open` for one without an outcome yet).
pub async fn attempt_outcomes(pool: &PgPool, id: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(outcome, 'open') FROM send_attempts WHERE delivery_id = $1 ORDER BY started_at, id",
    )
    .bind(Uuid::parse_str(id).expect("delivery id"))
    .fetch_all(pool)
    .await
    .expect("attempts")
}

/// A delivery's idempotency key.
pub async fn key_of(pool: &PgPool, id: &str) -> String {
    sqlx::query_scalar("SELECT idempotency_key FROM deliveries WHERE id = $1")
        .bind(Uuid::parse_str(id).expect("delivery id"))
        .fetch_one(pool)
        .await
        .expect("idempotency key")
}

/// How many messages the test SMTP server accepted for a delivery (by its Message-ID,
/// which carries the idempotency key).
pub fn accepted_for(app: &TestApp, key: &str) -> usize {
    app.smtp.accepted().iter().filter(|m| m.message_id.as_deref().is_some_and(|id| id.starts_with(key))).count()
}

/// How many requests the test webhook receiver got for a delivery, and how many distinct
/// bodies they carried.
pub fn hits_for(app: &TestApp, key: &str) -> (usize, usize) {
    let hits: Vec<_> = app.hooks.hits().into_iter().filter(|h| h.idempotency_key.as_deref() == Some(key)).collect();
    let bodies: std::collections::HashSet<Vec<u8>> = hits.iter().map(|h| h.body.clone()).collect();
    (hits.len(), bodies.len())
}
