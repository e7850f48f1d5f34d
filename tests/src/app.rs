//! `TestApp`: the real api and admin services started in-process on port 0 against a
//! test's own database, a real SMTP server over STARTTLS with a test CA, a webhook
//! receiver, and principals of every role. Workers are started in-process or as real
//! processes by the test.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use airlock_core::config::Config;
use airlock_core::principals::{self, Role};
use airlock_delivery::state::DeliveryState;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::harness;
use crate::smtp::{SmtpOptions, SmtpServer, TestCa};
use crate::webhook::WebhookReceiver;

/// Secret the webhook channel signs with in tests.
pub const WEBHOOK_SECRET: &str = "test-webhook-secret";
/// Name of the variable holding it.
pub const WEBHOOK_SECRET_ENV: &str = "AIRLOCK_TEST_WEBHOOK_SECRET";
/// The Standard Webhooks secret of the test receiver's origin (its endpoint `hooks`).
pub const HOOKS_ENDPOINT_SECRET: &str = "whsec_dGVzdC1yZWNlaXZlci1rZXktMDEyMzQ1Njc4OWFiY2RlZg==";
/// Name of the variable holding it.
pub const HOOKS_ENDPOINT_SECRET_ENV: &str = "AIRLOCK_TEST_HOOKS_ENDPOINT_SECRET";

/// The configuration of the test receiver at `origin` as the endpoint `hooks`: its own
/// secret, and loopback allowed (it listens on 127.0.0.1).
pub fn hooks_endpoint_env(origin: &str) -> Vec<(String, String)> {
    vec![
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__HOOKS__ORIGIN".into(), origin.into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__HOOKS__SECRET_ENV".into(), HOOKS_ENDPOINT_SECRET_ENV.into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__HOOKS__ALLOW_LOOPBACK".into(), "true".into()),
        (HOOKS_ENDPOINT_SECRET_ENV.into(), HOOKS_ENDPOINT_SECRET.into()),
    ]
}

pub struct TestApp {
    pub pool: PgPool,
    pub db_url: String,
    pub config: Arc<Config>,
    /// The configuration as environment variables, for spawning real workers.
    pub env: Vec<(String, String)>,
    pub api: String,
    pub admin: String,
    pub smtp: SmtpServer,
    pub ca: Arc<TestCa>,
    pub ca_file: PathBuf,
    pub hooks: WebhookReceiver,
    pub http: reqwest::Client,
    pub agent: String,
    pub other_agent: String,
    pub reviewer: String,
    pub operator: String,
    pub admin_token: String,
    stop: CancellationToken,
    _dir: TempDir,
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl TestApp {
    /// Starts everything with the default test configuration plus `extra` variables (in a
    /// value, `{hooks}` is the webhook receiver's origin).
    pub async fn start(pool: PgPool, extra: &[(&str, &str)]) -> Self {
        harness::init_logs();
        let db_url = harness::database_url(&pool);
        let ca = Arc::new(TestCa::new().expect("test CA"));
        let dir = std::env::temp_dir().join(format!("airlock-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca_file = ca.write_ca_file(&dir).expect("CA file");
        let smtp = SmtpServer::start(SmtpOptions::starttls(ca.clone())).await.expect("SMTP server");
        let hooks = WebhookReceiver::start().await.expect("webhook receiver");

        let mut env: Vec<(String, String)> = vec![
            ("DATABASE_URL".into(), db_url.clone()),
            ("AIRLOCK__SMTP__HOST".into(), "127.0.0.1".into()),
            ("AIRLOCK__SMTP__PORT".into(), smtp.port().to_string()),
            ("AIRLOCK__SMTP__CA_FILE".into(), ca_file.display().to_string()),
            ("AIRLOCK__SMTP__TIMEOUT_SECONDS".into(), "5".into()),
            // The test server draws its faults per connection: one connection per message
            // keeps a queued fault on the message it was queued for.
            ("AIRLOCK__SMTP__MAX_IDLE_CONNECTIONS".into(), "0".into()),
            ("AIRLOCK__DELIVERY__SENDERS".into(), "agent@example.com,@airlock.test".into()),
            ("AIRLOCK__DELIVERY__WEBHOOK_ORIGINS".into(), hooks.origin()),
            ("AIRLOCK__DELIVERY__WEBHOOK_ALLOW_PLAINTEXT_LOOPBACK".into(), "true".into()),
            ("AIRLOCK__DELIVERY__WEBHOOK_SECRET_ENV".into(), WEBHOOK_SECRET_ENV.into()),
            ("AIRLOCK__DELIVERY__WEBHOOK_TIMEOUT_SECONDS".into(), "5".into()),
            (WEBHOOK_SECRET_ENV.into(), WEBHOOK_SECRET.into()),
            ("AIRLOCK__DELIVERY__KNOWN_DOMAINS".into(), "example.org".into()),
            ("AIRLOCK__WORKER__POLL_INTERVAL_MS".into(), "100".into()),
            ("AIRLOCK__WORKER__LEASE_SECONDS".into(), "3".into()),
            ("AIRLOCK__WORKER__RESCUE_INTERVAL_SECONDS".into(), "1".into()),
            ("AIRLOCK__API__LISTEN".into(), "127.0.0.1:0".into()),
            ("AIRLOCK__ADMIN__LISTEN".into(), "127.0.0.1:0".into()),
        ];
        env.extend(hooks_endpoint_env(&hooks.origin()));
        // `{hooks}` in a value stands for the webhook receiver's origin.
        for (k, v) in extra {
            env.retain(|(ek, _)| ek != k);
            env.push((k.to_string(), v.replace("{hooks}", &hooks.origin())));
        }
        let config = Arc::new(Config::from_sources(None, &env).expect("test configuration"));

        let stop = CancellationToken::new();
        let api_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind api");
        let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
        let api = format!("http://{}", api_listener.local_addr().expect("api addr"));
        let admin = format!("http://{}", admin_listener.local_addr().expect("admin addr"));
        let api_router =
            airlock_api::router(airlock_api::AppState::new(pool.clone(), config.clone()).expect("api state"));
        let admin_router = airlock_admin::server::router(airlock_admin::server::AppState {
            pool: pool.clone(),
            config: config.clone(),
        });
        let limits = airlock_http::ServeLimits::from(&config.http);
        tokio::spawn(airlock_http::serve(api_listener, api_router, limits, stop.clone()));
        tokio::spawn(airlock_http::serve(admin_listener, admin_router, limits, stop.clone()));

        let token = |name: &'static str, role: Role, agent: Option<&'static str>| {
            let pool = pool.clone();
            async move { principals::create(&pool, name, role, agent).await.expect("principal").1.expose().to_string() }
        };
        Self {
            agent: token("agent-1", Role::Agent, Some("agent-1")).await,
            other_agent: token("agent-2", Role::Agent, Some("agent-2")).await,
            reviewer: token("rita", Role::Reviewer, None).await,
            operator: token("otto", Role::Operator, None).await,
            admin_token: token("ada", Role::Admin, None).await,
            pool,
            db_url,
            config,
            env,
            api,
            admin,
            smtp,
            ca,
            ca_file,
            hooks,
            http: reqwest::Client::new(),
            stop,
            _dir: TempDir(dir),
        }
    }

    /// The value of the variable `name` of this app's environment (how in-process workers
    /// read their secrets).
    pub fn secret(&self, name: &str) -> Option<airlock_core::secret::Secret> {
        self.env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| airlock_core::secret::Secret::new(v.clone()))
    }

    /// The configuration's environment as `(&str, &str)` pairs, for `harness::spawn`.
    pub fn env_pairs(&self) -> Vec<(&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    /// Sends a request; returns the status and the JSON body (Null when there is none).
    pub async fn call(&self, method: &str, url: &str, token: Option<&str>, body: Option<Value>) -> (StatusCode, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut req = self.http.request(method, url);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn create_run(&self, max_steps: i64) -> String {
        let (s, v) = self
            .call(
                "POST",
                &format!("{}/v1/runs", self.api),
                Some(&self.agent),
                Some(json!({"budget": {"max_steps": max_steps}})),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().expect("run id").to_string()
    }

    /// A clean email from a verified sender to a known domain.
    pub fn email(run_id: &str, step: &str, subject: &str) -> Value {
        json!({"run_id": run_id, "step_id": step, "channel": "email",
               "email": {"from": "agent@example.com", "to": ["alice@example.org"], "cc": [],
                         "subject": subject, "text": "Hello from the test suite.", "html": null}})
    }

    pub fn webhook(&self, run_id: &str, step: &str, n: u64) -> Value {
        json!({"run_id": run_id, "step_id": step, "channel": "webhook",
               "webhook": {"url": format!("{}/hooks/orders", self.hooks.origin()), "body": {"order": n}, "headers": {}}})
    }

    /// Submits as the agent; returns the delivery id.
    pub async fn submit(&self, body: Value) -> String {
        let (s, v) = self.call("POST", &format!("{}/v1/deliveries", self.api), Some(&self.agent), Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().expect("delivery id").to_string()
    }

    /// The admin view of a delivery.
    pub async fn delivery(&self, id: &str) -> Value {
        let (s, v) =
            self.call("GET", &format!("{}/admin/v1/deliveries/{id}", self.admin), Some(&self.reviewer), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }

    pub async fn wait_state(&self, id: &str, state: DeliveryState, timeout: Duration) -> Value {
        let uuid = uuid::Uuid::parse_str(id).expect("uuid");
        let state_now = || async {
            sqlx::query_scalar::<_, DeliveryState>("SELECT state FROM deliveries WHERE id = $1")
                .bind(uuid)
                .fetch_one(&self.pool)
                .await
                .ok()
        };
        if harness::poll_until(timeout, || async { (state_now().await == Some(state)).then_some(()) }).await.is_none() {
            panic!(
                "timed out after {timeout:?} waiting for delivery {id} to be {}; it is {:?}\n{}",
                state.as_str(),
                state_now().await,
                self.story_of(uuid).await
            );
        }
        self.delivery(id).await
    }

    /// A delivery's jobs, attempts and events, for the message of a failed wait.
    async fn story_of(&self, id: uuid::Uuid) -> String {
        let rows: Vec<String> = sqlx::query_scalar(
            r#"SELECT format('job %s %s attempt %s/%s owner %s lease %s effect %s error %s', kind, state, attempt,
                             max_attempts, lease_owner, lease_expires_at - now(), effect_started_at, last_error)
               FROM jobs WHERE payload->>'delivery_id' = $1::text
               UNION ALL
               SELECT format('attempt %s by %s epoch %s outcome %s', started_at, worker, lease_attempt, outcome)
               FROM send_attempts WHERE delivery_id = $1
               UNION ALL
               SELECT format('event %s %s -> %s by %s: %s', seq, from_state, to_state, actor, reason)
               FROM (SELECT * FROM delivery_events UNION ALL SELECT * FROM delivery_events_archive) e
               WHERE delivery_id = $1
               UNION ALL
               SELECT format('worker %s stopped %s heartbeat %s', id, stopped_at, heartbeat_at) FROM workers"#,
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .unwrap_or_else(|e| vec![format!("(could not read: {e})")]);
        rows.join("\n")
    }

    /// Approves the current artifact as the reviewer.
    pub async fn approve(&self, id: &str) -> Value {
        let d = self.delivery(id).await;
        let (s, v) = self
            .call(
                "POST",
                &format!("{}/admin/v1/deliveries/{id}/approve", self.admin),
                Some(&self.reviewer),
                Some(json!({"artifact_sha256": d["artifact_sha256"], "note": "looks right"})),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }

    pub async fn set_switch(&self, enabled: bool) {
        let (s, v) = self
            .call(
                "PUT",
                &format!("{}/admin/v1/send-enabled", self.admin),
                Some(&self.operator),
                Some(json!({"enabled": enabled, "reason": "test"})),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }

    /// Starts an in-process worker with this app's configuration; stop it with the token.
    pub fn start_worker(&self, id: &str) -> (CancellationToken, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let mut settings = airlock_worker::WorkerSettings::from_config(&self.config, id.to_string());
        settings.shutdown_grace = Duration::from_secs(10);
        let registry = airlock_worker::app::registry_with(&self.config, id, &|n| self.secret(n)).expect("registry");
        let worker = airlock_worker::Worker::new(self.pool.clone(), registry, settings);
        let stop = CancellationToken::new();
        let handle = tokio::spawn(worker.run(stop.clone()));
        (stop, handle)
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
