//! The event log's partitions and archive: finished periods leave the hot log while the
//! pipeline runs, with every chain still whole and verified (now across the hot log and the
//! archive), nothing sent twice or lost; a period with a delivery still moving stays; and
//! the archive refuses what its functions are not for.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::archive::{self, Archived};
use airlock_tests::app::TestApp;
use airlock_tests::harness::wait_for;
use airlock_tests::invariants;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);
const SECOND: Duration = Duration::from_secs(1);
const LOCK_WAIT: Duration = Duration::from_millis(500);

/// One-second periods, archived a second after they end, by a worker that looks every
/// second.
const SHORT_PERIODS: &[(&str, &str)] = &[
    ("AIRLOCK__RETENTION__EVENT_PARTITION_SECONDS", "1"),
    ("AIRLOCK__RETENTION__EVENT_PARTITIONS_AHEAD", "5"),
    ("AIRLOCK__RETENTION__ARCHIVE_EVENTS_AFTER_SECONDS", "1"),
    ("AIRLOCK__RETENTION__INTERVAL_SECONDS", "1"),
    ("AIRLOCK__RETENTION__LOCK_TIMEOUT_MS", "500"),
];

/// The partitions of `parent` and their periods' ends, oldest first.
async fn partitions(pool: &PgPool, parent: &str) -> Vec<(String, Option<Uuid>, Option<Uuid>)> {
    sqlx::query_as("SELECT part::text, lo, hi FROM airlock_partitions($1::regclass) ORDER BY lo NULLS FIRST")
        .bind(parent)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Where a delivery's events are: (in the hot log, in the archive).
async fn whereabouts(pool: &PgPool, id: Uuid) -> (i64, i64) {
    sqlx::query_as(
        r#"SELECT (SELECT count(*) FROM delivery_events WHERE delivery_id = $1),
                  (SELECT count(*) FROM delivery_events_archive WHERE delivery_id = $1)"#,
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn finished_periods_move_to_the_archive_while_the_pipeline_runs(pool: PgPool) {
    let app = Arc::new(TestApp::start(pool, SHORT_PERIODS).await);
    // The migration laid out week-long periods; cut to seconds while they are empty.
    archive::ensure_partitions(&app.pool, SECOND, 5, LOCK_WAIT).await.unwrap();
    let now: Uuid = sqlx::query_scalar("SELECT airlock_uuid_floor(now())").fetch_one(&app.pool).await.unwrap();
    let current = partitions(&app.pool, "delivery_events")
        .await
        .into_iter()
        .find(|(_, lo, hi)| lo.is_some_and(|lo| lo <= now) && hi.is_some_and(|hi| now < hi))
        .expect("a partition covers now");
    let length: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM airlock_uuid_time($2) - airlock_uuid_time($1))::float8")
            .bind(current.1)
            .bind(current.2)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(length <= 1.0, "the partition covering now spans {length} s");

    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-archive");
    let run = app.create_run(0).await;
    // The pipeline runs throughout: submissions, scoring, approvals and sends, one after
    // another, until told to stop.
    let producing = CancellationToken::new();
    let producer = tokio::spawn({
        let (app, producing, run) = (app.clone(), producing.clone(), run.clone());
        async move {
            let mut ids = Vec::new();
            while !producing.is_cancelled() {
                let step = format!("s{}", ids.len());
                let id = app.submit(TestApp::email(&run, &step, &format!("Message {step}"))).await;
                app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
                app.approve(&id).await;
                ids.push(id);
            }
            ids
        }
    });
    // The worker archives periods behind the writers: three that held deliveries.
    let pool = app.pool.clone();
    wait_for("three archived periods with deliveries", WAIT, || {
        let pool = pool.clone();
        async move {
            let seals = archive::seals(&pool).await.unwrap();
            (seals.iter().filter(|s| s.deliveries > 0).count() >= 3).then_some(())
        }
    })
    .await;
    let first_archived: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(archived_at) FROM delivery_event_archives WHERE deliveries > 0")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    // ... and the pipeline goes on past them.
    let pool = app.pool.clone();
    wait_for("deliveries submitted after the first archived period", WAIT, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE created_at > $1 AND state = 'sent'")
                .bind(first_archived)
                .fetch_one(&pool)
                .await
                .unwrap();
            (n >= 5).then_some(())
        }
    })
    .await;
    producing.cancel();
    let ids = producer.await.unwrap();
    for id in &ids {
        app.wait_state(id, DeliveryState::Sent, WAIT).await;
    }
    // Every period that has ended by now closes too (all its deliveries are sent).
    let pool = app.pool.clone();
    let last: Uuid = ids.last().unwrap().parse().unwrap();
    wait_for("the last delivery's period in the archive", WAIT, || {
        let pool = pool.clone();
        async move { (whereabouts(&pool, last).await.0 == 0).then_some(()) }
    })
    .await;
    stop.cancel();
    worker.await.unwrap().unwrap();

    // Nothing lost or repeated: each message went out once, and every delivery's events are
    // in exactly one place, all of them.
    assert_eq!(app.smtp.accepted().len(), ids.len());
    assert!(app.smtp.accepted_by_message_id().values().all(|n| *n == 1));
    let seals = archive::seals(&app.pool).await.unwrap();
    assert!(seals.iter().all(|s| s.sound()), "{seals:?}");
    for id in &ids {
        let uuid: Uuid = id.parse().unwrap();
        let version: i32 = sqlx::query_scalar("SELECT version FROM deliveries WHERE id = $1")
            .bind(uuid)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        let (hot, archived) = whereabouts(&app.pool, uuid).await;
        assert!(hot == 0 || archived == 0, "{id}: events in both the hot log ({hot}) and the archive ({archived})");
        assert_eq!(hot + archived, version as i64, "{id}: events lost");
    }
    // Each seal counts what its period holds.
    for s in &seals {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE ($1::uuid IS NULL OR id >= $1) AND id < $2")
                .bind(s.lo)
                .bind(s.hi)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(n, s.deliveries, "{s:?}");
    }
    // The chains verify across both (the shared checker reads them together) ...
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
    // ... and an archived delivery reads as before, its whole history with it.
    let first: Uuid = ids[0].parse().unwrap();
    assert_eq!(whereabouts(&app.pool, first).await.0, 0, "the first delivery is archived");
    let view = app.delivery(&ids[0]).await;
    let events = view["events"].as_array().unwrap();
    let to: Vec<&str> = events.iter().map(|e| e["to"].as_str().unwrap()).collect();
    assert_eq!(to.first(), Some(&"persisted"));
    assert_eq!(to.last(), Some(&"sent"));
    assert_eq!(events.len() as i64, view["version"].as_i64().unwrap());
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_period_stays_in_the_hot_log_while_one_of_its_deliveries_still_moves(pool: PgPool) {
    // Short periods, nothing archived by the worker: the test moves them itself.
    let mut env = SHORT_PERIODS.to_vec();
    env.retain(|(k, _)| !k.ends_with("ARCHIVE_EVENTS_AFTER_SECONDS"));
    env.push(("AIRLOCK__RETENTION__ARCHIVE_EVENTS_AFTER_SECONDS", "0"));
    let app = TestApp::start(pool, &env).await;
    archive::ensure_partitions(&app.pool, SECOND, 5, LOCK_WAIT).await.unwrap();
    let (stop, worker) = app.start_worker("w-open");
    let run = app.create_run(0).await;
    let waiting = app.submit(TestApp::email(&run, "waiting", "Still waiting")).await;
    app.wait_state(&waiting, DeliveryState::AwaitingApproval, WAIT).await;
    let waiting_id: Uuid = waiting.parse().unwrap();
    // Until its period has ended (and the next has begun), nothing could move anyway.
    let pool = app.pool.clone();
    wait_for("the waiting delivery's period to end", WAIT, || {
        let pool = pool.clone();
        async move {
            let ended: bool = sqlx::query_scalar(
                r#"SELECT p.hi < airlock_uuid_floor(now() - interval '1 second')
                   FROM airlock_partitions('delivery_events') p WHERE p.lo <= $1 AND $1 < p.hi"#,
            )
            .bind(waiting_id)
            .fetch_one(&pool)
            .await
            .unwrap();
            ended.then_some(())
        }
    })
    .await;
    // Archive whatever can go: every period before the waiting delivery's (empty ones),
    // never its own, nor any after it (the archive stays contiguous).
    while let Archived::Moved(seal) = archive::archive_once(&app.pool, Duration::ZERO, LOCK_WAIT).await.unwrap() {
        assert!(seal.hi <= waiting_id, "{seal:?} passed the waiting delivery");
        assert_eq!(seal.deliveries, 0);
    }
    assert_eq!(archive::archive_once(&app.pool, Duration::ZERO, LOCK_WAIT).await.unwrap(), Archived::Nothing);
    assert_eq!(whereabouts(&app.pool, waiting_id).await, (3, 0), "persisted, scored, awaiting approval: all hot");
    // Nor can it be forced: the move re-checks under the lock.
    let open: String = sqlx::query_scalar(
        "SELECT p.part::text FROM airlock_partitions('delivery_events') p WHERE p.lo <= $1 AND $1 < p.hi",
    )
    .bind(waiting_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let e = sqlx::query("SELECT airlock_archive_move($1, 500)").bind(&open).execute(&app.pool).await.unwrap_err();
    assert!(e.to_string().contains("no validated range constraint"), "{e}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {open} ADD CONSTRAINT {open}_range CHECK (delivery_id IS NOT NULL)"
    )))
    .execute(&app.pool)
    .await
    .unwrap();
    let e = sqlx::query("SELECT airlock_archive_move($1, 500)").bind(&open).execute(&app.pool).await.unwrap_err();
    assert!(e.to_string().contains("is not finished"), "{e}");
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {open} DROP CONSTRAINT {open}_range")))
        .execute(&app.pool)
        .await
        .unwrap();

    // A reviewer rejects it: a terminal state. Its period moves now, with it whole.
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/deliveries/{waiting}/reject", app.admin),
            Some(&app.reviewer),
            Some(json!({"reason": "not this one"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let mut moved = Vec::new();
    while let Archived::Moved(seal) = archive::archive_once(&app.pool, Duration::ZERO, LOCK_WAIT).await.unwrap() {
        moved.push(seal);
    }
    let sealed = moved.iter().find(|s| s.partition == open).expect("the period moved once its delivery finished");
    assert_eq!((sealed.deliveries, sealed.events, sealed.broken, sealed.strays), (1, 4, 0, 0));
    assert_eq!(whereabouts(&app.pool, waiting_id).await, (0, 4));
    stop.cancel();
    worker.await.unwrap().unwrap();
    invariants::check(&app.pool, &app.smtp.accepted(), &app.hooks.hits()).await.unwrap().assert_clean();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_partition_functions_refuse_what_they_are_not_for(pool: PgPool) {
    for (sql, expect) in [
        ("SELECT airlock_delivery_events_partitions(0, 4, 1000)", "must be positive"),
        ("SELECT airlock_delivery_events_partitions(60, 0, 1000)", "must be positive"),
        ("SELECT airlock_archive_prepare(-1, 1000)", "must not be negative"),
        ("SELECT airlock_archive_validate('jobs')", "is not a partition of delivery_events"),
        ("SELECT airlock_archive_validate('x; DROP TABLE jobs')", "is not a partition of delivery_events"),
        ("SELECT airlock_archive_move('deliveries', 100)", "is not a closed partition"),
        ("SELECT airlock_archive_move('delivery_events_p0', 100)", "no validated range constraint"),
        ("SELECT airlock_archive_seal('delivery_events_p0')", "is not a partition of delivery_events_archive"),
    ] {
        let e = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap_err();
        assert!(e.to_string().contains(expect), "{sql}: {e}");
    }
    assert!(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM jobs").fetch_one(&pool).await.is_ok());
    // An id no partition covers is refused, not misfiled: a far-future UUID v7.
    let e = sqlx::query(
        r#"INSERT INTO delivery_events (delivery_id, seq, to_state, actor, hash)
           VALUES (airlock_uuid_floor(now() + interval '10 years'), 1, 'persisted', 'agent:x', 'h')"#,
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(e.to_string().contains("no partition"), "{e}");
    // A moment's UUID and back.
    let (back, ordered): (bool, bool) = sqlx::query_as(
        r#"SELECT airlock_uuid_time(airlock_uuid_floor(t)) = date_trunc('milliseconds', t),
                  airlock_uuid_floor(t) <= $1 AND $1 < airlock_uuid_floor(t + interval '1 millisecond')
           FROM (SELECT airlock_uuid_time($1) AS t) x"#,
    )
    .bind(Uuid::now_v7())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(back && ordered);
}
