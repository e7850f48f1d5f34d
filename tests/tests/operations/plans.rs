//! The plans of the read a reviewer pages through, over a history: the review queue is a
//! range of its index from the cursor on, with no sort and no scan of the deliveries that
//! finished long ago, in a fresh plan and in the generic one a process keeps.

use std::time::Duration;

use airlock_bench::history::{self, History};
use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::deliveries::list_statement;
use airlock_delivery::store::events;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const WAIT: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_review_queue_is_read_through_its_index_whatever_the_history(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let first = app.submit(TestApp::email(&run, "first", "Your order")).await;
    // The history: 30,000 deliveries, one in sixty of them still waiting for review, each
    // with an artifact of its own (a plan that joins the artifacts whole reads them all).
    sqlx::query(
        "INSERT INTO artifacts (sha256, body, size_bytes)
         SELECT encode(sha256(convert_to('h' || g, 'UTF8')), 'hex'),
                jsonb_build_object('channel', 'email', 'email', jsonb_build_object('subject', 'History ' || g)), 60
         FROM generate_series(1, 30000) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO deliveries (id, run_id, step_id, agent, channel, state, idempotency_key, artifact_sha256,
                                 submitted_sha256, effect_class, event_hash, created_at)
         SELECT gen_random_uuid(), d.run_id, 'h' || g, d.agent, d.channel,
                (CASE WHEN g % 60 = 0 THEN 'in_review' ELSE 'sent' END)::delivery_state,
                'dlv_' || airlock_effect_key(d.run_id, 'h' || g),
                encode(sha256(convert_to('h' || g, 'UTF8')), 'hex'), encode(sha256(convert_to('h' || g, 'UTF8')), 'hex'),
                d.effect_class, d.event_hash, now() - make_interval(secs => g)
         FROM deliveries d, generate_series(1, 30000) g WHERE d.id = $1::uuid",
    )
    .bind(&first)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE deliveries, artifacts").execute(&app.pool).await.unwrap();
    let (at, id): (DateTime<Utc>, uuid::Uuid) = sqlx::query_as(
        "SELECT created_at, id FROM deliveries WHERE state = 'in_review' ORDER BY created_at, id OFFSET 399 LIMIT 1",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();

    let mut conn = app.pool.acquire().await.unwrap();
    for (page, after) in [("the first page", None), ("a page 400 rows in", Some((at, id.into())))] {
        let statement = list_statement(&[DeliveryState::InReview], after, 51);
        let sql = statement.sql();
        sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE list AS {}", sql.as_str())))
            .execute(&mut *conn)
            .await
            .unwrap();
        let args = match after {
            None => "'in_review'".to_string(),
            Some(_) => format!("'in_review', '{}', '{id}'", at.to_rfc3339()),
        };
        for (mode, plan) in harness::plans(&mut conn, "list", &args).await {
            assert!(plan.contains("Index Scan using deliveries_state_idx"), "{page}, {mode}: {plan}");
            // The page's rows each look up their latest score by its index (a sort of that
            // delivery's few scores, after the plan's SubPlan); the page itself is not sorted.
            let (page_plan, per_row) = plan.split_once("SubPlan").unwrap_or((plan.as_str(), ""));
            assert!(!page_plan.contains("Sort"), "{page}, {mode}: no sort of the queue: {plan}");
            assert!(per_row.contains("scores_delivery_idx"), "{page}, {mode}: each row's score by its index: {plan}");
            assert!(!plan.contains("Seq Scan"), "{page}, {mode}: no scan of the history: {plan}");
            if after.is_some() {
                assert!(plan.contains("ROW(created_at, id) >"), "{page}, {mode}: the cursor starts the scan: {plan}");
            }
        }
        sqlx::query("DEALLOCATE list").execute(&mut *conn).await.unwrap();
    }
    drop(conn);

    // What the route answers from it: the queue only, oldest first, paged by the cursor.
    let mut seen = Vec::new();
    let mut url = format!("{}/admin/v1/deliveries?state=in_review&limit=200", app.admin);
    loop {
        let (s, v) = app.call("GET", &url, Some(&app.reviewer), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        for d in v["items"].as_array().unwrap() {
            assert_eq!(d["state"], "in_review", "{d}");
            seen.push(d["created_at"].as_str().unwrap().parse::<DateTime<Utc>>().unwrap());
        }
        match v["next"].as_str() {
            Some(c) => url = format!("{}/admin/v1/deliveries?state=in_review&limit=200&cursor={c}", app.admin),
            None => break,
        }
    }
    assert_eq!(seen.len(), 500, "every delivery in review, once");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "oldest first");
}

/// The name the sessions under measurement give themselves.
const MEASURED: &str = "airlock-measured";

/// The tables a month of history fills, with the sequential scans each has had so far:
/// read once every measured session has ended, and so has written its counts out.
async fn seq_scans(db: &PgPool) -> history::Scans {
    harness::wait_for("the measured sessions to end", Duration::from_secs(30), || async {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
        )
        .bind(MEASURED)
        .fetch_one(db)
        .await
        .unwrap();
        (others == 0).then_some(())
    })
    .await;
    history::seq_scans(db).await.unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn with_a_history_the_pipeline_and_the_admin_reads_scan_no_history_table(pool: PgPool) {
    let url = harness::database_url(&pool);
    let options: PgConnectOptions = url.parse().unwrap();
    let connect = || PgPoolOptions::new().max_connections(10).connect_with(options.clone().application_name(MEASURED));

    // A history the planner weighs as such: 20,000 finished deliveries with every row of
    // their journeys, 600 still in review, 40,000 run steps, 20,000 finished jobs.
    let loader = connect().await.unwrap();
    let h = History { deliveries: 20_000, in_review: 600, run_steps: 40_000, jobs: 20_000 };
    history::load(&loader, h, "plans").await.unwrap();
    loader.close().await;
    // What the loader made is the service's history: every chain verifies and ends at its
    // row's head, and every sent delivery has one receipt.
    let heads: Vec<(uuid::Uuid, String, i32)> =
        sqlx::query_as("SELECT id, event_hash, version FROM deliveries TABLESAMPLE SYSTEM (5) LIMIT 200")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(heads.len() >= 50, "a sample of the history: {}", heads.len());
    for (id, head, version) in &heads {
        let events = events::events(&pool, (*id).into()).await.unwrap();
        assert_eq!(events::verify_chain((*id).into(), &events), None, "the chain of {id} verifies");
        assert_eq!(events.len() as i32, *version, "{id}: one event per version");
        assert_eq!(&events.last().unwrap().hash, head, "{id}: the chain ends at the row's head");
    }
    let unsent: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM deliveries d WHERE d.state = 'sent'
         AND (SELECT count(*) FROM receipts r WHERE r.delivery_id = d.id) <> 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unsent, 0, "every sent delivery of the history has one receipt");
    let before = seq_scans(&pool).await;

    // On top of it, the pipeline's every path: deliveries approved by a grant, deliveries
    // a reviewer accepts and approves, run steps recorded, and the reviewer's reads.
    // An unknown domain scores 0.85: under this threshold, it waits for a reviewer.
    let app = TestApp::start(connect().await.unwrap(), &[("AIRLOCK__SCORING__REVIEW_THRESHOLD", "0.9")]).await;
    let body = json!({"channel": "email", "agent_ids": ["agent-1"], "recipient_domains": ["example.org"],
                      "min_score": 0.5, "expires_at": (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339(),
                      "max_uses": 1000, "reason": "reports to customers"});
    let (s, v) = app.call("POST", &format!("{}/admin/v1/grants", app.admin), Some(&app.operator), Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-history");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..12 {
        let mut body = TestApp::email(&run, &format!("report-{i}"), "Your weekly report");
        if i % 2 == 1 {
            body["email"]["to"] = json!(["bob@unknown.example"]);
        }
        ids.push(app.submit(body).await);
        let step = json!({"epoch": 1, "step_id": format!("note-{i}"), "kind": "model_output",
                          "data": {"text": "an answer"}, "usage": {"tokens": 12}});
        let (s, v) = app.call("POST", &format!("{}/v1/runs/{run}/steps", app.api), Some(&app.agent), Some(step)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    for id in ids.iter().skip(1).step_by(2) {
        app.wait_state(id, DeliveryState::InReview, WAIT).await;
        let url = format!("{}/admin/v1/deliveries/{id}/accept", app.admin);
        let (s, v) = app.call("POST", &url, Some(&app.reviewer), Some(json!({"note": "fine"}))).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        app.approve(id).await;
    }
    for id in &ids {
        app.wait_state(id, DeliveryState::Sent, WAIT).await;
        let (s, v) = app.call("GET", &format!("{}/v1/deliveries/{id}", app.api), Some(&app.agent), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    // The reviewer's queue, a page deep through the cursor, and one delivery of the history.
    let list = format!("{}/admin/v1/deliveries?state=in_review&limit=100", app.admin);
    let (s, v) = app.call("GET", &list, Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let cursor = v["next"].as_str().unwrap().to_string();
    let (s, v) = app.call("GET", &format!("{list}&cursor={cursor}"), Some(&app.reviewer), None).await;
    assert_eq!((s, v["items"].as_array().map(Vec::len)), (StatusCode::OK, Some(100)), "{v}");
    let (s, v) =
        app.call("GET", &format!("{}/admin/v1/deliveries/{}", app.admin, heads[0].0), Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(app.smtp.accepted().len(), ids.len(), "each delivery sent once");
    stop.cancel();
    worker.await.unwrap().unwrap();
    app.pool.close().await;

    let after = seq_scans(&pool).await;
    let scanned: Vec<_> =
        after.since(&before).iter().filter(|(_, n)| *n != 0).map(|(t, n)| format!("{t}: {n}")).collect();
    assert_eq!(after.tables(), history::TABLES.len(), "every history table is counted: {after:?}");
    assert!(scanned.is_empty(), "no history table is read whole on a hot path: {scanned:?}");
}
