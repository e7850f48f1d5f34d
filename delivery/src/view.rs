//! How a delivery is shown: to its agent (no artifact body) and to reviewers (everything).

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::artifact::EmailAddress;
use crate::policy;
use crate::store::{self, Delivery};

/// The JSON of a delivery. `full` adds the artifact, the agent, the attempts and the
/// score's details (the admin view). Its reads go to the pool at once, each on a
/// connection of its own: a view costs one round trip's wait, not six, on a busy
/// database.
pub async fn render(db: &PgPool, d: &Delivery, full: bool) -> Result<Value, sqlx::Error> {
    let (score, receipt, events, (artifact, submitted, attempts)) =
        tokio::try_join!(store::latest_score(db, d.id), store::receipt(db, d.id), store::events(db, d.id), async {
            if !full {
                return Ok((None, None, Vec::new()));
            }
            // What the agent submitted, when a reviewer's edit replaced it (the diff's left
            // side).
            let edited = d.submitted_sha256 != d.artifact_sha256;
            tokio::try_join!(
                store::get_artifact(db, &d.artifact_sha256),
                async { if edited { store::get_artifact(db, &d.submitted_sha256).await } else { Ok(None) } },
                store::attempts(db, d.id),
            )
        },)?;
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
