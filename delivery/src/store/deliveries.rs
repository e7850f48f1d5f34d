//! SQL of `deliveries`: the current state of each delivery, its submission in one
//! statement, the locks each transition takes, and what transaction A of a send reads.

use airlock_core::ids::{DeliveryId, RunId};
use airlock_queue::EffectClass;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor};

use crate::actor::Actor;
use crate::artifact::{Artifact, Channel};
use crate::state::DeliveryState;
use crate::store::events::{EventContent, event_hash};

#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("delivery {0} not found")]
    NotFound(DeliveryId),
    #[error("a delivery in state {from} cannot be {action}")]
    InvalidTransition { from: &'static str, action: &'static str },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Delivery {
    pub id: DeliveryId,
    pub run_id: RunId,
    pub step_id: String,
    pub agent: String,
    pub channel: Channel,
    pub state: DeliveryState,
    pub version: i32,
    pub idempotency_key: String,
    pub artifact_sha256: String,
    pub submitted_sha256: String,
    pub effect_class: EffectClass,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The hash of the latest event (the head of the chain).
    #[serde(skip)]
    pub event_hash: String,
}

/// The delivery for a run's step, if any.
pub async fn find_by_step(
    db: impl PgExecutor<'_>,
    run_id: RunId,
    step_id: &str,
) -> Result<Option<Delivery>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM deliveries WHERE run_id = $1 AND step_id = $2")
        .bind(run_id)
        .bind(step_id)
        .fetch_optional(db)
        .await
}

/// A delivery [`submit`] persists.
#[derive(Clone, Copy)]
pub struct NewDelivery<'a> {
    pub id: DeliveryId,
    pub run_id: RunId,
    pub step_id: &'a str,
    pub agent: &'a str,
    pub artifact: &'a Artifact,
    pub idempotency_key: &'a str,
    pub actor: &'a Actor,
}

/// Persists a new delivery in one statement, a transaction of its own: spends one step of
/// the run (which must be `agent`'s, active, and have a step left) and records the
/// delivery as a step of its replay log (kind `delivery`), stores the artifact unless the
/// same content is stored already, and inserts the delivery in `persisted` with its first
/// event and `job`, its scoring, with no NOTIFY (see [`airlock_queue::Waker`]). Every part
/// or none: a step that is recorded already fails the statement, spent step included.
/// `None`: nothing written, because the run is not `agent`'s, or not active, or has no
/// step left, or the step is recorded already, or (with `unless_suppressed`, the lookup
/// keys of the artifact's recipients: addresses and domains) a live suppression matches.
pub async fn submit(
    db: impl PgExecutor<'_>,
    new: &NewDelivery<'_>,
    job: &airlock_queue::NewJob,
    recipients: &[String],
    unless_suppressed: Option<(&[String], &[String])>,
) -> Result<Option<Delivery>, sqlx::Error> {
    let NewDelivery { id, run_id, step_id, agent, artifact, idempotency_key, actor } = *new;
    let sha = artifact.sha256_hex();
    let size = artifact.canonical_bytes().len() as i32;
    let class = match artifact.channel() {
        Channel::Email => EffectClass::NonRepeatable,
        Channel::Webhook => EffectClass::Idempotent,
    };
    let actor = actor.label();
    let reason = "submitted";
    let data = serde_json::json!({"artifact_sha256": sha});
    let first = EventContent {
        delivery_id: id,
        seq: 1,
        from: None,
        to: DeliveryState::Persisted,
        actor: &actor,
        reason: Some(reason),
        data: &data,
    };
    let hash = event_hash(None, &first);
    // The delivery is a step of its run's replay log, spending one step of its budget.
    let step_data = serde_json::json!({"delivery_id": id, "channel": artifact.channel(), "artifact_sha256": sha});
    let mut qb = airlock_queue::piece::Builder::new("WITH ");
    if let Some((addresses, domains)) = unless_suppressed {
        // The suppressions read of `matching_suppressions`, in the same statement.
        qb.push(
            "blocked AS (SELECT 1 FROM suppressions WHERE lifted_at IS NULL AND ((kind = 'address' AND value = ANY (",
        );
        qb.push_bind(addresses.to_vec()).push(")) OR (kind = 'domain' AND value = ANY (");
        qb.push_bind(domains.to_vec()).push("))) LIMIT 1), ");
    }
    airlock_runs::piece::spend_and_record(
        &mut qb,
        run_id,
        agent,
        step_id,
        airlock_runs::steps::StepKind::Delivery,
        &step_data,
        unless_suppressed.map(|_| "blocked"),
    );
    qb.push(", artifact AS (INSERT INTO artifacts (sha256, body, size_bytes) SELECT ");
    qb.push_bind(sha.clone()).push(", ").push_bind(artifact.to_json()).push(", ").push_bind(size);
    qb.push(" FROM step ON CONFLICT (sha256) DO NOTHING), delivery AS (INSERT INTO deliveries (id, run_id, step_id, agent, channel, idempotency_key, artifact_sha256, submitted_sha256, effect_class, event_hash) SELECT ");
    qb.push_bind(id).push(", ").push_bind(run_id).push(", ").push_bind(step_id.to_string()).push(", ");
    qb.push_bind(agent.to_string()).push(", ").push_bind(artifact.channel()).push(", ");
    qb.push_bind(idempotency_key.to_string()).push(", ").push_bind(sha.clone()).push(", ").push_bind(sha);
    qb.push(", ").push_bind(class).push(", ").push_bind(hash.clone());
    qb.push(" FROM step RETURNING *), event AS (INSERT INTO delivery_events (delivery_id, seq, from_state, to_state, actor, reason, data, prev_hash, hash) SELECT id, 1, NULL, 'persisted', ");
    qb.push_bind(actor).push(", ").push_bind(reason).push(", ").push_bind(data).push(", NULL, ").push_bind(hash);
    qb.push(" FROM delivery), ");
    if !recipients.is_empty() {
        // An email's recipients (lowercase, without repeats), for the per-recipient limit.
        qb.push("recipients AS (INSERT INTO delivery_recipients (delivery_id, address, created_at) SELECT delivery.id, a, delivery.created_at FROM delivery, unnest(");
        qb.push_bind(recipients.to_vec()).push("::text[]) AS a ON CONFLICT DO NOTHING), ");
    }
    // The scoring job: its unique key names this new delivery, so no live job holds it.
    airlock_queue::piece::enqueue_if(&mut qb, "job", std::slice::from_ref(job), "delivery");
    qb.push(" SELECT * FROM delivery");
    match qb.build_query_as().fetch_optional(db).await {
        Err(e) if is_step_taken(&e) => Ok(None),
        other => other,
    }
}

/// The error of inserting a delivery for a run's step that has one already.
fn is_step_taken(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.constraint()).is_some_and(|c| c == "deliveries_run_step_key")
        || airlock_runs::piece::is_step_taken(e)
}

pub async fn get(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Option<Delivery>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM deliveries WHERE id = $1").bind(id).fetch_optional(db).await
}

/// Reads a delivery and locks it for the rest of the transaction.
pub async fn lock(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Delivery, DeliveryError> {
    sqlx::query_as("SELECT * FROM deliveries WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(DeliveryError::NotFound(id))
}

/// Reads a delivery with its artifact's body, and locks it for the rest of the transaction.
pub async fn lock_with_artifact(
    db: impl PgExecutor<'_>,
    id: DeliveryId,
) -> Result<(Delivery, serde_json::Value), DeliveryError> {
    lock_many_with_artifact(db, &[id]).await?.pop().ok_or(DeliveryError::NotFound(id))
}

/// [`lock_with_artifact`] for several deliveries at once, locked in id order (so two such
/// statements over overlapping deliveries cannot deadlock); those that do not exist are
/// left out.
pub async fn lock_many_with_artifact(
    db: impl PgExecutor<'_>,
    ids: &[DeliveryId],
) -> Result<Vec<(Delivery, serde_json::Value)>, sqlx::Error> {
    #[derive(FromRow)]
    struct Row {
        #[sqlx(flatten)]
        delivery: Delivery,
        artifact_body: serde_json::Value,
    }
    let rows: Vec<Row> = sqlx::query_as(
        r#"SELECT d.*, a.body AS artifact_body FROM deliveries d JOIN artifacts a ON a.sha256 = d.artifact_sha256
           WHERE d.id = ANY ($1) ORDER BY d.id FOR UPDATE OF d"#,
    )
    .bind(ids)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|r| (r.delivery, r.artifact_body)).collect())
}

/// What transaction A of a send reads, in one statement.
#[derive(Debug, FromRow)]
pub struct ForSend {
    /// The send switch, read under a share lock (see [`send_enabled_locked`]).
    pub send_enabled: bool,
    /// The delivery, locked for the rest of the transaction.
    #[sqlx(flatten)]
    pub delivery: Delivery,
    pub artifact_body: serde_json::Value,
    /// The artifact hash of the latest approval, if any.
    pub approved_sha256: Option<String>,
}

/// Reads the send switch (share lock), the delivery (row lock), its artifact and its
/// latest approval; `None` when there is no such delivery.
pub async fn read_for_send(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Option<ForSend>, sqlx::Error> {
    Ok(read_for_send_many(db, &[id]).await?.pop())
}

/// [`read_for_send`] for several deliveries, locked in id order; those that do not exist
/// are left out.
pub async fn read_for_send_many(db: impl PgExecutor<'_>, ids: &[DeliveryId]) -> Result<Vec<ForSend>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT s.send_enabled, d.*, a.body AS artifact_body,
                  (SELECT p.artifact_sha256 FROM approvals p WHERE p.delivery_id = d.id
                   ORDER BY p.created_at DESC, p.id DESC LIMIT 1) AS approved_sha256
           FROM settings s CROSS JOIN deliveries d JOIN artifacts a ON a.sha256 = d.artifact_sha256
           WHERE s.id = 1 AND d.id = ANY ($1)
           ORDER BY d.id
           FOR SHARE OF s FOR UPDATE OF d"#,
    )
    .bind(ids)
    .fetch_all(db)
    .await
}

/// What a list row shows of a delivery besides its own columns: the email's subject or
/// the webhook's URL, and the value of its latest score.
#[derive(Debug, Clone, FromRow)]
pub struct Listed {
    #[sqlx(flatten)]
    pub delivery: Delivery,
    pub subject: Option<String>,
    pub url: Option<String>,
    pub score: Option<f64>,
}

/// Lists deliveries oldest first, optionally in some states, after a cursor
/// `(created_at, id)`, each with what its list row shows, in one statement. In one state
/// (a review queue) the page is a range of `deliveries_state_idx` from the cursor on: no
/// sort, and nothing read of the deliveries before the cursor or in other states, however
/// many there are; then each row of the page finds its artifact and its latest score by
/// their indexes. Each shape of the filter is its own statement, so that a kept generic
/// plan serves it as well as a fresh one.
pub async fn list(
    db: impl PgExecutor<'_>,
    states: &[DeliveryState],
    after: Option<(DateTime<Utc>, DeliveryId)>,
    limit: i64,
) -> Result<Vec<Listed>, sqlx::Error> {
    list_statement(states, after, limit).build_query_as().fetch_all(db).await
}

/// The statement of [`list`] (its text is what a plan test prepares).
pub fn list_statement(
    states: &[DeliveryState],
    after: Option<(DateTime<Utc>, DeliveryId)>,
    limit: i64,
) -> sqlx::QueryBuilder<sqlx::Postgres> {
    let mut qb = sqlx::QueryBuilder::new(
        "SELECT d.*, a.body->'email'->>'subject' AS subject, a.body->'webhook'->>'url' AS url,
                (SELECT s.value FROM scores s WHERE s.delivery_id = d.id
                 ORDER BY s.created_at DESC, s.id DESC LIMIT 1) AS score
         FROM (SELECT * FROM deliveries WHERE true",
    );
    match states {
        [] => {}
        [one] => {
            qb.push(" AND state = ").push_bind(*one);
        }
        many => {
            qb.push(" AND state = ANY (").push_bind(many.to_vec()).push(")");
        }
    }
    if let Some((at, id)) = after {
        qb.push(" AND (created_at, id) > (").push_bind(at).push(", ").push_bind(id).push(")");
    }
    // The limit is written into the statement, not bound, so that the plan a connection
    // keeps for it (the generic one, after five executions) knows the page is short. With
    // the limit a parameter, that plan assumed a tenth of the state's rows and joined them
    // to every artifact (a hash join over a month of history: 640 ms), so Postgres planned
    // every read afresh instead. Clients page with a few sizes (at most 1,000), and each
    // connection's statement cache is bounded.
    qb.push(" ORDER BY created_at, id LIMIT ").push(limit);
    // The page's order is kept through the lateral lookups (a nested loop over the page).
    qb.push(
        ") d LEFT JOIN LATERAL (SELECT body FROM artifacts WHERE sha256 = d.artifact_sha256) a ON true
         ORDER BY d.created_at, d.id",
    );
    qb
}

/// Points a delivery at a new artifact version (a reviewer's edit).
pub async fn set_artifact(db: impl PgExecutor<'_>, delivery_id: DeliveryId, sha: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE deliveries SET artifact_sha256 = $2, updated_at = now() WHERE id = $1")
        .bind(delivery_id)
        .bind(sha)
        .execute(db)
        .await?;
    Ok(())
}

/// The artifacts of those of `ids` still `persisted`, unlocked: what a judge reads before
/// the scoring transaction. Each comes with its hash, so a verdict is tied to the version
/// it read.
pub async fn persisted_artifacts(
    db: impl PgExecutor<'_>,
    ids: &[DeliveryId],
) -> Result<Vec<(DeliveryId, String, serde_json::Value)>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT d.id, d.artifact_sha256, a.body FROM deliveries d JOIN artifacts a ON a.sha256 = d.artifact_sha256
           WHERE d.id = ANY ($1) AND d.state = 'persisted' ORDER BY d.id"#,
    )
    .bind(ids)
    .fetch_all(db)
    .await
}
