//! Two real `airlock-worker` processes host agents (`worker.node_id`) and coordinate
//! their migrations: the admin API enqueues, whichever worker claims the job drives the
//! protocol over HTTP on loopback, and the blobs the target already holds are not sent.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use airlock_capsule::AgentId;
use airlock_capsule::archive::DirArchive;
use airlock_capsule::journal::EventKind;
use airlock_capsule::protocol::{AppendRequest, HolderState, HttpNode, NodeApi};
use airlock_core::secret::Secret;
use airlock_tests::app::{TempDir, TestApp};
use airlock_tests::capsule::{FLEET_SECRET, FLEET_SECRET_ENV, SECRET_NAME, sample_capsule_variant, wait_migration};
use airlock_tests::harness::{self, KillOnDrop};
use nix::sys::signal::Signal;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

async fn migrate(app: &TestApp, agent: &str, target: &str) -> Value {
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/agents/{agent}/migrations", app.admin),
            Some(&app.operator),
            Some(json!({"target_node": target})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = uuid::Uuid::parse_str(v["id"].as_str().unwrap()).unwrap();
    wait_migration(&app.pool, id, Duration::from_secs(60)).await;
    let (_, v) = app.call("GET", &format!("{}/admin/v1/migrations/{id}", app.admin), Some(&app.operator), None).await;
    v
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn two_worker_processes_host_and_move_an_agent(pool: PgPool) {
    let root = std::env::temp_dir().join(format!("airlock-procs-{}", uuid::Uuid::new_v4()));
    let _cleanup = TempDir(root.clone());
    let store_dir = root.join("store");
    let (pa, pb) = (harness::free_port(), harness::free_port());
    let (url_a, url_b) = (format!("http://127.0.0.1:{pa}"), format!("http://127.0.0.1:{pb}"));
    let shared = [
        ("AIRLOCK__NODES__NODE_A__URL".to_string(), url_a.clone()),
        ("AIRLOCK__NODES__NODE_B__URL".to_string(), url_b.clone()),
        ("AIRLOCK__CAPSULES__STORE_DIR".to_string(), store_dir.display().to_string()),
        ("AIRLOCK__CAPSULES__FLEET_SECRET_ENV".to_string(), FLEET_SECRET_ENV.to_string()),
        (FLEET_SECRET_ENV.to_string(), FLEET_SECRET.to_string()),
        ("AIRLOCK__CAPSULES__MIGRATE_RETRY_MS".to_string(), "100".to_string()),
        (format!("AIRLOCK_SECRET_{SECRET_NAME}"), "ghp_process_value".to_string()),
    ];
    let extra: Vec<(&str, &str)> = shared.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let app = TestApp::start(pool.clone(), &extra).await;

    let worker = |id: &str, port: u16| {
        let mut env: Vec<(String, String)> = app.env.clone();
        env.extend(shared.iter().cloned());
        env.push(("AIRLOCK__WORKER__NODE_ID".into(), id.into()));
        env.push(("AIRLOCK__WORKER__NODE_LISTEN".into(), format!("127.0.0.1:{port}")));
        env.push(("AIRLOCK__WORKER__DATA_DIR".into(), root.join(id).display().to_string()));
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &pairs))
    };
    let mut a_proc = worker("node_a", pa);
    let mut b_proc = worker("node_b", pb);
    for url in [&url_a, &url_b] {
        let http = reqwest::Client::new();
        harness::wait_for("the node to listen", Duration::from_secs(30), || {
            let r = http.get(format!("{url}/healthz")).send();
            async move { r.await.ok().filter(|r| r.status().is_success()).map(|_| ()) }
        })
        .await;
    }

    // Import two agents whose workspaces share two of three bodies.
    let store = DirArchive::new(&store_dir);
    for (agent, variant) in [("agent-7", 0u8), ("agent-8", 1u8)] {
        let (cap, blobs) = sample_capsule_variant(agent, "origin", 0, variant);
        let dir = root.join("in").join(agent);
        cap.write_dir(&dir, &blobs, None).unwrap();
        let trust = airlock_admin::capsule::Trust { trusted_keys: &[], allow_unsigned: true };
        airlock_admin::capsule::import(&pool, &store, &dir, "test", &trust).await.unwrap();
    }
    assert_eq!(migrate(&app, "agent-8", "node_b").await["outcome"], "completed");
    let m = migrate(&app, "agent-7", "node_a").await;
    assert_eq!((m["outcome"].as_str(), m["blobs"]["sent"].as_i64()), (Some("completed"), Some(3)), "{m}");

    let secret = Arc::new(Secret::new(FLEET_SECRET));
    let a = HttpNode::new("node_a", &url_a, secret.clone(), Duration::from_secs(5)).unwrap();
    let b = HttpNode::new("node_b", &url_b, secret, Duration::from_secs(5)).unwrap();
    let id = AgentId::parse("agent-7").unwrap();
    a.append(&id, &AppendRequest { kind: EventKind::Message, data: json!({"role": "user", "text": "hello a"}) })
        .await
        .unwrap();

    let m = migrate(&app, "agent-7", "node_b").await;
    assert_eq!(m["outcome"], "completed", "{m}");
    assert_eq!(
        (m["blobs"]["total"].as_i64(), m["blobs"]["sent"].as_i64(), m["blobs"]["skipped"].as_i64()),
        (Some(3), Some(1), Some(2))
    );
    let (sa, sb) = (a.status(&id).await.unwrap(), b.status(&id).await.unwrap());
    assert_eq!((sa.state, sa.epoch), (Some(HolderState::Retired), 1));
    assert!(sb.is_active_at(2), "{sb:?}");
    let ev = b
        .append(&id, &AppendRequest { kind: EventKind::Message, data: json!({"role": "user", "text": "hello b"}) })
        .await
        .unwrap();
    assert_eq!((ev["machine"].as_str(), ev["seq"].as_u64()), (Some("node_b"), Some(1)));

    harness::signal(&a_proc.0, Signal::SIGTERM);
    harness::signal(&b_proc.0, Signal::SIGTERM);
    assert!(harness::wait_exit(&mut a_proc.0, Duration::from_secs(30)).success());
    assert!(harness::wait_exit(&mut b_proc.0, Duration::from_secs(30)).success());
}
