//! Operating airlock: metrics and health on every service, the compose file's structure,
//! and the operator's job commands.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::harness::{self, KillOnDrop};
use reqwest::StatusCode;
use sqlx::PgPool;
use yaml_rust2::{Yaml, YamlLoader};

const WAIT: Duration = Duration::from_secs(60);

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_service_serves_health_and_metrics(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    app.set_switch(true).await;
    // A real worker process with its own metrics endpoint sends one delivery.
    let port = harness::free_port();
    let mut env = app.env_pairs();
    let listen = format!("127.0.0.1:{port}");
    env.push(("AIRLOCK__WORKER__METRICS_LISTEN", &listen));
    let _worker = KillOnDrop(harness::spawn("airlock-worker", &[], &app.db_url, &env));
    let run = app.create_run(0).await;
    let id = app.submit(TestApp::email(&run, "m1", "Metrics")).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
    app.approve(&id).await;
    app.wait_state(&id, DeliveryState::Sent, WAIT).await;

    let worker = format!("http://{listen}");
    for base in [&app.api, &app.admin, &worker] {
        for (path, want) in [("/healthz", StatusCode::OK), ("/readyz", StatusCode::OK)] {
            let r = app.http.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), want, "{base}{path}");
        }
    }
    let scrape = |base: String| {
        let http = app.http.clone();
        async move {
            let r = http.get(format!("{base}/metrics")).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
            r.text().await.unwrap()
        }
    };
    let worker_text = scrape(worker.clone()).await;
    for name in [
        airlock_core::metrics::JOBS_CLAIMED,
        airlock_core::metrics::JOBS_ENDED,
        airlock_core::metrics::CLAIM_SECONDS,
        airlock_core::metrics::JOB_SECONDS,
        airlock_core::metrics::SEND_ATTEMPTS,
        airlock_core::metrics::RECEIPTS,
        airlock_core::metrics::QUEUE_DEPTH,
        airlock_core::metrics::DELIVERIES,
        airlock_core::metrics::SEND_ENABLED,
    ] {
        assert!(worker_text.contains(name), "worker metrics lack {name}:\n{worker_text}");
    }
    assert!(worker_text.contains("airlock_send_enabled 1"));
    assert!(worker_text.contains(r#"airlock_deliveries{state="sent"} 1"#), "{worker_text}");
    assert!(worker_text.contains(r#"airlock_receipts_total{channel="email"} 1"#), "{worker_text}");
    for base in [app.api.clone(), app.admin.clone()] {
        let text = scrape(base).await;
        assert!(text.contains(airlock_core::metrics::HTTP_REQUESTS), "{text}");
        assert!(text.contains(airlock_core::metrics::QUEUE_DEPTH));
    }

    // A database behind the code's migrations is not ready.
    sqlx::query(
        "UPDATE _sqlx_migrations SET success = false WHERE version = (SELECT max(version) FROM _sqlx_migrations)",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let r = app.http.get(format!("{}/readyz", app.admin)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(app.http.get(format!("{}/healthz", app.admin)).send().await.unwrap().status(), StatusCode::OK);
    sqlx::query("UPDATE _sqlx_migrations SET success = true").execute(&app.pool).await.unwrap();
}

fn service<'a>(doc: &'a Yaml, name: &str) -> &'a Yaml {
    let s = &doc["services"][name];
    assert!(!s.is_badvalue(), "compose has no `{name}` service");
    s
}

fn env_of(s: &Yaml, anchors: &Yaml) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for source in [anchors, &s["environment"]] {
        if let Some(h) = source.as_hash() {
            for (k, v) in h {
                let (Some(k), v) = (k.as_str(), v) else { continue };
                let v = match v {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    _ => continue,
                };
                out.push((k.to_string(), v));
            }
        }
    }
    out
}

#[test]
fn the_compose_file_names_every_service_and_valid_configuration() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docker-compose.yml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap();
    let doc = &docs[0];
    let shared = &doc["x-airlock-env"];
    for name in ["postgres", "migrate", "api", "admin", "worker", "sandbox-worker", "mailpit"] {
        service(doc, name);
    }
    let worker = service(doc, "worker");
    assert!(worker["container_name"].is_badvalue(), "a scalable worker has no fixed name");
    assert!(worker["ports"].is_badvalue(), "a scalable worker publishes no host port");
    assert_eq!(service(doc, "migrate")["command"][1].as_str(), Some("migrate"));
    assert_eq!(service(doc, "admin")["command"][1].as_str(), Some("serve"));
    for name in ["api", "admin", "worker", "sandbox-worker"] {
        let s = service(doc, name);
        assert_eq!(
            s["depends_on"]["migrate"]["condition"].as_str(),
            Some("service_completed_successfully"),
            "{name} waits for the migration"
        );
        assert!(!s["healthcheck"]["test"].is_badvalue(), "{name} has a health check");
        // Every variable the service is given must be valid airlock configuration.
        let env = env_of(s, shared);
        assert!(env.iter().any(|(k, _)| k == "DATABASE_URL"), "{name} names its database");
        let cfg = airlock_core::config::Config::from_sources(None, &env);
        assert!(cfg.is_ok(), "{name}: {:?}", cfg.err());
    }
    assert_eq!(service(doc, "migrate")["depends_on"]["postgres"]["condition"].as_str(), Some("service_healthy"));
    assert!(!service(doc, "postgres")["healthcheck"]["test"].is_badvalue());
    let worker_env = env_of(worker, shared);
    let get = |k: &str| worker_env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("AIRLOCK__SMTP__TLS").as_deref(), Some("required"), "TLS even in the compose fleet");

    // Sandboxed tasks run on a pool of their own, which holds none of the senders' secrets.
    assert!(
        get("AIRLOCK__WORKER__QUEUES").is_some_and(|q| !q.split(',').any(|q| q.trim() == "sandbox")),
        "{worker_env:?}"
    );
    let sandbox = service(doc, "sandbox-worker");
    let sandbox_env = env_of(sandbox, shared);
    let sget = |k: &str| sandbox_env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(
        sget("AIRLOCK__WORKER__QUEUES").as_deref(),
        Some("sandbox"),
        "the sandbox pool claims only sandbox jobs"
    );
    for (k, _) in &sandbox_env {
        let upper = k.to_ascii_uppercase();
        assert!(
            !(upper.starts_with("AIRLOCK__SMTP__")
                || upper.contains("WEBHOOK")
                || upper.contains("SIGNING")
                || upper.contains("PASSWORD")
                || upper.contains("FLEET_SECRET")
                || upper.starts_with("AIRLOCK_SECRET_")),
            "the sandbox pool is given a sender's setting or secret: {k}"
        );
    }
    assert!(sandbox["volumes"].is_badvalue(), "the sandbox pool mounts nothing of the senders' (certificates, keys)");
    assert_ne!(sget("AIRLOCK__SANDBOX__ISOLATION").as_deref(), Some("none"));
    let cfg = airlock_core::config::Config::from_sources(None, &sandbox_env).unwrap();
    assert_eq!(cfg.sandbox.isolation, airlock_core::config::sandbox::Isolation::Bubblewrap);
    assert!(!cfg.sandbox.protected_endpoints.is_empty(), "the pool names the services its tasks must not reach");
    // What bubblewrap needs in a container, and no more: no privileged container.
    assert_ne!(sandbox["privileged"].as_bool(), Some(true));
    let list = |y: &Yaml| -> Vec<String> {
        y.as_vec().map(|v| v.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()).unwrap_or_default()
    };
    assert_eq!(list(&sandbox["cap_drop"]), ["ALL"]);
    let caps = list(&sandbox["cap_add"]);
    assert!(caps.contains(&"SETUID".into()) && caps.contains(&"SETGID".into()), "{caps:?}");
    assert!(!caps.iter().any(|c| c == "SYS_ADMIN" || c == "ALL"), "{caps:?}");
    let opts = list(&sandbox["security_opt"]);
    for needed in ["seccomp=", "apparmor=", "systempaths=unconfined"] {
        assert!(opts.iter().any(|o| o.starts_with(needed)), "security_opt lacks {needed}: {opts:?}");
    }

    let dockerfile = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Dockerfile")).unwrap();
    for package in ["bubblewrap", "slirp4netns"] {
        assert!(dockerfile.contains(package), "the image installs {package}");
    }
    assert!(dockerfile.contains("USER 10001"), "runs as a non-root user");
    assert!(dockerfile.contains("HEALTHCHECK"));
    for bin in ["airlock-api", "airlock-admin", "airlock-worker"] {
        assert!(dockerfile.contains(bin));
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn operators_retry_and_cancel_jobs_from_the_command_line(pool: PgPool) {
    let url = harness::database_url(&pool);
    let mut tx = pool.begin().await.unwrap();
    let job = airlock_queue::enqueue(&mut tx, &airlock_queue::NewJob::new("diag.sleep", serde_json::json!({})))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let claimed =
        airlock_queue::claim_batch(&pool, "w", &Default::default(), 1, Duration::from_secs(30)).await.unwrap();
    airlock_queue::fail(&pool, claimed[0].lease(), "boom", true, None).await.unwrap();

    let id = job.id.to_string();
    let out = harness::spawn("airlock-admin", &["jobs", "retry", &id], &url, &[]).wait_with_output().unwrap();
    assert!(!out.status.success(), "a reason is required");
    let out = harness::spawn("airlock-admin", &["jobs", "retry", &id, "--reason", "fixed the relay"], &url, &[])
        .wait_with_output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(airlock_queue::get(&pool, job.id).await.unwrap().state, airlock_queue::JobState::Available);
    let out = harness::spawn("airlock-admin", &["jobs", "cancel", &id, "--reason", "not needed"], &url, &[])
        .wait_with_output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(airlock_queue::get(&pool, job.id).await.unwrap().state, airlock_queue::JobState::Cancelled);
    let actions: Vec<(String, String)> =
        sqlx::query_as("SELECT action, reason FROM audit_log ORDER BY id").fetch_all(&pool).await.unwrap();
    assert_eq!(
        actions,
        [("job.retry".to_string(), "fixed the relay".to_string()), ("job.cancel".into(), "not needed".into())]
    );
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn metrics_gauges_are_sampled_at_most_once_per_interval(pool: PgPool) {
    // A long interval: the first scrape samples, later ones within it reuse that sample
    // (no count per scrape), on every listener of the process.
    let app = TestApp::start(pool, &[("AIRLOCK__HTTP__METRICS_SAMPLE_SECONDS", "3600")]).await;
    let scrape = |base: String| {
        let http = app.http.clone();
        async move { http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap() }
    };
    let first = scrape(app.api.clone()).await;
    assert!(first.contains("airlock_send_enabled 0"), "{first}");
    app.set_switch(true).await;
    for base in [app.api.clone(), app.admin.clone()] {
        let text = scrape(base.clone()).await;
        assert!(text.contains("airlock_send_enabled 0"), "{base}: the sample is reused within its interval:\n{text}");
    }
    // Counters are not sampled: they move at once.
    let text = scrape(app.api.clone()).await;
    assert!(text.contains(airlock_core::metrics::HTTP_REQUESTS), "{text}");
}
