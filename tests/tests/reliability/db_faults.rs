//! Database faults in the middle of a send, between the effect and its record
//! (transaction B), and at the commit of transaction A.
//!
//! The relay holds its answer to the message body (`Fault::HoldAfterData`) until the suite
//! has set the fault up, so the worker is exactly between "the relay has the message" and
//! "the receipt is written" when the database fails it:
//!
//! - a statement timeout (the worker's connections carry `statement_timeout`; the suite
//!   holds the delivery's row lock, so B's first statement times out again and again);
//! - an exhausted connection pool (an in-process worker whose small pool the suite holds);
//! - the answer to a COMMIT lost after the server committed (a proxy cuts the connection).
//!
//! The promise: the outcome is retried from memory until it is recorded, or the lease
//! expires and the rescuer parks the delivery; nothing is ever reported `sent` without a
//! receipt, and nothing is sent twice.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use airlock_tests::pgproxy::PgProxy;
use airlock_tests::smtp::Fault;
use airlock_tests::{invariants, reliability};
use nix::sys::signal::Signal;
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// An email (or webhook) scored and approved by a standing grant, with the switch on.
async fn approved(app: &TestApp, webhook: bool) -> String {
    reliability::grant_everything(app).await;
    let run = app.create_run(0).await;
    let (stop, prep) = app.start_worker("w-prep");
    let id = if webhook {
        app.submit(app.webhook(&run, "h1", 7)).await
    } else {
        app.submit(TestApp::email(&run, "e1", "Invoice 7")).await
    };
    app.wait_state(&id, DeliveryState::Approved, WAIT).await;
    stop.cancel();
    prep.await.unwrap().unwrap();
    app.set_switch(true).await;
    id
}

/// The delivery as its agent sees it, and a database-wide check: no `sent` delivery lacks
/// a receipt. Returns the state the agent sees.
async fn observe(app: &TestApp, id: &str) -> String {
    let (status, v) = app.call("GET", &format!("{}/v1/deliveries/{id}", app.api), Some(&app.agent), None).await;
    assert!(status.is_success(), "{v}");
    let unreceipted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries d WHERE state = 'sent' AND NOT EXISTS \
         (SELECT 1 FROM receipts r WHERE r.delivery_id = d.id)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(unreceipted, 0, "a delivery is reported sent without a receipt");
    if v["state"] == "sent" {
        assert!(!v["receipt"].is_null(), "reported sent without a receipt: {v}");
    } else {
        assert_eq!(v["receipt"], Value::Null, "a receipt before the delivery is sent: {v}");
    }
    v["state"].as_str().unwrap().to_string()
}

fn with_statement_timeout(url: &str, ms: u32) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options[statement_timeout]={ms}")
}

/// Statement starts of other sessions of this database that wait for a lock: with the
/// delivery's row held, each one is a fresh attempt of B (the first of its statements that
/// needs the row: the receipt's foreign key check, or the delivery's update).
async fn blocked_attempts(app: &TestApp, seen: &mut HashSet<String>) {
    let rows: Vec<String> = sqlx::query_scalar(
        r#"SELECT query_start::text FROM pg_stat_activity
           WHERE datname = current_database() AND pid <> pg_backend_pid()
             AND wait_event_type = 'Lock'"#,
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    seen.extend(rows);
}

/// A real worker whose statements time out after 300 ms, stopped between the relay's
/// receipt of the message and its answer.
async fn worker_in_the_middle_of_b(app: &TestApp) -> KillOnDrop {
    app.smtp.push_faults([Fault::HoldAfterData]);
    let url = with_statement_timeout(&app.db_url, 300);
    let mut env = app.env_pairs();
    env.push(("DATABASE_URL", &url));
    let worker = KillOnDrop(harness::spawn("airlock-worker", &[], &url, &env));
    assert!(app.smtp.wait_held(1, WAIT).await, "the worker reached the relay");
    worker
}

async fn lock_delivery(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: &str) {
    sqlx::query("SELECT 1 FROM deliveries WHERE id = $1 FOR UPDATE")
        .bind(Uuid::parse_str(id).unwrap())
        .execute(&mut **tx)
        .await
        .unwrap();
}

async fn stop_worker(mut worker: KillOnDrop) {
    harness::signal(&worker.0, Signal::SIGTERM);
    let status = reliability::wait_exit(&mut worker.0, WAIT).await;
    assert!(status.success(), "{status:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn statement_timeouts_in_b_are_retried_from_memory_until_recorded(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, false).await;
    let worker = worker_in_the_middle_of_b(&app).await;

    let mut tx = app.pool.begin().await.unwrap();
    lock_delivery(&mut tx, &id).await;
    app.smtp.release_held();
    app.smtp.wait_for(1, WAIT).await;
    // B times out on the row lock, again and again; meanwhile the delivery is `sending`.
    let mut seen = HashSet::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while seen.len() < 3 {
        assert!(tokio::time::Instant::now() < deadline, "B was not retried: {seen:?}");
        assert_eq!(observe(&app, &id).await, "sending");
        blocked_attempts(&app, &mut seen).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tx.commit().await.unwrap();

    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    assert_eq!(observe(&app, &id).await, "sent");
    assert_eq!(d["receipt"]["attempt"], 1, "recorded under the original lease");
    assert_eq!(app.smtp.accepted().len(), 1);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["sent"]);
    stop_worker(worker).await;
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

/// Makes every UPDATE or DELETE of a job slow (half a second) while `slow_jobs.on` is set,
/// and counts, in a sequence (which a rollback does not undo), those that change a job's
/// state (a job that finishes leaves its live partition: a DELETE, then an INSERT).
async fn slow_job_updates(app: &TestApp) {
    for sql in [
        "CREATE TABLE slow_jobs (on_ boolean NOT NULL)",
        "INSERT INTO slow_jobs VALUES (false)",
        "CREATE SEQUENCE slow_job_state_changes",
        r#"CREATE FUNCTION slow_job_update() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
               IF (SELECT on_ FROM slow_jobs) THEN
                   IF TG_OP = 'DELETE' OR NEW.state IS DISTINCT FROM OLD.state THEN
                       PERFORM nextval('slow_job_state_changes');
                   END IF;
                   PERFORM pg_sleep(0.5);
               END IF;
               IF TG_OP = 'DELETE' THEN
                   RETURN OLD;
               END IF;
               RETURN NEW;
           END $$"#,
        "CREATE TRIGGER slow_job_update BEFORE UPDATE OR DELETE ON jobs FOR EACH ROW EXECUTE FUNCTION slow_job_update()",
    ] {
        sqlx::query(sql).execute(&app.pool).await.unwrap();
    }
}

async fn set_slow(app: &TestApp, on: bool) {
    sqlx::query("UPDATE slow_jobs SET on_ = $1").bind(on).execute(&app.pool).await.unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn statement_timeouts_past_the_lease_park_the_delivery(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, false).await;
    slow_job_updates(&app).await;
    let worker = worker_in_the_middle_of_b(&app).await;

    // Every job update of the worker now outlasts its statement timeout: B's (it ends the
    // job with the receipt) and the heartbeats'. B is retried; the lease runs out.
    set_slow(&app, true).await;
    app.smtp.release_held();
    app.smtp.wait_for(1, WAIT).await;
    let pool = app.pool.clone();
    let id_ref = &id;
    harness::wait_for("B to fail twice and the lease to run out", WAIT, || {
        let pool = pool.clone();
        async move {
            let (tries, expired): (i64, bool) = sqlx::query_as(
                "SELECT (SELECT last_value FROM slow_job_state_changes), \
                        (SELECT lease_expires_at < now() FROM jobs \
                         WHERE payload->>'delivery_id' = $1 AND kind = 'delivery.send')",
            )
            .bind(id_ref)
            .fetch_one(&pool)
            .await
            .unwrap();
            (tries >= 2 && expired).then_some(())
        }
    })
    .await;
    assert_eq!(observe(&app, &id).await, "sending");

    // Another worker's rescuer (passes on the suite's pool, which has no statement timeout)
    // parks the email: a pass skips the job while one of B's tries holds its row.
    let registry = airlock_worker::app::registry_with(&app.config, "w-rescuer", &|n| app.secret(n)).unwrap();
    harness::wait_for("the rescuer to park the email", WAIT, || async {
        let c = airlock_worker::runtime::rescue_once(&app.pool, &registry, 100).await.unwrap();
        (c.parked == 1).then_some(())
    })
    .await;
    set_slow(&app, false).await;

    app.wait_state(&id, DeliveryState::Parked, WAIT).await;
    stop_worker(worker).await;
    assert_eq!(observe(&app, &id).await, "parked", "the late outcome was refused");
    assert_eq!(app.smtp.accepted().len(), 1, "delivered once, parked for a human to confirm");
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["lease_expired"]);
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

/// Takes every connection of `pool` but the LISTEN one, so the worker behind it can run
/// no statement.
async fn hog(pool: &PgPool) -> Vec<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let want = pool.options().get_max_connections() as usize - 1;
    let mut held = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while held.len() < want {
        assert!(tokio::time::Instant::now() < deadline, "could not take every pooled connection");
        if let Ok(c) = pool.acquire().await {
            held.push(c);
        }
    }
    assert_eq!(pool.num_idle(), 0);
    held
}

/// An in-process worker on a pool of three connections (one is its LISTEN connection),
/// stopped between the relay's receipt of the message and its answer.
async fn small_pool_worker(
    app: &TestApp,
) -> (PgPool, tokio_util::sync::CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
    app.smtp.push_faults([Fault::HoldAfterData]);
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_millis(300))
        .connect(&app.db_url)
        .await
        .unwrap();
    let settings = airlock_worker::WorkerSettings::from_config(&app.config, "w-small-pool".into());
    let registry = airlock_worker::app::registry_with(&app.config, "w-small-pool", &|n| app.secret(n)).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let handle = tokio::spawn(airlock_worker::Worker::new(pool.clone(), registry, settings).run(stop.clone()));
    assert!(app.smtp.wait_held(1, WAIT).await, "the worker reached the relay");
    (pool, stop, handle)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_exhausted_pool_in_b_is_retried_from_memory_until_recorded(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, false).await;
    let (worker_pool, stop, handle) = small_pool_worker(&app).await;

    let held = hog(&worker_pool).await;
    app.smtp.release_held();
    app.smtp.wait_for(1, WAIT).await;
    // B cannot get a connection (each try gives up after 300 ms) for a good second, well
    // inside the lease; the delivery stays `sending`, with no receipt.
    let until = tokio::time::Instant::now() + Duration::from_millis(1200);
    while tokio::time::Instant::now() < until {
        assert_eq!(observe(&app, &id).await, "sending");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(held);

    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    assert_eq!(observe(&app, &id).await, "sent");
    assert_eq!(d["receipt"]["attempt"], 1);
    assert_eq!(app.smtp.accepted().len(), 1);
    stop.cancel();
    handle.await.unwrap().unwrap();
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_exhausted_pool_past_the_lease_parks_the_delivery(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, false).await;
    let (worker_pool, stop, handle) = small_pool_worker(&app).await;

    let held = hog(&worker_pool).await;
    app.smtp.release_held();
    app.smtp.wait_for(1, WAIT).await;
    // No heartbeat gets through either: the lease runs out, and another worker's rescuer
    // (here, a pass on the suite's own pool) parks the email.
    let registry = airlock_worker::app::registry_with(&app.config, "w-rescuer", &|n| app.secret(n)).unwrap();
    harness::wait_for("the rescuer to park the email", WAIT, || async {
        assert_ne!(observe(&app, &id).await, "sent");
        let c = airlock_worker::runtime::rescue_once(&app.pool, &registry, 100).await.unwrap();
        (c.parked == 1).then_some(())
    })
    .await;
    drop(held);

    // The worker gets its connections back: its late outcome is refused. Stopping it waits
    // for the send in flight to give up.
    stop.cancel();
    handle.await.unwrap().unwrap();
    assert_eq!(observe(&app, &id).await, "parked");
    assert_eq!(app.smtp.accepted().len(), 1);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["lease_expired"]);
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

/// A real worker behind a proxy that cuts the answer to the COMMIT of the transaction in
/// which `marker` was sent.
async fn worker_behind_a_lost_commit(app: &TestApp, marker: &str) -> (PgProxy, KillOnDrop) {
    let proxy = PgProxy::for_url(&app.db_url).await.unwrap();
    proxy.cut_commit_after(marker);
    let url = proxy.url(&app.db_url);
    let mut env = app.env_pairs();
    env.push(("DATABASE_URL", &url));
    let worker = KillOnDrop(harness::spawn("airlock-worker", &[], &url, &env));
    (proxy, worker)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_lost_commit_answer_of_b_still_gives_one_receipt(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, false).await;
    let (proxy, worker) = worker_behind_a_lost_commit(&app, "INSERT INTO receipts").await;

    let d = app.wait_state(&id, DeliveryState::Sent, WAIT).await;
    reliability::settle(&app.pool, WAIT).await;
    assert_eq!(proxy.cuts(), 1, "B committed, and its answer was lost");
    stop_worker(worker).await;
    assert_eq!(d["receipt"]["attempt"], 1);
    assert_eq!(app.smtp.accepted().len(), 1, "the retry of B sent nothing again");
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["sent"]);
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

/// Transaction A committed, but the worker got an error: it cannot tell whether the
/// attempt is on record, so it must not retry the job as if nothing had started.
async fn lost_commit_answer_of_a(pool: PgPool, webhook: bool) -> (TestApp, String) {
    let app = TestApp::start(pool, &[]).await;
    let id = approved(&app, webhook).await;
    let (proxy, worker) = worker_behind_a_lost_commit(&app, "INSERT INTO send_attempts").await;
    harness::wait_for("the commit of A to be cut", WAIT, || async { (proxy.cuts() == 1).then_some(()) }).await;
    reliability::settle(&app.pool, WAIT).await;
    stop_worker(worker).await;
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
    (app, id)
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_lost_commit_answer_of_a_parks_the_email(pool: PgPool) {
    let (app, id) = lost_commit_answer_of_a(pool, false).await;
    // The attempt is on record and its effect may have started, as far as anyone can
    // tell from the database: a human decides (the relay has nothing under its Message-ID).
    assert_eq!(reliability::state_of(&app.pool, &id).await, DeliveryState::Parked);
    assert!(app.smtp.accepted().is_empty());
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["lease_expired"]);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_lost_commit_answer_of_a_resends_the_webhook_once(pool: PgPool) {
    let (app, id) = lost_commit_answer_of_a(pool, true).await;
    assert_eq!(reliability::state_of(&app.pool, &id).await, DeliveryState::Sent);
    assert_eq!(app.hooks.hits().len(), 1);
    assert_eq!(reliability::attempt_outcomes(&app.pool, &id).await, ["lease_expired", "sent"]);
}
