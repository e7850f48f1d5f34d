//! Where a webhook may connect: the host is resolved when the request is made and only a
//! checked address is connected to, so a name that resolves (or comes to resolve) to this
//! machine, a private network or a metadata service is refused at send time unless the
//! origin's endpoint allows it. Names are answered by a resolver the test controls, and
//! by the system's own for `localhost`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use airlock_channels::EffectOutcome;
use airlock_channels::address::{Lookup, LookupFuture};
use airlock_channels::webhook::WebhookSender;
use airlock_core::config::Config;
use airlock_delivery::artifact::WebhookArtifact;
use airlock_delivery::state::DeliveryState;
use airlock_tests::app::TestApp;
use airlock_tests::webhook::WebhookReceiver;
use serde_json::json;
use sqlx::PgPool;

/// Answers names from a table, as a DNS server under someone else's control would.
struct Table(BTreeMap<&'static str, Vec<IpAddr>>);

impl Lookup for Table {
    fn lookup<'a>(&'a self, host: &'a str) -> LookupFuture<'a> {
        Box::pin(async move {
            self.0.get(host).cloned().ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no such name"))
        })
    }
}

fn table() -> Arc<dyn Lookup> {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    Arc::new(Table(BTreeMap::from([
        ("internal.test", vec![ip("127.0.0.1")]),
        ("private.test", vec![ip("10.0.0.1")]),
        ("metadata.test", vec![ip("169.254.169.254")]),
        ("mapped.test", vec![ip("::ffff:127.0.0.1")]),
    ])))
}

fn config(extra: &[(&str, &str)]) -> Config {
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), "postgres://x@127.0.0.1/x".into()),
        ("AIRLOCK__DELIVERY__WEBHOOK_SECRET_ENV".into(), "SHARED".into()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Config::from_sources(None, &env).unwrap()
}

fn sender(cfg: &Config) -> WebhookSender {
    let secrets = |n: &str| match n {
        "SHARED" => Some(airlock_core::secret::Secret::new("shared-secret")),
        "INTERNAL" => Some(airlock_core::secret::Secret::new("whsec_aW50ZXJuYWwta2V5")),
        _ => None,
    };
    WebhookSender::from_config(&cfg.delivery, Duration::from_secs(3), &secrets, table()).unwrap()
}

async fn post(sender: &WebhookSender, url: &str) -> EffectOutcome {
    let hook = WebhookArtifact { url: url.into(), body: json!({"n": 1}), headers: BTreeMap::new() };
    sender.send(&hook, "dlv_address_test").await
}

fn refused(outcome: &EffectOutcome, why: &str) -> bool {
    matches!(outcome, EffectOutcome::Permanent { detail } if detail.starts_with("not sent") && detail.contains(why))
}

#[tokio::test]
async fn names_resolving_inward_are_refused_at_send_time_unless_the_endpoint_allows_them() {
    airlock_tests::harness::init_logs();
    let receiver = WebhookReceiver::start().await.unwrap();
    let port = receiver.origin().rsplit(':').next().unwrap().to_string();
    let internal = format!("http://internal.test:{port}");

    // No endpoint allows anything: every inward answer is refused, nothing reaches the
    // receiver listening at the address the name points to.
    let plain = sender(&config(&[]));
    let cases = [
        (format!("{internal}/hook"), "a loopback address"),
        (format!("http://mapped.test:{port}/hook"), "a loopback address"),
        ("https://private.test/hook".to_string(), "a private address"),
        ("https://metadata.test/latest/meta-data".to_string(), "a cloud metadata address"),
        // Address literals are checked before any connection.
        (format!("http://127.0.0.1:{port}/hook"), "a loopback address"),
        ("http://10.0.0.1:9/hook".to_string(), "a private address"),
        ("http://169.254.169.254/latest".to_string(), "a cloud metadata address"),
        ("http://[::1]:9/hook".to_string(), "a loopback address"),
    ];
    for (url, why) in &cases {
        let outcome = post(&plain, url).await;
        assert!(refused(&outcome, why), "{url}: {outcome:?}");
        assert!(
            !outcome.detail().contains("/hook") && !outcome.detail().contains("meta-data"),
            "no URL in {outcome:?}"
        );
    }
    assert!(receiver.hits().is_empty(), "nothing reached the receiver");

    // The endpoint of internal.test allows loopback: the request goes to the checked
    // address, and only there. Its allowance is its own: other names stay refused.
    let allowing = sender(&config(&[
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__INTERNAL__ORIGIN", &internal),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__INTERNAL__SECRET_ENV", "INTERNAL"),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__INTERNAL__ALLOW_LOOPBACK", "true"),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__METADATA__ORIGIN", "https://metadata.test"),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__METADATA__SECRET_ENV", "INTERNAL"),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__METADATA__ALLOW_LOOPBACK", "true"),
        ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__METADATA__ALLOW_PRIVATE", "true"),
    ]));
    let outcome = post(&allowing, &format!("{internal}/hook")).await;
    assert!(matches!(outcome, EffectOutcome::Sent { .. }), "{outcome:?}");
    assert_eq!(receiver.hits().len(), 1);
    let outcome = post(&allowing, &format!("http://mapped.test:{port}/hook")).await;
    assert!(refused(&outcome, "a loopback address"), "another origin keeps no allowance: {outcome:?}");
    let outcome = post(&allowing, "https://private.test/hook").await;
    assert!(refused(&outcome, "a private address"), "{outcome:?}");
    let outcome = post(&allowing, "https://metadata.test/latest/meta-data").await;
    assert!(refused(&outcome, "a cloud metadata address"), "metadata is refused whatever is allowed: {outcome:?}");
    assert_eq!(receiver.hits().len(), 1);
}

/// Through the whole pipeline with the system's resolver: an allowed `http://localhost`
/// origin whose endpoint does not allow loopback ends `failed` at send time, nothing sent.
#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn an_allowed_origin_that_resolves_to_loopback_fails_at_send_time(pool: PgPool) {
    let other = WebhookReceiver::start().await.unwrap();
    let port = other.origin().rsplit(':').next().unwrap().to_string();
    let localhost = format!("http://localhost:{port}");
    let origins = format!("{{hooks}},{localhost}");
    let app = TestApp::start(pool, &[("AIRLOCK__DELIVERY__WEBHOOK_ORIGINS", &origins)]).await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-addresses");
    let run = app.create_run(0).await;
    let body = json!({"run_id": run, "step_id": "local", "channel": "webhook",
                      "webhook": {"url": format!("{localhost}/in?token=SECRET"), "body": {"n": 1}, "headers": {}}});
    let id = app.submit(body).await;
    app.wait_state(&id, DeliveryState::AwaitingApproval, Duration::from_secs(20)).await;
    app.approve(&id).await;
    app.wait_state(&id, DeliveryState::Failed, Duration::from_secs(20)).await;
    let detail: String = sqlx::query_scalar("SELECT detail FROM send_attempts WHERE delivery_id = $1")
        .bind(uuid::Uuid::parse_str(&id).unwrap())
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(detail.contains("localhost resolves to a loopback address"), "{detail}");
    assert!(!detail.contains("SECRET"), "{detail}");
    assert!(other.hits().is_empty(), "nothing reached the receiver");
    stop.cancel();
    worker.await.unwrap().unwrap();
}
