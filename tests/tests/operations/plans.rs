//! The plans of the read a reviewer pages through, over a history: the review queue is a
//! range of its index from the cursor on, with no sort and no scan of the deliveries that
//! finished long ago, in a fresh plan and in the generic one a process keeps.

use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::deliveries::list_statement;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use sqlx::PgPool;

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_review_queue_is_read_through_its_index_whatever_the_history(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let first = app.submit(TestApp::email(&run, "first", "Your order")).await;
    // The history: 30,000 deliveries, one in sixty of them still waiting for review.
    sqlx::query(
        "INSERT INTO deliveries (id, run_id, step_id, agent, channel, state, idempotency_key, artifact_sha256,
                                 submitted_sha256, effect_class, event_hash, created_at)
         SELECT gen_random_uuid(), d.run_id, 'h' || g, d.agent, d.channel,
                (CASE WHEN g % 60 = 0 THEN 'in_review' ELSE 'sent' END)::delivery_state, 'h' || g,
                d.artifact_sha256, d.submitted_sha256, d.effect_class, d.event_hash, now() - make_interval(secs => g)
         FROM deliveries d, generate_series(1, 30000) g WHERE d.id = $1::uuid",
    )
    .bind(&first)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE deliveries").execute(&app.pool).await.unwrap();
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
            None => "'in_review', 51".to_string(),
            Some(_) => format!("'in_review', '{}', '{id}', 51", at.to_rfc3339()),
        };
        for (mode, plan) in harness::plans(&mut conn, "list", &args).await {
            assert!(plan.contains("Index Scan using deliveries_state_idx"), "{page}, {mode}: {plan}");
            assert!(!plan.contains("Sort"), "{page}, {mode}: no sort of the queue: {plan}");
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
