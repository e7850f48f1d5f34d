//! Webhook requests verify with the receivers' own library (PyPI `standardwebhooks`), each
//! with its origin's secret only: a receiver holding one origin's secret cannot verify (so
//! cannot forge) another's. Deliveries and an agent turn's declared tool are signed alike.

use std::sync::Arc;
use std::time::Duration;

use airlock_channels::webhook::WebhookSender;
use airlock_delivery::state::DeliveryState;
use airlock_tests::app::{HOOKS_ENDPOINT_SECRET, TestApp, WEBHOOK_SECRET};
use airlock_tests::harness;
use airlock_tests::webhook::{Hit, WebhookReceiver};
use base64::Engine;
use serde_json::{Value, json};
use sqlx::PgPool;

const WAIT: Duration = Duration::from_secs(20);
const OTHER_SECRET: &str = "whsec_b3RoZXItcmVjZWl2ZXItc2VjcmV0LWtleS0wMTIzNDU2Nzg5";
const OTHER_SECRET_ENV: &str = "AIRLOCK_TEST_OTHER_ENDPOINT_SECRET";

/// Verifies each `(secret, hit)` with `standardwebhooks.Webhook(secret).verify`; `Ok` or
/// the library's refusal.
fn verify_with_library(cases: &[(&str, &Hit)]) -> Vec<Result<(), String>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let input: Vec<Value> = cases
        .iter()
        .map(|(secret, hit)| {
            json!({"secret": secret, "body": b64.encode(&hit.body), "headers": {
                "webhook-id": hit.webhook_id, "webhook-timestamp": hit.webhook_timestamp,
                "webhook-signature": hit.webhook_signature}})
        })
        .collect();
    let script = r#"
import base64, json, sys
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
out = []
for case in json.load(sys.stdin):
    headers = {k: v for k, v in case["headers"].items() if v is not None}
    try:
        Webhook(case["secret"]).verify(base64.b64decode(case["body"]), headers)
        out.append(None)
    except WebhookVerificationError as e:
        out.append("refused: " + str(e))
print(json.dumps(out))
"#;
    let out = harness::run_python(script, serde_json::to_string(&input).unwrap().as_bytes());
    assert!(out.status.success(), "the standardwebhooks script failed");
    let results: Vec<Option<String>> = serde_json::from_slice(&out.stdout).unwrap();
    results.into_iter().map(|r| r.map_or(Ok(()), Err)).collect()
}

fn hook_to(run: &str, step: &str, origin: &str, n: u64) -> Value {
    json!({"run_id": run, "step_id": step, "channel": "webhook",
           "webhook": {"url": format!("{origin}/in?n={n}"), "body": {"order": n, "note": "ünïcode ✓"}, "headers": {}}})
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn each_origin_verifies_with_its_own_secret_and_no_other(pool: PgPool) {
    let other = WebhookReceiver::start().await.unwrap();
    let other_origin = other.origin();
    let app = TestApp::start(
        pool,
        &[
            ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__OTHER__ORIGIN", &other_origin),
            ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__OTHER__SECRET_ENV", OTHER_SECRET_ENV),
            ("AIRLOCK__DELIVERY__WEBHOOK_ENDPOINTS__OTHER__ALLOW_LOOPBACK", "true"),
            (OTHER_SECRET_ENV, OTHER_SECRET),
        ],
    )
    .await;
    app.set_switch(true).await;
    let (stop, worker) = app.start_worker("w-signatures");
    let run = app.create_run(0).await;

    // One retried delivery to the test receiver (503 first), one to the other origin.
    app.hooks.push_statuses([503]);
    let mut ids = Vec::new();
    for (step, origin, n) in [("s1", app.hooks.origin(), 1), ("s2", other_origin.clone(), 2)] {
        let id = app.submit(hook_to(&run, step, &origin, n)).await;
        app.wait_state(&id, DeliveryState::AwaitingApproval, WAIT).await;
        app.approve(&id).await;
        ids.push(id);
    }
    let mut keys = Vec::new();
    for id in &ids {
        let d = app.wait_state(id, DeliveryState::Sent, WAIT).await;
        keys.push(d["idempotency_key"].as_str().unwrap().to_string());
    }
    let (mine, theirs) = (app.hooks.hits(), other.hits());
    assert_eq!((mine.len(), theirs.len()), (2, 1), "a retry and a send; a send");
    for h in mine.iter().chain(&theirs) {
        // The old headers stay, and webhook-id is the idempotency key on every retry.
        assert!(h.signature.as_deref().is_some_and(|s| s.starts_with("t=")));
        assert_eq!(h.webhook_id, h.idempotency_key);
        assert!(h.webhook_signature.as_deref().is_some_and(|s| s.starts_with("v1,")));
    }
    assert!(mine.iter().all(|h| h.webhook_id.as_deref() == Some(keys[0].as_str())));
    assert_eq!(theirs[0].webhook_id.as_deref(), Some(keys[1].as_str()));

    // The shared signing secret as a Standard Webhooks secret: it verifies neither origin.
    let shared = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_SECRET));
    let mut tampered = theirs[0].clone();
    tampered.body = br#"{"order":2,"note":"forged"}"#.to_vec();
    let mut replayed_elsewhere = theirs[0].clone();
    replayed_elsewhere.webhook_id = mine[0].webhook_id.clone();
    let cases: Vec<(&str, &Hit)> = vec![
        (HOOKS_ENDPOINT_SECRET, &mine[0]),
        (HOOKS_ENDPOINT_SECRET, &mine[1]),
        (OTHER_SECRET, &theirs[0]),
        (OTHER_SECRET, &mine[0]),
        (OTHER_SECRET, &mine[1]),
        (HOOKS_ENDPOINT_SECRET, &theirs[0]),
        (&shared, &mine[0]),
        (&shared, &theirs[0]),
        (OTHER_SECRET, &tampered),
        (OTHER_SECRET, &replayed_elsewhere),
    ];
    let results = verify_with_library(&cases);
    let ok: Vec<bool> = results.iter().map(Result::is_ok).collect();
    assert_eq!(
        ok,
        [true, true, true, false, false, false, false, false, false, false],
        "each origin verifies with its own secret only: {results:?}"
    );

    // A declared HTTP tool of an agent turn is signed the same way, keyed by its origin.
    let sender = WebhookSender::from_config(
        &app.config.delivery,
        Duration::from_secs(5),
        &|n| app.secret(n),
        Arc::new(airlock_channels::address::SystemLookup),
    )
    .unwrap();
    let answer = sender.call_json(&format!("{other_origin}/tools/lookup"), &json!({"q": "x"}), "tool_key_1").await;
    assert!(answer.is_ok(), "{answer:?}");
    let call = other.hits().pop().unwrap();
    assert_eq!((call.path.as_str(), call.webhook_id.as_deref()), ("/tools/lookup", Some("tool_key_1")));
    let results = verify_with_library(&[(OTHER_SECRET, &call), (HOOKS_ENDPOINT_SECRET, &call)]);
    assert!(results[0].is_ok() && results[1].is_err(), "{results:?}");
    stop.cancel();
    worker.await.unwrap().unwrap();
}
