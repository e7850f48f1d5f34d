//! Live migration between two nodes over the HTTP node protocol on loopback: the admin
//! route enqueues a `capsule.migrate` job, a real worker drives it, the nodes move the
//! agent. Plus the node-side defences: stale epochs, lost holder records, request
//! authentication.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use airlock_capsule::archive::Archive;
use airlock_capsule::journal::EventKind;
use airlock_capsule::protocol::{self, AppendRequest, CallError, HolderState, HttpNode, NodeApi, NodeCall};
use airlock_capsule::relocation::Phase;
use airlock_capsule::verify::{VerifyOptions, verify_path};
use airlock_capsule::{AgentId, CapsuleFiles};
use airlock_core::secret::Secret;
use airlock_tests::app::TestApp;
use airlock_tests::capsule::{FLEET_SECRET, Fleet, wait_migration, wait_phase};
use airlock_worker::migrate::MigrateHooks;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

async fn start(pool: PgPool, nodes: &[&str]) -> (Fleet, TestApp) {
    let fleet = Fleet::start(nodes).await;
    let env = fleet.env();
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let app = TestApp::start(pool, &extra).await;
    (fleet, app)
}

async fn request_migration(app: &TestApp, agent: &str, target: &str) -> uuid::Uuid {
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/agents/{agent}/migrations", app.admin),
            Some(&app.operator),
            Some(json!({"target_node": target, "reason": "test"})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["phase"], "created");
    uuid::Uuid::parse_str(v["id"].as_str().unwrap()).unwrap()
}

async fn migrate(app: &TestApp, agent: &str, target: &str) -> Value {
    let id = request_migration(app, agent, target).await;
    wait_migration(&app.pool, id, Duration::from_secs(20)).await;
    let (s, v) = app.call("GET", &format!("{}/admin/v1/migrations/{id}", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

async fn agent_view(app: &TestApp, agent: &str) -> Value {
    let (s, v) = app.call("GET", &format!("{}/admin/v1/agents/{agent}", app.admin), Some(&app.operator), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

fn client(fleet: &Fleet, node: &str) -> HttpNode {
    HttpNode::new(node, &fleet.node(node).url, Arc::new(Secret::new(FLEET_SECRET)), Duration::from_secs(5)).unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn two_node_migration_over_http_sends_only_missing_blobs(pool: PgPool) {
    let (fleet, app) = start(pool.clone(), &["node_a", "node_b"]).await;
    let (_stop, _worker) = fleet.start_coordinator(&pool, &app.config, "coordinator-1", Arc::default());

    fleet.import_sample(&pool, "agent-7").await;
    let v = agent_view(&app, "agent-7").await;
    assert_eq!((v["state"].as_str(), v["holder"].as_null(), v["epoch"].as_i64()), (Some("stored"), Some(()), Some(0)));

    // First placement: from the store onto node_a; everything is sent.
    let m = migrate(&app, "agent-7", "node_a").await;
    assert_eq!(m["outcome"], "completed", "{m}");
    assert_eq!(m["blobs"], json!({"total": 3, "sent": 3, "skipped": 0, "bytes_sent": m["blobs"]["bytes_sent"]}));
    let v = agent_view(&app, "agent-7").await;
    assert_eq!(
        (v["state"].as_str(), v["holder"].as_str(), v["epoch"].as_i64()),
        (Some("active"), Some("node_a"), Some(1))
    );

    // node_b already hosts another agent whose workspace shares two of the three bodies.
    fleet.import_variant(&pool, "agent-8", 1).await;
    assert_eq!(migrate(&app, "agent-8", "node_b").await["outcome"], "completed");

    // agent-7 runs on node_a and writes to its journal there.
    let a = client(&fleet, "node_a");
    let id = AgentId::parse("agent-7").unwrap();
    let ev = a.append(&id, &AppendRequest { kind: EventKind::Note, data: json!({"text": "on node_a"}) }).await.unwrap();
    assert_eq!(ev["machine"], "node_a");

    fleet.clear_faults();
    let m = migrate(&app, "agent-7", "node_b").await;
    assert_eq!(m["outcome"], "completed", "{m}");
    assert_eq!((m["from_epoch"].as_i64(), m["epoch"].as_i64()), (Some(1), Some(2)));
    assert_eq!(m["blobs"]["total"], 3);
    assert_eq!(m["blobs"]["skipped"], 2, "bodies node_b already had are not sent: {m}");
    assert_eq!(m["blobs"]["sent"], 1);
    assert_eq!(fleet.faults["node_b"].calls(NodeCall::PutBlob), 1, "one blob crossed the wire");
    let big = 64 * 1024;
    assert_eq!(m["blobs"]["bytes_sent"], big);
    let phases: Vec<&str> = m["history"].as_array().unwrap().iter().map(|h| h["phase"].as_str().unwrap()).collect();
    assert_eq!(
        phases,
        ["created", "frozen", "proposed", "transferred", "prepared", "activating", "activated", "retired", "completed"]
    );
    assert!(m["history"].as_array().unwrap().iter().all(|h| h["at"].is_string()));

    let v = agent_view(&app, "agent-7").await;
    assert_eq!(
        (v["state"].as_str(), v["holder"].as_str(), v["epoch"].as_i64()),
        (Some("active"), Some("node_b"), Some(2))
    );
    let obs = fleet.observe("agent-7", 2).await;
    assert_eq!(obs.active(), vec![("node_b".to_string(), 2)], "{}", obs.summary());
    assert!(obs.staging_clean && obs.verify_problems.is_empty(), "{obs:?}");
    let sa = a.status(&id).await.unwrap();
    assert_eq!((sa.state, sa.epoch), (Some(HolderState::Retired), 1));
    assert!(!fleet.node("node_a").work_dir("agent-7").exists(), "the retired copy is gone");

    // The old holder can no longer write; the new one continues the same journal.
    let refused = a.append(&id, &AppendRequest { kind: EventKind::Note, data: json!({"text": "late"}) }).await;
    assert!(matches!(refused, Err(CallError::Refused { status: 409, .. })), "{refused:?}");
    let b = client(&fleet, "node_b");
    b.append(&id, &AppendRequest { kind: EventKind::Note, data: json!({"text": "on node_b"}) }).await.unwrap();
    b.checkpoint(&id).await.unwrap();

    // The store's copy exports and verifies; its journal chains origin → node_a → node_b.
    let out = fleet.root.join("export-agent-7");
    let manifest =
        airlock_admin::capsule::export(&pool, fleet.store.as_ref(), &id, &out, false, None, "test").await.unwrap();
    assert_eq!((manifest.holder.as_str(), manifest.epoch), ("node_b", 2));
    assert!(verify_path(&out, &VerifyOptions::default()).unwrap().is_ok());
    let (cap, _) = CapsuleFiles::read_dir(&out).unwrap();
    let journal = cap.journal().unwrap();
    let machines: Vec<&str> = journal.events().map(|e| e.machine.as_str()).collect();
    assert_eq!(machines.last(), Some(&"node_b"));
    assert!(machines.contains(&"node_a") && machines.contains(&"origin"));
    let lamports: Vec<u64> = journal.events().map(|e| e.lamport).collect();
    assert!(lamports.windows(2).all(|w| w[0] < w[1]), "{lamports:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn migration_requests_are_checked(pool: PgPool) {
    let (fleet, app) = start(pool.clone(), &["node_a", "node_b"]).await;
    fleet.import_sample(&pool, "agent-1").await;
    let url = format!("{}/admin/v1/agents/agent-1/migrations", app.admin);
    let body = json!({"target_node": "node_a"});
    let (s, _) = app.call("POST", &url, Some(&app.reviewer), Some(body.clone())).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, v) = app.call("POST", &url, Some(&app.operator), Some(json!({"target_node": "node_z"}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("VALIDATION")));
    let (s, _) = app
        .call(
            "POST",
            &format!("{}/admin/v1/agents/nobody/migrations", app.admin),
            Some(&app.operator),
            Some(body.clone()),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = app.call("POST", &url, Some(&app.operator), Some(body.clone())).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (s, v) = app.call("POST", &url, Some(&app.operator), Some(body)).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("INVALID_TRANSITION")), "one at a time");
    let (s, _) = app.call("GET", &format!("{}/admin/v1/agents/agent-1", app.admin), Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let audit: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'agent.migrate'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(audit, 1);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_stale_epoch_from_a_node_that_wakes_up_isolated_is_refused(pool: PgPool) {
    let (fleet, app) = start(pool.clone(), &["node_a", "node_b", "node_c"]).await;
    let (_stop, _worker) = fleet.start_coordinator(&pool, &app.config, "coordinator-1", Arc::default());
    fleet.import_sample(&pool, "agent-s").await;
    assert_eq!(migrate(&app, "agent-s", "node_a").await["outcome"], "completed");
    let id = AgentId::parse("agent-s").unwrap();
    // node_a's view at epoch 1, as an isolated node would remember it.
    let stale = fleet.store.get_checkpoint(&id).unwrap().unwrap();
    assert_eq!(stale.manifest.epoch, 1);
    assert_eq!(migrate(&app, "agent-s", "node_b").await["outcome"], "completed");
    let held = fleet.node("node_b").svc.status(&id).await.unwrap();
    assert_eq!((held.state, held.epoch), (Some(HolderState::Active), 2));

    // The isolated node proposes its own epoch + 1 (= 2) to node_b and to node_c: node_b
    // holds 2 and refuses; node_a itself, retired at 1, refuses 1.
    let b = client(&fleet, "node_b");
    let r = b.propose(&id, 2).await.unwrap_err();
    assert_eq!(r.code(), Some("STALE_EPOCH"), "{r:?}");
    let r = b.propose(&id, 1).await.unwrap_err();
    assert_eq!(r.code(), Some("STALE_EPOCH"), "{r:?}");
    let a = client(&fleet, "node_a");
    assert_eq!(a.propose(&id, 1).await.unwrap_err().code(), Some("STALE_EPOCH"));
    // A stale activation or freeze names an epoch nobody holds.
    assert!(b.activate(&id, 1).await.is_err());
    assert!(a.resume(&id, 1).await.is_err(), "a retired node never runs the agent again");
    // And its checkpoint cannot overwrite the newer one in the store.
    let err = fleet.store.put_checkpoint(&stale).unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");
    let obs = fleet.observe("agent-s", 2).await;
    assert_eq!(obs.active(), vec![("node_b".to_string(), 2)]);
    assert!(obs.staging_clean, "{obs:?}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_node_that_lost_its_holder_record_waits_to_be_reconciled(pool: PgPool) {
    let (mut fleet, app) = start(pool.clone(), &["node_a", "node_b"]).await;
    let hooks: Arc<MigrateHooks> = Arc::default();
    let (stop, worker) = fleet.start_coordinator(&pool, &app.config, "coordinator-1", hooks.clone());
    fleet.import_sample(&pool, "agent-r").await;
    assert_eq!(migrate(&app, "agent-r", "node_a").await["outcome"], "completed");
    let id = AgentId::parse("agent-r").unwrap();

    // node_a crashes and comes back without its holder record.
    let store = fleet.store.clone();
    fleet.node_mut("node_a").crash().await;
    std::fs::remove_file(fleet.node("node_a").data_dir.join("agents/agent-r/holder.json")).unwrap();
    fleet.node_mut("node_a").restart(store.clone()).await;
    let a = client(&fleet, "node_a");
    let s = a.status(&id).await.unwrap();
    assert!(!s.reconciled && s.state.is_none(), "{s:?}");
    let r = a.append(&id, &AppendRequest { kind: EventKind::Note, data: json!({"text": "x"}) }).await.unwrap_err();
    assert_eq!(r.code(), Some("UNRECONCILED"), "it does not run the agent");
    assert_eq!(a.propose(&id, 9).await.unwrap_err().code(), Some("UNRECONCILED"));

    // A migration away cannot freeze it: it aborts, nothing moves.
    let m = migrate(&app, "agent-r", "node_b").await;
    assert_eq!(m["outcome"], "aborted", "{m}");
    assert!(m["reason"].as_str().unwrap().contains("freeze"), "{m}");
    assert!(fleet.observe("agent-r", m["epoch"].as_i64().unwrap()).await.active().is_empty());

    // Reconciled with Postgres (which names node_a at epoch 1): it runs again.
    let counts = fleet.node("node_a").svc.reconcile_once(&pool).await.unwrap();
    assert_eq!(counts.restored, 1, "{counts:?}");
    assert!(a.status(&id).await.unwrap().is_active_at(1));
    a.append(&id, &AppendRequest { kind: EventKind::Note, data: json!({"text": "back"}) }).await.unwrap();

    // The target activates, loses its record, and the coordinator died at the point of no
    // return: the next coordinator finds the target unreconciled, so the move did not
    // happen: the target discards its copy and the source runs on.
    hooks.halt_after(Some(Phase::Activating));
    let mid = request_migration(&app, "agent-r", "node_b").await;
    tokio::time::timeout(Duration::from_secs(20), hooks.halted.notified()).await.unwrap();
    worker.abort();
    let _ = worker.await;
    stop.cancel();
    let m = airlock_capsule::relocation::get(&pool, mid).await.unwrap().unwrap();
    assert_eq!(m.phase, Phase::Activating);
    let b = client(&fleet, "node_b");
    assert!(b.activate(&id, m.epoch).await.unwrap().is_active_at(m.epoch));
    fleet.node_mut("node_b").crash().await;
    std::fs::remove_file(fleet.node("node_b").data_dir.join("agents/agent-r/holder.json")).unwrap();
    fleet.node_mut("node_b").restart(store).await;
    assert_eq!(fleet.node("node_b").svc.reconcile_once(&pool).await.unwrap().waiting, 1, "migrating: wait");
    sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(m.job_id.unwrap())
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    airlock_queue::rescue_expired(&mut tx, 10).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("UPDATE jobs SET run_at = now() WHERE id = $1").bind(m.job_id.unwrap()).execute(&pool).await.unwrap();
    let (_stop2, _worker2) = fleet.start_coordinator(&pool, &app.config, "coordinator-2", Arc::default());
    let done = wait_migration(&pool, mid, Duration::from_secs(20)).await;
    assert_eq!(done.phase, Phase::Aborted, "{done:?}");
    let obs = fleet.observe("agent-r", m.epoch).await;
    assert_eq!(obs.active(), vec![("node_a".to_string(), 1)], "{}", obs.summary());
    assert!(obs.staging_clean && obs.verify_problems.is_empty(), "{obs:?}");
    assert!(!fleet.node("node_b").work_dir("agent-r").exists());
    let _ = wait_phase;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn node_requests_are_authenticated(pool: PgPool) {
    let (fleet, _app) = start(pool.clone(), &["node_a"]).await;
    let url = format!("{}/node/v1/agents/agent-x", fleet.node("node_a").url);
    let http = reqwest::Client::new();
    let path = "/node/v1/agents/agent-x";
    let send = |ts: i64, secret: &str| {
        let sig = protocol::sign(&Secret::new(secret), "GET", path, ts, b"");
        http.get(&url).header(protocol::TIMESTAMP_HEADER, ts.to_string()).header(protocol::SIGNATURE_HEADER, sig).send()
    };
    let now = chrono::Utc::now().timestamp();
    assert_eq!(http.get(&url).send().await.unwrap().status(), StatusCode::UNAUTHORIZED);
    assert_eq!(send(now, "wrong-secret").await.unwrap().status(), StatusCode::UNAUTHORIZED);
    assert_eq!(send(now - 3600, FLEET_SECRET).await.unwrap().status(), StatusCode::UNAUTHORIZED, "stale timestamp");
    let ok = send(now, FLEET_SECRET).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(ok.headers().contains_key(protocol::SIGNATURE_HEADER), "answers are signed");
    // A client with the wrong secret cannot trust (or get) any answer.
    let bad = HttpNode::new("node_a", &fleet.node("node_a").url, Arc::new(Secret::new("nope")), Duration::from_secs(2))
        .unwrap();
    assert!(matches!(bad.status(&AgentId::parse("agent-x").unwrap()).await, Err(CallError::Unreachable(_))));
    let health = http.get(format!("{}/healthz", fleet.node("node_a").url)).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn a_capsule_prepared_under_another_agents_name_is_refused(pool: PgPool) {
    let (fleet, _app) = start(pool.clone(), &["node_a"]).await;
    let a = client(&fleet, "node_a");
    let id = AgentId::parse("agent-one").unwrap();
    a.propose(&id, 1).await.unwrap();
    let (cap, blobs) = airlock_tests::capsule::sample_capsule("agent-two", "origin", 0);
    for sha in cap.blob_hashes() {
        a.put_blob(&id, 1, &sha, blobs[&sha].clone()).await.unwrap();
    }
    let req = protocol::PrepareRequest { epoch: 1, files: cap.files_base64(), manifest: cap.manifest.clone() };
    let err = a.prepare(&id, req).await.unwrap_err();
    assert_eq!(err.code(), Some("VALIDATION"), "{err:?}");
    assert!(err.to_string().contains("one agent has one id"), "{err}");
    // A blob whose body does not match its name is refused on receipt.
    let sha = cap.blob_hashes()[0].clone();
    let err = a.put_blob(&id, 1, &sha, b"not this".to_vec()).await.unwrap_err();
    assert_eq!(err.code(), Some("HASH_MISMATCH"));
    // Aborting leaves nothing staged, and the epoch cannot be proposed again.
    a.abort(&id, 1).await.unwrap();
    assert!(!fleet.node("node_a").staging_dir("agent-one").exists());
    assert_eq!(a.propose(&id, 1).await.unwrap_err().code(), Some("STALE_EPOCH"));
    let _ = StatusCode::OK;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_imported_capsule_is_placed_only_while_its_import_is_still_trusted(pool: PgPool) {
    let (fleet, app) = start(pool.clone(), &["node_a"]).await;
    // The coordinator trusts no key: the one that signed the capsule below was trusted at
    // import and has been taken out of capsules.trusted_keys since.
    assert!(app.config.capsules.trusted_keys.is_empty());
    let (_stop, _worker) = fleet.start_coordinator(&pool, &app.config, "coordinator-t", Arc::default());

    let (signer, _) = airlock_capsule::manifest::Signer::generate();
    let key = signer.key_id();
    let (cap, blobs) = airlock_tests::capsule::sample_capsule("agent-signed", "origin", 0);
    let dir = fleet.root.join("exports").join("agent-signed");
    cap.write_dir(&dir, &blobs, Some(&signer)).unwrap();
    let keys = vec![key.clone()];
    let trust = airlock_admin::capsule::Trust { trusted_keys: &keys, allow_unsigned: false };
    airlock_admin::capsule::import(&pool, fleet.store.as_ref(), &dir, "test", &trust).await.unwrap();
    let recorded: (Option<String>, Option<bool>) =
        sqlx::query_as("SELECT import_signed_by, import_unsigned FROM agents WHERE id = 'agent-signed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, (Some(key.clone()), Some(false)));

    let m = migrate(&app, "agent-signed", "node_a").await;
    assert_eq!(m["outcome"], "aborted", "{m}");
    let reason = m["reason"].as_str().unwrap();
    assert!(reason.contains(&key) && reason.contains("no longer"), "{reason}");
    let v = agent_view(&app, "agent-signed").await;
    assert_eq!((v["state"].as_str(), v["holder"].as_null()), (Some("stored"), Some(())), "never placed: {v}");
    let status = client(&fleet, "node_a").status(&AgentId::parse("agent-signed").unwrap()).await.unwrap();
    assert_ne!(status.state, Some(HolderState::Active), "node_a never activated it: {status:?}");

    // An agent the operator imported unsigned on purpose (audited) is placed.
    fleet.import_sample(&pool, "agent-allowed").await;
    assert_eq!(migrate(&app, "agent-allowed", "node_a").await["outcome"], "completed");
}
