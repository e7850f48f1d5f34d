//! How a delivery is shown: to its agent (no artifact body) and to reviewers (everything).

use airlock_core::ids::DeliveryId;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::artifact::EmailAddress;
use crate::policy;
use crate::store::{self, Delivery, Shown};

/// The delivery `id` and its JSON (see [`render`]), read in one statement; `None` when
/// there is no such delivery, or, with `agent`, none of that agent's.
pub async fn show(
    db: &PgPool,
    id: DeliveryId,
    full: bool,
    agent: Option<&str>,
) -> Result<Option<(Delivery, Value)>, sqlx::Error> {
    Ok(store::shown(db, id, full, None, agent).await?.map(|(d, shown)| {
        let v = compose(&d, shown, full);
        (d, v)
    }))
}

/// The JSON of a delivery as `d` has it (what an action returns). `full` adds the
/// artifact, the agent, the attempts and the score's details (the admin view). What hangs
/// off the delivery is read in one statement ([`store::shown`]).
pub async fn render(db: &PgPool, d: &Delivery, full: bool) -> Result<Value, sqlx::Error> {
    let shown = store::shown(db, d.id, full, Some(&d.artifact_sha256), None).await?.map(|(_, s)| s).unwrap_or_default();
    Ok(compose(d, shown, full))
}

fn compose(d: &Delivery, shown: Shown, full: bool) -> Value {
    let Shown { score, receipt, events, artifact, submitted_artifact: submitted, attempts } = shown;
    let mut v = json!({
        "id": d.id,
        "run_id": d.run_id,
        "step_id": d.step_id,
        "state": d.state,
        "channel": d.channel,
        "artifact_sha256": d.artifact_sha256,
        "idempotency_key": d.idempotency_key,
        "version": d.version,
        "created_at": d.created_at,
        "updated_at": d.updated_at,
        "score": score.as_ref().map(|s| json!({"value": s.value, "reasons": s.reasons})),
        "receipt": receipt,
        "events": events,
    });
    if full {
        v["agent"] = json!(d.agent);
        // The Message-ID the relay knows an email by, derived from its key (what a human
        // resolving a parked send searches for).
        let from =
            artifact.as_ref().and_then(|a| a["email"]["from"].as_str()).and_then(|f| EmailAddress::parse(f).ok());
        v["message_id"] = json!(from.map(|f| policy::message_id(&d.idempotency_key, &f)));
        v["artifact"] = artifact.unwrap_or(Value::Null);
        v["submitted_sha256"] = json!(d.submitted_sha256);
        v["submitted_artifact"] = submitted.unwrap_or(Value::Null);
        v["effect_class"] = json!(d.effect_class);
        v["attempts"] = json!(attempts);
        if let Some(s) = score {
            v["score"] = json!({"value": s.value, "reasons": s.reasons, "scorer": s.scorer, "threshold": s.threshold});
        }
    }
    v
}

/// A list row: the short line plus what a reviewer scans a queue by (the email's subject
/// or the webhook's URL, and the latest score's value).
pub fn row(listed: &store::Listed) -> Value {
    let mut v = summary(&listed.delivery);
    v["subject"] = json!(listed.subject);
    v["url"] = json!(listed.url);
    v["score"] = json!(listed.score);
    v
}

/// A short line for lists.
pub fn summary(d: &Delivery) -> Value {
    json!({
        "id": d.id, "state": d.state, "channel": d.channel, "agent": d.agent, "run_id": d.run_id,
        "step_id": d.step_id, "artifact_sha256": d.artifact_sha256, "created_at": d.created_at,
        "updated_at": d.updated_at,
    })
}
