//! Governance: grants, four-eyes review, batch approval, the audit chain, token revocation.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(60);

fn grant(domains: &[&str], max_uses: i32, min_score: f64) -> Value {
    json!({
        "channel": "email", "agent_ids": ["agent-1"], "recipient_domains": domains,
        "min_score": min_score, "expires_at": (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339(),
        "max_uses": max_uses, "reason": "weekly newsletter to customers",
    })
}

async fn create_grant(app: &TestApp, body: Value) -> String {
    let (s, v) = app.call("POST", &format!("{}/admin/v1/grants", app.admin), Some(&app.operator), Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

async fn count(app: &TestApp, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&app.pool).await.unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn grant_lifecycle(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let (stop, worker) = app.start_worker("w-grants");
    let run = app.create_run(0).await;

    // Agents and reviewers cannot create grants; bad scopes are refused.
    let url = format!("{}/admin/v1/grants", app.admin);
    for token in [&app.agent, &app.reviewer] {
        let (s, _) = app.call("POST", &url, Some(token), Some(grant(&["example.org"], 5, 0.5))).await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    for bad in [
        json!({"channel": "email", "agent_ids": [], "recipient_domains": ["example.org"], "min_score": 0.5,
               "expires_at": "2099-01-01T00:00:00Z", "max_uses": 1, "reason": "x"}),
        json!({"channel": "email", "agent_ids": ["*"], "recipient_domains": ["example.org"], "min_score": 0.5,
               "expires_at": "2099-01-01T00:00:00Z", "max_uses": 1, "reason": "x"}),
        json!({"channel": "email", "agent_ids": ["agent-1"], "recipient_domains": ["example.org"], "min_score": 0.5,
               "expires_at": "2001-01-01T00:00:00Z", "max_uses": 1, "reason": "x"}),
        json!({"channel": "email", "agent_ids": ["agent-1"], "recipient_domains": [], "min_score": 0.5,
               "expires_at": "2099-01-01T00:00:00Z", "max_uses": 1, "reason": "x"}),
        {
            let mut g = grant(&["example.org"], 0, 0.5);
            g["max_uses"] = json!(0);
            g
        },
        {
            let mut g = grant(&["example.org"], 1, 0.5);
            g["scope"] = json!("all");
            g
        },
    ] {
        let (s, v) = app.call("POST", &url, Some(&app.operator), Some(bad.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad} -> {v}");
    }
    assert_eq!(count(&app, "SELECT count(*) FROM grants").await, 0);

    let gid = create_grant(&app, grant(&["example.org"], 2, 0.9)).await;

    // A matching delivery is approved by the grant.
    let a = app.submit(TestApp::email(&run, "g1", "Newsletter")).await;
    let d = app.wait_state(&a, DeliveryState::Approved, WAIT).await;
    let last = d["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["actor"], json!(format!("grant:{gid}")));
    let approver: (Option<String>, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT approver, grant_id FROM approvals WHERE delivery_id = $1")
            .bind(uuid::Uuid::parse_str(&a).unwrap())
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(approver, (None, Some(uuid::Uuid::parse_str(&gid).unwrap())), "the approval names the grant");

    // Out of scope: another domain waits for a human.
    let mut other = TestApp::email(&run, "g2", "Newsletter");
    other["email"]["to"] = json!(["bob@elsewhere.example"]);
    let b = app.submit(other).await;
    app.wait_state(&b, DeliveryState::AwaitingApproval, WAIT).await;

    // A low score goes to review; a grant never applies there.
    let mut risky = TestApp::email(&run, "g3", "x");
    risky["email"]["text"] = json!(
        "see http://a.example http://b.example http://c.example http://d.example http://e.example http://f.example"
    );
    let c = app.submit(risky).await;
    app.wait_state(&c, DeliveryState::InReview, WAIT).await;

    // The second use is the last one.
    let e = app.submit(TestApp::email(&run, "g4", "Newsletter 2")).await;
    app.wait_state(&e, DeliveryState::Approved, WAIT).await;
    let f = app.submit(TestApp::email(&run, "g5", "Newsletter 3")).await;
    app.wait_state(&f, DeliveryState::AwaitingApproval, WAIT).await;
    let uses: i32 = sqlx::query_scalar("SELECT uses FROM grants").fetch_one(&app.pool).await.unwrap();
    assert_eq!(uses, 2);

    // Revoked and expired grants approve nothing.
    let g2 = create_grant(&app, grant(&["example.org"], 100, 0.0)).await;
    let (s, v) = app
        .call(
            "DELETE",
            &format!("{}/admin/v1/grants/{g2}?reason=campaign%20over", app.admin),
            Some(&app.operator),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(!v["revoked_at"].is_null());
    let (s, _) = app.call("DELETE", &format!("{}/admin/v1/grants/{g2}", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    sqlx::query(
        "INSERT INTO grants (id, created_by, reason, channel, agent_ids, recipient_domains, min_score, expires_at, max_uses) \
         VALUES ($1, 'otto', 'old', 'email', '{agent-1}', '{example.org}', 0, now() - interval '1 minute', 100)",
    )
    .bind(uuid::Uuid::now_v7())
    .execute(&app.pool)
    .await
    .unwrap();
    let h = app.submit(TestApp::email(&run, "g6", "Newsletter 4")).await;
    app.wait_state(&h, DeliveryState::AwaitingApproval, WAIT).await;

    // A grant's scope cannot widen.
    let widened = sqlx::query("UPDATE grants SET recipient_domains = '{example.org,evil.example}' WHERE id = $1")
        .bind(uuid::Uuid::parse_str(&gid).unwrap())
        .execute(&app.pool)
        .await;
    assert!(widened.is_err());
    let more_uses = sqlx::query("UPDATE grants SET max_uses = 1000 WHERE id = $1")
        .bind(uuid::Uuid::parse_str(&gid).unwrap())
        .execute(&app.pool)
        .await;
    assert!(more_uses.is_err());

    let (s, list) = app.call("GET", &format!("{}/admin/v1/grants", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["items"].as_array().unwrap().len(), 3);
    let (_, audit) = app.call("GET", &format!("{}/admin/v1/audit", app.admin), Some(&app.operator), None).await;
    let actions: Vec<&str> = audit["items"].as_array().unwrap().iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["grant.revoke", "grant.create", "grant.create"]);
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn racing_workers_never_overspend_a_grant(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__WORKER__CONCURRENCY", "8")]).await;
    let run = app.create_run(0).await;
    create_grant(&app, grant(&["example.org"], 3, 0.5)).await;
    let mut ids = Vec::new();
    for i in 0..24 {
        ids.push(app.submit(TestApp::email(&run, &format!("r{i}"), "Race")).await);
    }
    // Two workers score them concurrently.
    let (s1, w1) = app.start_worker("w-race-1");
    let (s2, w2) = app.start_worker("w-race-2");
    let pool = app.pool.clone();
    harness::wait_for("every delivery scored", WAIT, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE state IN ('persisted', 'scored')")
                .fetch_one(&pool)
                .await
                .unwrap();
            (n == 0).then_some(())
        }
    })
    .await;
    assert_eq!(count(&app, "SELECT count(*) FROM approvals WHERE grant_id IS NOT NULL").await, 3);
    assert_eq!(count(&app, "SELECT count(*) FROM deliveries WHERE state = 'approved'").await, 3);
    assert_eq!(count(&app, "SELECT count(*) FROM deliveries WHERE state = 'awaiting_approval'").await, 21);
    assert_eq!(count(&app, "SELECT uses::bigint FROM grants").await, 3);
    s1.cancel();
    s2.cancel();
    w1.await.unwrap().unwrap();
    w2.await.unwrap().unwrap();

    // And directly: 40 concurrent transactions racing for a grant of 5.
    sqlx::query("DELETE FROM approvals").execute(&app.pool).await.ok();
    let g = create_grant(&app, grant(&["race.example"], 5, 0.0)).await;
    let artifact = airlock_delivery::artifact::Artifact::from_json(
        &json!({"channel": "email", "email": {"from": "agent@example.com", "to": ["x@race.example"], "subject": "s", "text": "t"}}),
        &Default::default(),
    )
    .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let pool = app.pool.clone();
        let artifact = artifact.clone();
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let got = airlock_delivery::grants::try_use(&mut tx, "agent-1", &artifact, 1.0).await.unwrap();
            tx.commit().await.unwrap();
            got
        }));
    }
    let mut won = 0;
    for t in tasks {
        if t.await.unwrap().is_some() {
            won += 1;
        }
    }
    assert_eq!(won, 5, "exactly max_uses uses");
    let uses: i32 = sqlx::query_scalar("SELECT uses FROM grants WHERE id = $1")
        .bind(uuid::Uuid::parse_str(&g).unwrap())
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(uses, 5);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn four_eyes_and_batch_approval(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__REVIEW__FOUR_EYES", "true")]).await;
    let (stop, worker) = app.start_worker("w-4eyes");
    let run = app.create_run(0).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let id = app.submit(TestApp::email(&run, &format!("f{i}"), "Status update")).await;
        app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
        ids.push(id);
    }
    // rita edits the first one; she cannot approve her own version, ada can.
    let d = app.delivery(&ids[0]).await;
    let mut edited = d["artifact"].clone();
    edited["email"]["text"] = json!("Hello, corrected.");
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/deliveries/{}/edit", app.admin, ids[0]),
            Some(&app.reviewer),
            Some(json!({"artifact": edited, "note": "corrected"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let sha = v["artifact_sha256"].clone();
    let approve = format!("{}/admin/v1/deliveries/{}/approve", app.admin, ids[0]);
    let (s, v) =
        app.call("POST", &approve, Some(&app.reviewer), Some(json!({"artifact_sha256": sha, "note": "checked"}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("FORBIDDEN")), "{v}");
    let (s, v) = app
        .call("POST", &approve, Some(&app.admin_token), Some(json!({"artifact_sha256": sha, "note": "checked"})))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // Batch: one stale hash and nothing is approved; then all of them at once.
    let batch = format!("{}/admin/v1/deliveries/approve", app.admin);
    let sha1 = app.delivery(&ids[1]).await["artifact_sha256"].clone();
    let sha2 = app.delivery(&ids[2]).await["artifact_sha256"].clone();
    let (s, v) = app
        .call(
            "POST",
            &batch,
            Some(&app.reviewer),
            Some(json!({"items": [{"id": ids[1], "artifact_sha256": sha1}, {"id": ids[2], "artifact_sha256": "0".repeat(64)}], "note": "checked"})),
        )
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("STALE_ARTIFACT")));
    assert_eq!(app.delivery(&ids[1]).await["state"], "awaiting_approval", "all or nothing");
    let (s, _) = app.call("POST", &batch, Some(&app.reviewer), Some(json!({"items": [], "note": "checked"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let too_many: Vec<Value> =
        (0..101).map(|_| json!({"id": uuid::Uuid::new_v4(), "artifact_sha256": "0".repeat(64)})).collect();
    let (s, _) =
        app.call("POST", &batch, Some(&app.reviewer), Some(json!({"items": too_many, "note": "checked"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = app
        .call(
            "POST",
            &batch,
            Some(&app.agent),
            Some(json!({"items": [{"id": ids[1], "artifact_sha256": sha1}], "note": "checked"})),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, v) = app
        .call(
            "POST",
            &batch,
            Some(&app.reviewer),
            Some(json!({"items": [{"id": ids[1], "artifact_sha256": sha1}, {"id": ids[2], "artifact_sha256": sha2}], "note": "batch"})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(count(&app, "SELECT count(*) FROM deliveries WHERE state = 'approved'").await, 3);
    stop.cancel();
    worker.await.unwrap().unwrap();
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_audit_chain_catches_a_row_altered_in_sql(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    app.set_switch(false).await;
    create_grant(&app, grant(&["example.org"], 1, 0.5)).await;
    assert_eq!(airlock_core::audit::verify(&app.pool).await.unwrap(), None);
    let out = harness::spawn("airlock-admin", &["audit", "verify"], &app.db_url, &[]).wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");

    // The log refuses updates; someone with the database's keys forces one anyway.
    assert!(sqlx::query("UPDATE audit_log SET reason = 'nothing to see'").execute(&app.pool).await.is_err());
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE audit_log DISABLE TRIGGER audit_log_append_only").execute(&mut *tx).await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT min(id) + 1 FROM audit_log").fetch_one(&mut *tx).await.unwrap();
    sqlx::query("UPDATE audit_log SET reason = 'nothing to see' WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE audit_log ENABLE TRIGGER audit_log_append_only").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(airlock_core::audit::verify(&app.pool).await.unwrap(), Some(id));
    let out = harness::spawn("airlock-admin", &["audit", "verify"], &app.db_url, &[]).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&id.to_string()));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn revoked_tokens_are_refused_at_once(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let out =
        harness::spawn("airlock-admin", &["token", "create", "--role", "reviewer", "--name", "temp"], &app.db_url, &[])
            .wait_with_output()
            .unwrap();
    assert!(out.status.success());
    let token = String::from_utf8(out.stdout).unwrap();
    let token = token.trim();
    assert!(token.starts_with("alk_") && !token.contains('\n'), "the token alone on stdout");
    let stored: Vec<u8> = sqlx::query_scalar("SELECT token_sha256 FROM principals WHERE name = 'temp'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_ne!(stored, token.as_bytes(), "only a hash is stored");

    let url = format!("{}/admin/v1/deliveries", app.admin);
    assert_eq!(app.call("GET", &url, Some(token), None).await.0, StatusCode::OK);
    let out =
        harness::spawn("airlock-admin", &["token", "revoke", "temp"], &app.db_url, &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(app.call("GET", &url, Some(token), None).await.0, StatusCode::UNAUTHORIZED);

    let out = harness::spawn("airlock-admin", &["token", "list"], &app.db_url, &[]).wait_with_output().unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(listing.lines().any(|l| l.starts_with("temp ") && !l.trim_end().ends_with('-')), "{listing}");
    assert!(!listing.contains(token));
    let actions: Vec<String> =
        sqlx::query_scalar("SELECT action FROM audit_log ORDER BY id").fetch_all(&app.pool).await.unwrap();
    assert_eq!(actions, ["token.create", "token.revoke"]);
    let out =
        harness::spawn("airlock-admin", &["token", "revoke", "temp"], &app.db_url, &[]).wait_with_output().unwrap();
    assert!(!out.status.success(), "revoking twice is an error");
}

/// Score jobs claimed together are scored in one transaction that counts each grant's uses
/// once for all the deliveries it approves; a batch that would overspend a grant, or holds
/// a lost lease, is scored one delivery at a time instead. Either way: one score per
/// delivery, a grant never used past `max_uses`, one send job per approval, every event
/// chain intact, and nothing written under a lost lease.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn deliveries_scored_together_never_overspend_a_grant(pool: PgPool) {
    use airlock_core::ids::DeliveryId;
    use airlock_delivery::pipeline::{self, PipelineError};
    use airlock_delivery::scoring::DefaultScorer;
    use airlock_delivery::store;
    use airlock_queue::{self as queue, ClaimFilter, Lease, QueueError};
    use uuid::Uuid;

    let app = TestApp::start(pool, &[]).await;
    let scorer = DefaultScorer::new(app.config.delivery.known_domains.clone());
    let waker = airlock_queue::Waker::new(app.pool.clone());
    let run = app.create_run(0).await;
    let claim = |n: i64| {
        let app = &app;
        async move {
            let scores = ClaimFilter { queues: Some(vec![queue::DEFAULT_QUEUE.into()]) };
            let jobs = queue::claim_batch(&app.pool, "probe", &scores, n, Duration::from_secs(60)).await.unwrap();
            assert_eq!(jobs.len() as i64, n, "every score job is claimed");
            jobs.iter()
                .map(|j| (j.lease(), j.payload["delivery_id"].as_str().unwrap().parse().unwrap()))
                .collect::<Vec<(Lease, DeliveryId)>>()
        }
    };
    // Transactions that wrote the scores of `ids`, and how many scores each delivery has.
    let scored = |ids: Vec<DeliveryId>| {
        let app = &app;
        async move {
            let tx: i64 =
                sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM scores WHERE delivery_id = ANY ($1)")
                    .bind(&ids)
                    .fetch_one(&app.pool)
                    .await
                    .unwrap();
            let per: Vec<i64> = sqlx::query_scalar(
                "SELECT (SELECT count(*) FROM scores s WHERE s.delivery_id = d) FROM unnest($1::uuid[]) AS d",
            )
            .bind(&ids)
            .fetch_all(&app.pool)
            .await
            .unwrap();
            (tx, per)
        }
    };
    let state = |id: DeliveryId| {
        let app = &app;
        async move {
            let d = store::get(&app.pool, id).await.unwrap().unwrap();
            assert_eq!(store::verify_chain(id, &store::events(&app.pool, id).await.unwrap()), None, "chain of {id}");
            d.state
        }
    };
    let grant_uses = |gid: String| {
        let app = &app;
        async move {
            let g = Uuid::parse_str(&gid).unwrap();
            let row: (i32, i64, i64) = sqlx::query_as(
                r#"SELECT uses, (SELECT count(*) FROM approvals WHERE grant_id = $1),
                          (SELECT count(*) FROM jobs j JOIN approvals a ON a.delivery_id = (j.payload->>'delivery_id')::uuid
                           WHERE a.grant_id = $1 AND j.kind = 'delivery.send')
                   FROM grants WHERE id = $1"#,
            )
            .bind(g)
            .fetch_one(&app.pool)
            .await
            .unwrap();
            row
        }
    };

    // Six uses, eight matching deliveries: together they would overspend, so the batch is
    // scored again with only six taking the grant; the last two wait for a human.
    let small = create_grant(&app, grant(&["example.org"], 6, 0.5)).await;
    for i in 0..8 {
        app.submit(TestApp::email(&run, &format!("a{i}"), "Newsletter")).await;
    }
    let items = claim(8).await;
    let results = pipeline::score_many(&app.pool, &app.config, &waker, &scorer, None, &items).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let ids: Vec<DeliveryId> = items.iter().map(|(_, id)| *id).collect();
    assert_eq!(scored(ids.clone()).await, (1, vec![1; 8]), "one transaction, one score each");
    let mut states = Vec::new();
    for id in &ids {
        states.push(state(*id).await);
    }
    assert_eq!(states.iter().filter(|s| **s == DeliveryState::Approved).count(), 6, "{states:?}");
    assert_eq!(states.iter().filter(|s| **s == DeliveryState::AwaitingApproval).count(), 2, "{states:?}");
    assert_eq!(grant_uses(small.clone()).await, (6, 6, 6), "uses, approvals and send jobs agree");

    // A grant with uses to spare: matching deliveries, one for review and one out of scope
    // are scored in one transaction, and the grant counts exactly its approvals.
    let big = create_grant(&app, grant(&["example.org"], 100, 0.5)).await;
    for i in 0..6 {
        app.submit(TestApp::email(&run, &format!("b{i}"), "Newsletter")).await;
    }
    let mut risky = TestApp::email(&run, "b-risky", "x");
    risky["email"]["text"] = json!(
        "see http://a.example http://b.example http://c.example http://d.example http://e.example http://f.example"
    );
    let risky = app.submit(risky).await.parse().unwrap();
    let mut other = TestApp::email(&run, "b-other", "Newsletter");
    other["email"]["to"] = json!(["bob@elsewhere.example"]);
    let other = app.submit(other).await.parse::<DeliveryId>().unwrap();
    let items = claim(8).await;
    let results = pipeline::score_many(&app.pool, &app.config, &waker, &scorer, None, &items).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let ids: Vec<DeliveryId> = items.iter().map(|(_, id)| *id).collect();
    assert_eq!(scored(ids.clone()).await, (1, vec![1; 8]), "one transaction for the batch, one score each");
    assert_eq!(state(risky).await, DeliveryState::InReview);
    assert_eq!(state(other).await, DeliveryState::AwaitingApproval);
    for id in ids.iter().filter(|id| ![risky, other].contains(id)) {
        assert_eq!(state(*id).await, DeliveryState::Approved);
    }
    assert_eq!(grant_uses(big.clone()).await, (6, 6, 6));
    assert_eq!(grant_uses(small).await, (6, 6, 6), "the spent grant is untouched");
    let open: i64 =
        sqlx::query_scalar("SELECT count(*) FROM jobs WHERE kind = 'delivery.score' AND state <> 'completed'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(open, 0, "every score job is completed");

    // A batch with a lease that is not held: the others are scored, the lost one gets the
    // lease error and nothing is written for it.
    for i in 0..3 {
        app.submit(TestApp::email(&run, &format!("c{i}"), "Newsletter")).await;
    }
    let mut items = claim(3).await;
    items[1].0 = airlock_tests::harness::lease_never_held(&app.pool, items[1].0).await;
    let results = pipeline::score_many(&app.pool, &app.config, &waker, &scorer, None, &items).await;
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    assert!(matches!(results[1], Err(PipelineError::Queue(QueueError::LeaseLost { .. }))), "{results:?}");
    let ids: Vec<DeliveryId> = items.iter().map(|(_, id)| *id).collect();
    assert_eq!(scored(ids.clone()).await.1, vec![1, 0, 1]);
    assert_eq!(state(ids[1]).await, DeliveryState::Persisted);
    assert_eq!(grant_uses(big).await, (8, 8, 8));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_human_action_needs_a_note_and_shown_text_refuses_format_characters(pool: PgPool) {
    let app = TestApp::start(pool, &[("AIRLOCK__SCORING__REVIEW_THRESHOLD", "0.99")]).await;
    let (stop, worker) = app.start_worker("w-notes");
    let run = app.create_run(10).await;

    // A subject that reads otherwise than it is, or an address with an invisible character:
    // refused at the door, nothing written.
    let before = count(&app, "SELECT count(*) FROM deliveries").await;
    for (subject, to) in [
        ("Invoice \u{202E}fdp.exe", "bob@unknown.example"),
        ("Pay\u{200B}ment due", "bob@unknown.example"),
        ("Fine subject", "bob\u{200D}@unknown.example"),
    ] {
        let mut body = TestApp::email(&run, "hostile", subject);
        body["email"]["to"] = json!([to]);
        let (s, v) = app.call("POST", &format!("{}/v1/deliveries", app.api), Some(&app.agent), Some(body)).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION")), "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("U+"), "{v}");
    }
    assert_eq!(count(&app, "SELECT count(*) FROM deliveries").await, before);

    let mut body = TestApp::email(&run, "needs-review", "Your order has shipped");
    body["email"]["to"] = json!(["bob@unknown.example"]);
    let id = app.submit(body).await;
    let d = app.wait_state(&id, DeliveryState::InReview, WAIT).await;
    let sha = d["artifact_sha256"].clone();
    let url = |action: &str| format!("{}/admin/v1/deliveries/{id}/{action}", app.admin);
    let audited = || count(&app, "SELECT count(*) FROM audit_log");
    let audit_before = audited().await;
    let mut edited = d["artifact"].clone();
    edited["email"]["subject"] = json!("Your order has shipped!");
    // Without a note, with a blank one, or with a note hiding characters: refused, nothing changes.
    for note in [None, Some(json!("   ")), Some(json!("ok\u{202E}")), Some(json!("x".repeat(2001)))] {
        for (action, mut body) in
            [("accept", json!({})), ("edit", json!({"artifact": edited})), ("approve", json!({"artifact_sha256": sha}))]
        {
            if let Some(n) = &note {
                body["note"] = n.clone();
            }
            let (s, v) = app.call("POST", &url(action), Some(&app.reviewer), Some(body)).await;
            assert_eq!(
                (s, v["error"]["code"].as_str()),
                (StatusCode::BAD_REQUEST, Some("VALIDATION")),
                "{action}: {v}"
            );
            assert!(v["error"]["message"].as_str().unwrap().starts_with("note"), "{action}: {v}");
        }
    }
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/deliveries/approve", app.admin),
            Some(&app.reviewer),
            Some(json!({"items": [{"id": id, "artifact_sha256": sha}]})),
        )
        .await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION")), "batch: {v}");
    assert_eq!(app.delivery(&id).await["state"], "in_review", "nothing changed");
    assert_eq!(audited().await, audit_before, "nothing audited");
    assert_eq!(count(&app, "SELECT count(*) FROM reviews").await, 0);

    // With a note it goes through, and the note is what the audit shows.
    let (s, v) =
        app.call("POST", &url("accept"), Some(&app.reviewer), Some(json!({"note": "checked the order"}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let note: String =
        sqlx::query_scalar("SELECT reason FROM audit_log WHERE action = 'delivery.accept' AND target_id = $1")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(note, "checked the order");
    stop.cancel();
    worker.await.unwrap().unwrap();
}
