//! How a delivery is shown: to its agent (no artifact body) and to reviewers (everything).

use serde_json::{Value, json};
use sqlx::PgExecutor;

use crate::artifact::EmailAddress;
use crate::policy;
use crate::store::{self, Delivery};

/// The JSON of a delivery. `full` adds the artifact, the agent, the attempts and the
/// score's details (the admin view).
pub async fn render<'c, E>(db: E, d: &Delivery, full: bool) -> Result<Value, sqlx::Error>
where
    E: PgExecutor<'c> + Copy,
{
    let score = store::latest_score(db, d.id).await?;
    let receipt = store::receipt(db, d.id).await?;
    let events = store::events(db, d.id).await?;
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
        let artifact = store::get_artifact(db, &d.artifact_sha256).await?;
        let attempts = store::attempts(db, d.id).await?;
        v["agent"] = json!(d.agent);
        // The Message-ID the relay knows an email by, derived from its key (what a human
        // resolving a parked send searches for).
        let from =
            artifact.as_ref().and_then(|a| a["email"]["from"].as_str()).and_then(|f| EmailAddress::parse(f).ok());
        v["message_id"] = json!(from.map(|f| policy::message_id(&d.idempotency_key, &f)));
        v["artifact"] = artifact.unwrap_or(Value::Null);
        v["submitted_sha256"] = json!(d.submitted_sha256);
        // What the agent submitted, when a reviewer's edit replaced it (the diff's left side).
        v["submitted_artifact"] = if d.submitted_sha256 == d.artifact_sha256 {
            Value::Null
        } else {
            store::get_artifact(db, &d.submitted_sha256).await?.unwrap_or(Value::Null)
        };
        v["effect_class"] = json!(d.effect_class);
        v["attempts"] = json!(attempts);
        if let Some(s) = score {
            v["score"] = json!({"value": s.value, "reasons": s.reasons, "scorer": s.scorer, "threshold": s.threshold});
        }
    }
    Ok(v)
}

/// A list row: the short line plus what a reviewer scans a queue by (the email's subject
/// or the webhook's URL, and the latest score's value).
pub fn row(d: &Delivery, preview: Option<&store::Preview>) -> Value {
    let mut v = summary(d);
    v["subject"] = json!(preview.and_then(|p| p.subject.clone()));
    v["url"] = json!(preview.and_then(|p| p.url.clone()));
    v["score"] = json!(preview.and_then(|p| p.score));
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
