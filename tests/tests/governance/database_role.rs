//! The append-only logs hold against the database: the application role may read and
//! insert them but never update, delete or truncate a row (tried here, as that role, while
//! the whole pipeline runs as it), a TRUNCATE is refused even to the owner, and removing
//! the newest audit entries, which leaves a valid chain, is caught against a head exported
//! beforehand (`airlock-admin audit export-head`, `audit verify --head`).
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const WAIT: Duration = Duration::from_secs(60);

/// SQLSTATE of "permission denied".
const INSUFFICIENT_PRIVILEGE: &str = "42501";

fn code_of(e: &sqlx::Error) -> String {
    e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()).unwrap_or_else(|| format!("{e}"))
}

async fn exec(pool: &PgPool, sql: String) -> Result<u64, sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(pool).await.map(|r| r.rows_affected())
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_application_role_cannot_change_or_remove_log_rows(owner: PgPool) {
    // A role of this test's own, granted as the migration grants the application role.
    let role = format!("airlock_app_t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    exec(&owner, format!("CREATE ROLE {role} LOGIN")).await.unwrap();
    let outcome = tokio::spawn(run_as_application(owner.clone(), role.clone())).await;
    // The role goes whatever happened, so a failure leaves nothing behind in the cluster.
    exec(&owner, format!("DROP OWNED BY {role}")).await.unwrap();
    exec(&owner, format!("DROP ROLE {role}")).await.unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn run_as_application(owner: PgPool, role: String) {
    sqlx::query("SELECT airlock_grant_application($1)").bind(&role).execute(&owner).await.unwrap();
    let options = (*owner.connect_options()).clone().username(&role);
    let app_pool = PgPoolOptions::new().max_connections(12).connect_with(options).await.unwrap();
    let who: String = sqlx::query_scalar("SELECT current_user::text").fetch_one(&app_pool).await.unwrap();
    assert_eq!(who, role);
    // The services start as it (nothing to migrate) ...
    airlock_core::db::migrate(&app_pool).await.unwrap();
    assert!(airlock_core::db::ready(&app_pool).await);

    // ... and the whole pipeline runs as it: submit, score, approve, switch on (audited), send.
    {
        let app = TestApp::start(app_pool.clone(), &[]).await;
        let (stop, worker) = app.start_worker("w-role");
        let run = app.create_run(0).await;
        let id = app.submit(TestApp::email(&run, "s1", "Hello")).await;
        app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
        app.approve(&id).await;
        app.set_switch(true).await;
        app.wait_state(&id, DeliveryState::Sent, WAIT).await;
        assert_eq!(app.smtp.wait_for(1, WAIT).await.len(), 1);
        stop.cancel();
        worker.await.unwrap().unwrap();
    }

    // It may give the tables the pipeline wrote their first statistics (the function runs
    // as their owner), and that function is the application role's, not everyone's.
    // (Its writes reach the table statistics within seconds: asked until they have.)
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut analyzed = Vec::new();
    while !analyzed.iter().any(|t| t == "deliveries") {
        assert!(tokio::time::Instant::now() < deadline, "deliveries never analyzed; analyzed {analyzed:?}");
        analyzed.extend(airlock_core::db::first_analyze(&app_pool, 1).await.unwrap());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let public: bool =
        sqlx::query_scalar("SELECT has_function_privilege('public', 'airlock_first_analyze(bigint)', 'EXECUTE')")
            .fetch_one(&owner)
            .await
            .unwrap();
    assert!(!public, "anyone may run the owner's ANALYZE");

    // Every append-only log has rows now, or at least a table to try on.
    let logs: Vec<String> = sqlx::query_scalar("SELECT t::text FROM airlock_append_only_tables() t ORDER BY 1")
        .fetch_all(&owner)
        .await
        .unwrap();
    for must in [
        "audit_log",
        "delivery_events",
        "delivery_events_archive",
        "delivery_event_archives",
        "run_steps",
        "run_effects",
        "turn_events",
        "agent_journal",
    ] {
        assert!(logs.iter().any(|l| l == must), "{must} is not among the append-only logs {logs:?}");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log").fetch_one(&app_pool).await.unwrap();
    assert!(rows >= 1);
    for log in &logs {
        // (A partition's row trigger is its parent's, by the parent's name.)
        let trigger: String = sqlx::query_scalar(
            r#"SELECT tgname::text FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname LIKE '%\_append\_only'"#,
        )
        .bind(log)
        .fetch_one(&owner)
        .await
        .unwrap();
        for sql in [
            format!("UPDATE {log} SET {col} = {col}", col = first_column(&owner, log).await),
            format!("DELETE FROM {log}"),
            format!("TRUNCATE {log}"),
            format!("ALTER TABLE {log} DISABLE TRIGGER ALL"),
            format!("DROP TRIGGER {trigger} ON {log}"),
        ] {
            let e = exec(&app_pool, sql.clone()).await.expect_err(&sql);
            let code = code_of(&e);
            // 42501: no privilege; 42501 also when not the owner (ALTER, DROP TRIGGER).
            assert_eq!(code, INSUFFICIENT_PRIVILEGE, "{sql}: {e}");
        }
    }
    // The event log's partitions and archive are the owner's: the role may run the
    // functions that keep them (as the worker did above), but neither move a partition
    // itself nor write the archive or its seals.
    let hot: String = sqlx::query_scalar("SELECT part::text FROM airlock_partitions('delivery_events') LIMIT 1")
        .fetch_one(&app_pool)
        .await
        .unwrap();
    for sql in [
        format!("ALTER TABLE delivery_events DETACH PARTITION {hot}"),
        format!("DROP TABLE {hot}"),
        "CREATE TABLE delivery_events_forged PARTITION OF delivery_events_archive FOR VALUES FROM (MINVALUE) TO (MAXVALUE)"
            .into(),
        "INSERT INTO delivery_events_archive (delivery_id, seq, to_state, actor, hash) \
         VALUES (gen_random_uuid(), 1, 'sent', 'agent:x', 'h')"
            .into(),
        "INSERT INTO delivery_event_archives (partition, hi, deliveries, events, broken, strays) \
         VALUES ('delivery_events_p0', gen_random_uuid(), 0, 0, 0, 0)"
            .into(),
    ] {
        let e = exec(&app_pool, sql.clone()).await.expect_err(&sql);
        assert_eq!(code_of(&e), INSUFFICIENT_PRIVILEGE, "{sql}: {e}");
    }
    let made: Vec<String> = sqlx::query_scalar("SELECT p FROM airlock_delivery_events_partitions(604800, 4, 1000) p")
        .fetch_all(&app_pool)
        .await
        .unwrap();
    assert!(made.is_empty(), "the worker keeps partitions ahead already: {made:?}");
    let public: bool =
        sqlx::query_scalar("SELECT has_function_privilege('public', 'airlock_archive_move(text, integer)', 'EXECUTE')")
            .fetch_one(&owner)
            .await
            .unwrap();
    assert!(!public, "anyone may move the owner's partitions");

    // Nor may it say which migrations ran.
    let e = exec(&app_pool, "DELETE FROM _sqlx_migrations".into()).await.unwrap_err();
    assert_eq!(code_of(&e), INSUFFICIENT_PRIVILEGE);
    assert_eq!(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM audit_log").fetch_one(&owner).await.unwrap(), rows);
    assert_eq!(airlock_core::audit::verify(&owner).await.unwrap(), None);

    // The owner cannot truncate a log either: the statement trigger refuses it.
    for log in &logs {
        let e = exec(&owner, format!("TRUNCATE {log} CASCADE")).await.unwrap_err();
        assert!(e.to_string().contains("append-only"), "{log}: {e}");
    }
    app_pool.close().await;
}

/// A plain column of `table` (not an identity) to write in a no-op UPDATE.
async fn first_column(pool: &PgPool, table: &str) -> String {
    sqlx::query_scalar(
        r#"SELECT attname::text FROM pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
           AND attidentity = '' AND attgenerated = '' ORDER BY attnum LIMIT 1"#,
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs `airlock-admin audit ARGS` against the test's database; (exit code, stdout).
fn audit_cli(db_url: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(harness::bin_path("airlock-admin"))
        .arg("audit")
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", db_url)
        .output()
        .expect("run airlock-admin");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn removing_the_newest_audit_entries_is_caught_against_the_exported_head(pool: PgPool) {
    let db_url = harness::database_url(&pool);
    for i in 0..4 {
        let mut tx = pool.begin().await.unwrap();
        let action = airlock_core::audit::Action {
            action: "test.entry",
            target_kind: "test",
            target_id: i.to_string(),
            reason: Some("an entry"),
            data: serde_json::json!({"i": i}),
        };
        airlock_core::audit::record_as(&mut tx, "tester", "admin", action).await.unwrap();
        tx.commit().await.unwrap();
    }
    let dir = std::env::temp_dir().join(format!("airlock-audit-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let head = dir.join("head.json");
    let (code, out) = audit_cli(&db_url, &["export-head", "--out", head.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    let exported: airlock_core::audit::Head = serde_json::from_str(&std::fs::read_to_string(&head).unwrap()).unwrap();
    assert_eq!(exported.entries, 4);
    assert_eq!(audit_cli(&db_url, &["verify", "--head", head.to_str().unwrap()]), (0, "ok\n".into()));

    // Entries after the export are fine: the chain covers them.
    let mut tx = pool.begin().await.unwrap();
    let action = airlock_core::audit::Action {
        action: "test.later",
        target_kind: "test",
        target_id: "later".into(),
        reason: None,
        data: serde_json::json!({}),
    };
    airlock_core::audit::record_as(&mut tx, "tester", "admin", action).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(audit_cli(&db_url, &["verify", "--head", head.to_str().unwrap()]).0, 0);

    // Whoever can bypass the triggers removes the two newest entries: the rest is still a
    // valid chain, and only the exported head shows what is missing.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE audit_log DISABLE TRIGGER audit_log_append_only").execute(&mut *tx).await.unwrap();
    sqlx::query("DELETE FROM audit_log WHERE id IN (SELECT id FROM audit_log ORDER BY id DESC LIMIT 2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE audit_log ENABLE TRIGGER audit_log_append_only").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(audit_cli(&db_url, &["verify"]), (0, "ok\n".into()), "the chain alone cannot tell");
    let (code, out) = audit_cli(&db_url, &["verify", "--head", head.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.starts_with("broken:") && out.contains("removed"), "{out}");

    // A head that is not one is refused, not taken for an empty log.
    std::fs::write(&head, "{\"id\": \"x\"}").unwrap();
    assert_ne!(audit_cli(&db_url, &["verify", "--head", head.to_str().unwrap()]).0, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
