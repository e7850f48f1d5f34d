//! Everything a delivery's view shows, read in one statement: its latest score, its
//! receipt, its events (from the hot log or the archive), and for a reviewer its artifact,
//! the artifact its agent submitted when an edit replaced it, and its send attempts.
//!
//! One statement is one round trip and one backend. On a database the pipeline keeps busy,
//! each round trip waits for its backend to be scheduled; a view read as six statements at
//! once waited for the last of six.
//!
//! The rows that hang off a delivery travel as JSON built from the same columns their own
//! statements read (`to_jsonb` of a row, or `jsonb_agg` in order), decoded into the same
//! types.

use airlock_core::ids::DeliveryId;
use serde_json::Value;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor};

use crate::store::{Attempt, Delivery, Event, Receipt, ScoreRow};

/// What a delivery's view shows besides the delivery's own columns.
#[derive(Debug, Clone, Default)]
pub struct Shown {
    pub score: Option<ScoreRow>,
    pub receipt: Option<Receipt>,
    /// Oldest first. Their hashes are not read: a view does not verify the chain.
    pub events: Vec<Event>,
    /// With `full` only, as the rest below.
    pub artifact: Option<Value>,
    /// When a reviewer's edit replaced what the agent submitted.
    pub submitted_artifact: Option<Value>,
    pub attempts: Vec<Attempt>,
}

/// The statement of [`shown`]: `$1` the delivery, `$2` whether to read what only a
/// reviewer sees, `$3` the artifact version to show (NULL: the delivery's current one),
/// `$4` the agent it must belong to (NULL: any).
pub const SHOWN_SQL: &str = r#"SELECT d.*,
    (SELECT to_jsonb(s) FROM (
        SELECT value, reasons, scorer, threshold, artifact_sha256, created_at FROM scores
        WHERE delivery_id = d.id ORDER BY created_at DESC, id DESC LIMIT 1) s) AS score,
    (SELECT to_jsonb(r) FROM (
        SELECT channel, message_id, provider_response, payload_sha256, sent_at, attempt, worker, attested_by
        FROM receipts WHERE delivery_id = d.id) r) AS receipt,
    (SELECT coalesce(jsonb_agg(to_jsonb(e) ORDER BY e.seq), '[]') FROM (
        SELECT seq, from_state AS "from", to_state AS "to", actor, reason, data, at
        FROM delivery_events WHERE delivery_id = d.id
        UNION ALL
        SELECT seq, from_state, to_state, actor, reason, data, at
        FROM delivery_events_archive WHERE delivery_id = d.id) e) AS events,
    (SELECT a.body FROM artifacts a
     WHERE $2::boolean AND a.sha256 = coalesce($3::text, d.artifact_sha256)) AS artifact,
    (SELECT a.body FROM artifacts a
     WHERE $2::boolean AND d.submitted_sha256 <> coalesce($3::text, d.artifact_sha256)
       AND a.sha256 = d.submitted_sha256) AS submitted_artifact,
    (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.started_at, t.id), '[]') FROM (
        SELECT id, job_id, lease_attempt, worker, artifact_sha256, started_at, outcome, detail, finished_at
        FROM send_attempts WHERE $2::boolean AND delivery_id = d.id) t) AS attempts
FROM deliveries d WHERE d.id = $1::uuid AND ($4::text IS NULL OR d.agent = $4)"#;

/// The delivery `id` with what its view shows; `full` adds what only a reviewer sees, of
/// the artifact version `artifact_sha256` (`None`: the delivery's current one). With
/// `agent`, a delivery of another agent is not read at all (`None`, as an unknown id).
pub async fn shown(
    db: impl PgExecutor<'_>,
    id: DeliveryId,
    full: bool,
    artifact_sha256: Option<&str>,
    agent: Option<&str>,
) -> Result<Option<(Delivery, Shown)>, sqlx::Error> {
    #[derive(FromRow)]
    struct Row {
        #[sqlx(flatten)]
        delivery: Delivery,
        score: Option<Json<ScoreRow>>,
        receipt: Option<Json<Receipt>>,
        events: Json<Vec<Event>>,
        artifact: Option<Value>,
        submitted_artifact: Option<Value>,
        attempts: Json<Vec<Attempt>>,
    }
    let row: Option<Row> =
        sqlx::query_as(SHOWN_SQL).bind(id).bind(full).bind(artifact_sha256).bind(agent).fetch_optional(db).await?;
    Ok(row.map(|r| {
        let shown = Shown {
            score: r.score.map(|s| s.0),
            receipt: r.receipt.map(|s| s.0),
            events: r.events.0,
            artifact: r.artifact,
            submitted_artifact: r.submitted_artifact,
            attempts: r.attempts.0,
        };
        (r.delivery, shown)
    }))
}
