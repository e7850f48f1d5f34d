//! SQL for deliveries and everything hanging off them.
//!
//! Every state change goes through [`transition`]: a guarded `UPDATE … WHERE state =
//! expected` plus one hash-chained event row, in the caller's transaction. The legal
//! moves come from [`crate::state::next`], nowhere else.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};
use uuid::Uuid;

use crate::artifact::{Artifact, Channel};
use crate::state::{Action, DeliveryState, next};
use airlock_queue::{self as queue, EffectClass, Lease};

/// Who made a change: an agent, a human principal, a worker, or the system itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub kind: &'static str,
    pub id: String,
}

impl Actor {
    pub fn new(kind: &'static str, id: impl Into<String>) -> Self {
        Self { kind, id: id.into() }
    }
    pub fn system(what: &str) -> Self {
        Self::new("system", what)
    }
    /// `kind:id`, as events and receipts show it.
    pub fn label(&self) -> String {
        format!("{}:{}", self.kind, self.id)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("delivery {0} not found")]
    NotFound(Uuid),
    #[error("a delivery in state {from} cannot be {action}")]
    InvalidTransition { from: &'static str, action: &'static str },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Delivery {
    pub id: Uuid,
    pub run_id: Uuid,
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

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Event {
    pub seq: i32,
    #[serde(rename = "from")]
    pub from_state: Option<DeliveryState>,
    #[serde(rename = "to")]
    pub to_state: DeliveryState,
    pub actor: String,
    pub reason: Option<String>,
    pub data: serde_json::Value,
    pub at: DateTime<Utc>,
    #[serde(skip)]
    pub prev_hash: Option<String>,
    #[serde(skip)]
    pub hash: String,
}

/// Stores an artifact (a no-op when the same content is stored already).
pub async fn put_artifact(db: impl PgExecutor<'_>, artifact: &Artifact) -> Result<String, sqlx::Error> {
    let sha = artifact.sha256_hex();
    let bytes = artifact.canonical_bytes();
    sqlx::query("INSERT INTO artifacts (sha256, body, size_bytes) VALUES ($1, $2, $3) ON CONFLICT (sha256) DO NOTHING")
        .bind(&sha)
        .bind(artifact.to_json())
        .bind(bytes.len() as i32)
        .execute(db)
        .await?;
    Ok(sha)
}

pub async fn get_artifact(db: impl PgExecutor<'_>, sha: &str) -> Result<Option<serde_json::Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT body FROM artifacts WHERE sha256 = $1").bind(sha).fetch_optional(db).await
}

/// The delivery for a run's step, if any.
pub async fn find_by_step(
    db: impl PgExecutor<'_>,
    run_id: Uuid,
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
    pub id: Uuid,
    pub run_id: Uuid,
    pub step_id: &'a str,
    pub agent: &'a str,
    pub artifact: &'a Artifact,
    pub idempotency_key: &'a str,
    pub actor: &'a Actor,
}

/// Persists a new delivery in one statement, a transaction of its own: spends one step of
/// the run (which must be `agent`'s and have a step left), stores the artifact unless the
/// same content is stored already, and inserts the delivery in `persisted` with its first
/// event and `job`, its scoring, with no NOTIFY (see [`airlock_queue::Waker`]). Every part
/// or none: a step that has a delivery already fails the delivery's insert, and with it the
/// whole statement, spent step included. `None`: nothing written, because the run is not
/// `agent`'s, or has no step left, or the step has its delivery already.
pub async fn submit(
    db: impl PgExecutor<'_>,
    new: &NewDelivery<'_>,
    job: &queue::NewJob,
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
    // The job's row as `queue::enqueue_many` writes it; its unique key names this new
    // delivery, so no live job can hold it.
    let inserted = sqlx::query_as(
        r#"WITH spent AS (
               UPDATE runs SET used_steps = used_steps + 1, updated_at = now(),
                   state = CASE WHEN max_steps <> 0 AND used_steps + 1 >= max_steps
                                THEN 'budget_exhausted'::run_state ELSE state END
               WHERE id = $2 AND agent = $4 AND (max_steps = 0 OR used_steps < max_steps)
               RETURNING id),
           artifact AS (
               INSERT INTO artifacts (sha256, body, size_bytes) SELECT $7, $9, $10 FROM spent
               ON CONFLICT (sha256) DO NOTHING),
           delivery AS (
               INSERT INTO deliveries (id, run_id, step_id, agent, channel, idempotency_key, artifact_sha256,
                                       submitted_sha256, effect_class, event_hash)
               SELECT $1, $2, $3, $4, $5, $6, $7, $7, $8, $11 FROM spent RETURNING *),
           event AS (
               INSERT INTO delivery_events (delivery_id, seq, from_state, to_state, actor, reason, data, prev_hash, hash)
               SELECT id, 1, NULL, 'persisted', $12, $13, $14, NULL, $11 FROM delivery),
           job AS (
               INSERT INTO jobs (id, kind, queue, payload, priority, run_at, max_attempts, effect_class, unique_key)
               SELECT $15, $16, $17, $18, $19, coalesce($20, now()), $21, $22, $23 FROM delivery)
           SELECT * FROM delivery"#,
    )
    .bind(id)
    .bind(run_id)
    .bind(step_id)
    .bind(agent)
    .bind(artifact.channel())
    .bind(idempotency_key)
    .bind(&sha)
    .bind(class)
    .bind(artifact.to_json())
    .bind(size)
    .bind(&hash)
    .bind(&actor)
    .bind(reason)
    .bind(&data)
    .bind(Uuid::now_v7())
    .bind(&job.kind)
    .bind(&job.queue)
    .bind(&job.payload)
    .bind(job.priority)
    .bind(job.run_at)
    .bind(job.max_attempts)
    .bind(job.effect_class)
    .bind(&job.unique_key)
    .fetch_optional(db)
    .await;
    match inserted {
        Err(e) if is_step_taken(&e) => Ok(None),
        other => other,
    }
}

/// The error of inserting a delivery for a run's step that has one already.
fn is_step_taken(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.constraint())
        .is_some_and(|c| c == "deliveries_run_step_key" || c == "deliveries_idempotency_key_key")
}

pub async fn get(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<Delivery>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM deliveries WHERE id = $1").bind(id).fetch_optional(db).await
}

/// Reads a delivery and locks it for the rest of the transaction.
pub async fn lock(db: impl PgExecutor<'_>, id: Uuid) -> Result<Delivery, DeliveryError> {
    sqlx::query_as("SELECT * FROM deliveries WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or(DeliveryError::NotFound(id))
}

/// Reads a delivery with its artifact's body, and locks it for the rest of the transaction.
pub async fn lock_with_artifact(
    db: impl PgExecutor<'_>,
    id: Uuid,
) -> Result<(Delivery, serde_json::Value), DeliveryError> {
    lock_many_with_artifact(db, &[id]).await?.pop().ok_or(DeliveryError::NotFound(id))
}

/// [`lock_with_artifact`] for several deliveries at once, locked in id order (so two such
/// statements over overlapping deliveries cannot deadlock); those that do not exist are
/// left out.
pub async fn lock_many_with_artifact(
    db: impl PgExecutor<'_>,
    ids: &[Uuid],
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
pub async fn read_for_send(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<ForSend>, sqlx::Error> {
    Ok(read_for_send_many(db, &[id]).await?.pop())
}

/// [`read_for_send`] for several deliveries, locked in id order; those that do not exist
/// are left out.
pub async fn read_for_send_many(db: impl PgExecutor<'_>, ids: &[Uuid]) -> Result<Vec<ForSend>, sqlx::Error> {
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

/// One move of a delivery: the action, who takes it, why, and what its event carries.
#[derive(Debug, Clone)]
pub struct Step<'a> {
    pub action: Action,
    pub actor: &'a Actor,
    pub reason: Option<&'a str>,
    pub data: serde_json::Value,
}

/// Moves a delivery by `action` from the state it was read in, and appends the event;
/// returns the delivery as it now stands. See [`advance`].
pub async fn transition(
    tx: &mut Transaction<'_, Postgres>,
    d: &Delivery,
    action: Action,
    actor: &Actor,
    reason: Option<&str>,
    data: serde_json::Value,
) -> Result<Delivery, DeliveryError> {
    advance(tx, d, &[Step { action, actor, reason, data }]).await
}

/// Moves a delivery through `steps` in order, each a legal move from the state the last
/// one left, with one hash-chained event per step; returns the delivery as it now stands.
/// One statement: the row's update (to the last state, its version counting every step,
/// its head the last event's hash) guarded on the state and version it was read in, and
/// the events' insert. Refuses an illegal move, and a delivery that changed since it was
/// read; either way nothing is written. No steps: nothing to do.
pub async fn advance(
    tx: &mut Transaction<'_, Postgres>,
    d: &Delivery,
    steps: &[Step<'_>],
) -> Result<Delivery, DeliveryError> {
    if steps.is_empty() {
        return Ok(d.clone());
    }
    let mut moved = advance_many(tx, &[(d, steps)]).await?;
    Ok(moved.remove(0))
}

/// [`advance`] for several deliveries in one statement, each through its own steps: all
/// or nothing (an illegal move, or a delivery that changed since it was read, refuses the
/// whole statement and nothing is written). Returns the deliveries as they now stand, in
/// the order given. With several deliveries, lock their rows in id order beforehand (see
/// [`lock_many_with_artifact`]), so that two such statements cannot deadlock.
pub async fn advance_many(
    tx: &mut Transaction<'_, Postgres>,
    moves: &[(&Delivery, &[Step<'_>])],
) -> Result<Vec<Delivery>, DeliveryError> {
    let moves: Vec<_> = moves.iter().filter(|(_, steps)| !steps.is_empty()).collect();
    let mut ev = EventColumns::default();
    let mut rows = RowColumns::default();
    let mut out = Vec::with_capacity(moves.len());
    for (d, steps) in &moves {
        let moved = ev.plan(d, steps)?;
        rows.id.push(d.id);
        rows.from.push(d.state.as_str());
        rows.to.push(moved.state.as_str());
        rows.steps.push(steps.len() as i32);
        rows.head.push(moved.event_hash.clone());
        rows.version.push(d.version);
        out.push(moved);
    }
    if out.is_empty() {
        return Ok(out);
    }
    let changed: i64 = sqlx::query_scalar(
        r#"WITH moved AS (
               UPDATE deliveries d SET state = u.to_state::delivery_state, version = d.version + u.steps,
                                       event_hash = u.head, updated_at = now()
               FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int4[], $5::text[], $6::int4[])
                    AS u (id, from_state, to_state, steps, head, version)
               WHERE d.id = u.id AND d.state = u.from_state::delivery_state AND d.version = u.version
               RETURNING d.id),
           events AS (
               INSERT INTO delivery_events (delivery_id, seq, from_state, to_state, actor, reason, data, prev_hash,
                                            hash)
               SELECT moved.id, e.seq, e.from_state::delivery_state, e.to_state::delivery_state, e.actor, e.reason,
                      e.data, e.prev_hash, e.hash
               FROM unnest($7::uuid[], $8::int4[], $9::text[], $10::text[], $11::text[], $12::text[],
                           $13::jsonb[], $14::text[], $15::text[])
                    AS e (delivery_id, seq, from_state, to_state, actor, reason, data, prev_hash, hash)
               JOIN moved ON moved.id = e.delivery_id)
           SELECT count(*) FROM moved"#,
    )
    .bind(&rows.id)
    .bind(&rows.from)
    .bind(&rows.to)
    .bind(&rows.steps)
    .bind(&rows.head)
    .bind(&rows.version)
    .bind(&ev.delivery)
    .bind(&ev.seq)
    .bind(&ev.from)
    .bind(&ev.to)
    .bind(&ev.actor)
    .bind(&ev.reason)
    .bind(&ev.data)
    .bind(&ev.prev)
    .bind(&ev.hash)
    .fetch_one(&mut **tx)
    .await?;
    if changed != out.len() as i64 {
        // Some delivery changed since it was read: the statement wrote the other moves, and
        // the error keeps the caller's transaction from committing them.
        let (d, steps) = *moves[0];
        return Err(refused(d.state, steps[0].action));
    }
    Ok(out)
}

fn refused(from: DeliveryState, action: Action) -> DeliveryError {
    DeliveryError::InvalidTransition { from: from.as_str(), action: action.as_str() }
}

/// The rows of one [`advance_many`], column by column.
#[derive(Default)]
struct RowColumns {
    id: Vec<Uuid>,
    from: Vec<&'static str>,
    to: Vec<&'static str>,
    steps: Vec<i32>,
    head: Vec<String>,
    version: Vec<i32>,
}

/// The events of one [`advance`] or [`advance_many`], column by column (bound as arrays).
#[derive(Default)]
struct EventColumns<'a> {
    delivery: Vec<Uuid>,
    seq: Vec<i32>,
    from: Vec<&'static str>,
    to: Vec<&'static str>,
    actor: Vec<String>,
    reason: Vec<Option<&'a str>>,
    data: Vec<serde_json::Value>,
    prev: Vec<String>,
    hash: Vec<String>,
}

impl<'a> EventColumns<'a> {
    /// Appends the events of `d` going through `steps` (each a legal move from the state the
    /// last one left, hash-chained from its head); returns the delivery as it will stand.
    fn plan(&mut self, d: &Delivery, steps: &[Step<'a>]) -> Result<Delivery, DeliveryError> {
        let (mut state, mut head) = (d.state, d.event_hash.clone());
        for (i, step) in steps.iter().enumerate() {
            let to = next(state, step.action).ok_or_else(|| refused(state, step.action))?;
            let seq = d.version + 1 + i as i32;
            let actor = step.actor.label();
            let content = EventContent {
                delivery_id: d.id,
                seq,
                from: Some(state),
                to,
                actor: &actor,
                reason: step.reason,
                data: &step.data,
            };
            let hash = event_hash(Some(&head), &content);
            self.delivery.push(d.id);
            self.seq.push(seq);
            self.from.push(state.as_str());
            self.to.push(to.as_str());
            self.actor.push(actor);
            self.reason.push(step.reason);
            self.data.push(step.data.clone());
            self.prev.push(std::mem::replace(&mut head, hash.clone()));
            self.hash.push(hash);
            state = to;
        }
        Ok(Delivery { state, version: d.version + steps.len() as i32, event_hash: head, ..d.clone() })
    }
}

/// What an event's hash covers.
pub struct EventContent<'a> {
    pub delivery_id: Uuid,
    pub seq: i32,
    pub from: Option<DeliveryState>,
    pub to: DeliveryState,
    pub actor: &'a str,
    pub reason: Option<&'a str>,
    pub data: &'a serde_json::Value,
}

/// The hash of one event: sha256 over the previous hash and the event's content.
pub fn event_hash(prev: Option<&str>, e: &EventContent<'_>) -> String {
    let content = serde_json::json!({
        "prev": prev, "delivery": e.delivery_id, "seq": e.seq,
        "from": e.from.map(|s| s.as_str()), "to": e.to.as_str(),
        "actor": e.actor, "reason": e.reason, "data": e.data,
    });
    hex::encode(Sha256::digest(content.to_string().as_bytes()))
}

pub async fn events(db: impl PgExecutor<'_>, id: Uuid) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT seq, from_state, to_state, actor, reason, data, at, prev_hash, hash
           FROM delivery_events WHERE delivery_id = $1 ORDER BY seq"#,
    )
    .bind(id)
    .fetch_all(db)
    .await
}

/// Recomputes a delivery's event chain; returns the first seq that does not verify.
pub fn verify_chain(delivery_id: Uuid, events: &[Event]) -> Option<i32> {
    let mut prev: Option<&str> = None;
    for e in events {
        let content = EventContent {
            delivery_id,
            seq: e.seq,
            from: e.from_state,
            to: e.to_state,
            actor: &e.actor,
            reason: e.reason.as_deref(),
            data: &e.data,
        };
        let expect = event_hash(prev, &content);
        if e.prev_hash.as_deref() != prev || e.hash != expect {
            return Some(e.seq);
        }
        prev = Some(&e.hash);
    }
    None
}

/// Lists deliveries oldest first, optionally in one state, after a cursor `(created_at, id)`.
pub async fn list(
    db: impl PgExecutor<'_>,
    state: Option<DeliveryState>,
    after: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<Delivery>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT * FROM deliveries
           WHERE ($1::delivery_state IS NULL OR state = $1)
             AND ($2::timestamptz IS NULL OR (created_at, id) > ($2, $3))
           ORDER BY created_at, id LIMIT $4"#,
    )
    .bind(state)
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit)
    .fetch_all(db)
    .await
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct ScoreRow {
    pub value: f64,
    pub reasons: serde_json::Value,
    pub scorer: String,
    pub threshold: f64,
    pub artifact_sha256: String,
    pub created_at: DateTime<Utc>,
}

pub async fn insert_score(
    db: impl PgExecutor<'_>,
    delivery_id: Uuid,
    artifact_sha256: &str,
    value: f64,
    reasons: &[String],
    scorer: &str,
    threshold: f64,
) -> Result<(), sqlx::Error> {
    let score = NewScore { delivery_id, artifact_sha256, value, reasons, scorer, threshold };
    insert_scores(db, std::slice::from_ref(&score)).await
}

/// One score to record.
#[derive(Debug, Clone)]
pub struct NewScore<'a> {
    pub delivery_id: Uuid,
    pub artifact_sha256: &'a str,
    pub value: f64,
    pub reasons: &'a [String],
    pub scorer: &'a str,
    pub threshold: f64,
}

/// Records several scores with one statement.
pub async fn insert_scores(db: impl PgExecutor<'_>, scores: &[NewScore<'_>]) -> Result<(), sqlx::Error> {
    if scores.is_empty() {
        return Ok(());
    }
    sqlx::query(
        r#"INSERT INTO scores (id, delivery_id, artifact_sha256, value, reasons, scorer, threshold)
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::float8[], $5::jsonb[], $6::text[],
                                $7::float8[])"#,
    )
    .bind(scores.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.delivery_id).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.artifact_sha256).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.value).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| serde_json::json!(s.reasons)).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.scorer).collect::<Vec<_>>())
    .bind(scores.iter().map(|s| s.threshold).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(())
}

pub async fn latest_score(db: impl PgExecutor<'_>, delivery_id: Uuid) -> Result<Option<ScoreRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT value, reasons, scorer, threshold, artifact_sha256, created_at FROM scores
           WHERE delivery_id = $1 ORDER BY created_at DESC, id DESC LIMIT 1"#,
    )
    .bind(delivery_id)
    .fetch_optional(db)
    .await
}

pub async fn insert_review(
    db: impl PgExecutor<'_>,
    delivery_id: Uuid,
    action: &str,
    reviewer: &str,
    note: Option<&str>,
    from_sha: &str,
    to_sha: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO reviews (id, delivery_id, action, reviewer, note, from_sha256, to_sha256)
           VALUES ($1, $2, $3, $4, $5, $6, $7)"#,
    )
    .bind(Uuid::now_v7())
    .bind(delivery_id)
    .bind(action)
    .bind(reviewer)
    .bind(note)
    .bind(from_sha)
    .bind(to_sha)
    .execute(db)
    .await?;
    Ok(())
}

/// Who produced an artifact version of a delivery by editing it, if anyone did.
pub async fn edited_by(db: impl PgExecutor<'_>, delivery_id: Uuid, sha: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT reviewer FROM reviews WHERE delivery_id = $1 AND action = 'edit' AND to_sha256 = $2
           ORDER BY created_at DESC, id DESC LIMIT 1"#,
    )
    .bind(delivery_id)
    .bind(sha)
    .fetch_optional(db)
    .await
}

/// Points a delivery at a new artifact version (a reviewer's edit).
pub async fn set_artifact(db: impl PgExecutor<'_>, delivery_id: Uuid, sha: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE deliveries SET artifact_sha256 = $2, updated_at = now() WHERE id = $1")
        .bind(delivery_id)
        .bind(sha)
        .execute(db)
        .await?;
    Ok(())
}

pub async fn insert_approval(
    db: impl PgExecutor<'_>,
    delivery_id: Uuid,
    artifact_sha256: &str,
    approver: Option<&str>,
    grant_id: Option<Uuid>,
    note: Option<&str>,
) -> Result<(), sqlx::Error> {
    let approval = NewApproval { delivery_id, artifact_sha256, approver, grant_id, note };
    insert_approvals(db, std::slice::from_ref(&approval)).await
}

/// One approval to record: by a human (`approver`) or a standing grant (`grant_id`).
#[derive(Debug, Clone)]
pub struct NewApproval<'a> {
    pub delivery_id: Uuid,
    pub artifact_sha256: &'a str,
    pub approver: Option<&'a str>,
    pub grant_id: Option<Uuid>,
    pub note: Option<&'a str>,
}

/// Records several approvals with one statement.
pub async fn insert_approvals(db: impl PgExecutor<'_>, approvals: &[NewApproval<'_>]) -> Result<(), sqlx::Error> {
    if approvals.is_empty() {
        return Ok(());
    }
    sqlx::query(
        r#"INSERT INTO approvals (id, delivery_id, artifact_sha256, approver, grant_id, note)
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::uuid[], $6::text[])"#,
    )
    .bind(approvals.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.delivery_id).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.artifact_sha256).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.approver).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.grant_id).collect::<Vec<_>>())
    .bind(approvals.iter().map(|a| a.note).collect::<Vec<_>>())
    .execute(db)
    .await?;
    Ok(())
}

/// Transaction A's writes for a job held under `lease`: marks the job's effect as started
/// (refused once the lease has run out) and records the attempt, in one statement. `None`
/// when the lease is not held; nothing is written then.
pub async fn start_attempt(
    db: impl PgExecutor<'_>,
    delivery_id: Uuid,
    lease: Lease,
    worker: &str,
    artifact_sha256: &str,
) -> Result<Option<Uuid>, sqlx::Error> {
    // One job needs no lock order: the plain fenced form, without the sort of the batch.
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            r#"WITH held AS ({} RETURNING id)
               INSERT INTO send_attempts (id, delivery_id, job_id, lease_attempt, worker, artifact_sha256)
               SELECT $3, $4, held.id, $2, $5, $6 FROM held
               RETURNING id"#,
            queue::MARK_EFFECT_STARTED_SQL
        )
    });
    sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(lease.id)
        .bind(lease.attempt)
        .bind(Uuid::now_v7())
        .bind(delivery_id)
        .bind(worker)
        .bind(artifact_sha256)
        .fetch_optional(db)
        .await
}

/// One attempt to start: the delivery, the lease its send job is held under, the id the
/// attempt gets and the artifact it sends.
#[derive(Debug, Clone)]
pub struct NewAttempt<'a> {
    pub id: Uuid,
    pub delivery_id: Uuid,
    pub lease: Lease,
    pub artifact_sha256: &'a str,
}

/// [`start_attempt`] for several sends in one statement (their jobs locked in id order);
/// returns how many leases held: only those jobs are marked and their attempts recorded.
pub async fn start_attempts(
    db: impl PgExecutor<'_>,
    worker: &str,
    attempts: &[NewAttempt<'_>],
) -> Result<usize, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            r#"WITH held AS ({} RETURNING j.id)
               INSERT INTO send_attempts (id, delivery_id, job_id, lease_attempt, worker, artifact_sha256)
               SELECT t.id, t.delivery_id, t.job_id, t.attempt, $6, t.sha
               FROM unnest($3::uuid[], $4::uuid[], $1::uuid[], $2::int4[], $5::text[])
                    AS t (id, delivery_id, job_id, attempt, sha)
               JOIN held ON held.id = t.job_id
               RETURNING id"#,
            queue::MARK_MANY_EFFECT_STARTED_SQL
        )
    });
    let started: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(attempts.iter().map(|a| a.lease.id).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.lease.attempt).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.id).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.delivery_id).collect::<Vec<_>>())
        .bind(attempts.iter().map(|a| a.artifact_sha256).collect::<Vec<_>>())
        .bind(worker)
        .fetch_all(db)
        .await?;
    Ok(started.len())
}

/// Transaction B's writes after a send that went out: completes the job held under
/// `lease`, records the receipt and closes the attempt, in one statement. False when the
/// lease is not held; nothing is written then.
pub async fn complete_sent(
    db: impl PgExecutor<'_>,
    lease: Lease,
    receipt: &NewReceipt<'_>,
    detail: &str,
) -> Result<bool, sqlx::Error> {
    // One job needs no lock order: the plain fenced form, without the sort of the batch.
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            r#"WITH done AS ({} RETURNING id),
               receipt AS (
                   INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response,
                                         payload_sha256, attempt, worker, attested_by)
                   SELECT $3, $4, $5, $6, $7, $8, $9, $10, $11, $12 FROM done),
               attempt AS (
                   UPDATE send_attempts SET outcome = 'sent', detail = $13, finished_at = now()
                   WHERE id = $5 AND outcome IS NULL AND EXISTS (SELECT FROM done))
               SELECT count(*) FROM done"#,
            queue::COMPLETE_HELD_SQL
        )
    });
    let done: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(lease.id)
        .bind(lease.attempt)
        .bind(Uuid::now_v7())
        .bind(receipt.delivery_id)
        .bind(receipt.attempt_id)
        .bind(receipt.channel)
        .bind(receipt.message_id)
        .bind(receipt.provider_response)
        .bind(receipt.payload_sha256)
        .bind(receipt.attempt)
        .bind(receipt.worker)
        .bind(receipt.attested_by)
        .bind(detail)
        .fetch_one(db)
        .await?;
    Ok(done == 1)
}

/// [`complete_sent`] for several sends in one statement (their jobs locked in id order),
/// each with its receipt and the detail its attempt closes with; returns how many leases
/// held: only those jobs are completed, their receipts recorded and attempts closed.
pub async fn complete_sent_many(
    db: impl PgExecutor<'_>,
    sent: &[(Lease, NewReceipt<'_>, &str)],
) -> Result<usize, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            r#"WITH done AS ({}),
               sent AS (
                   SELECT t.* FROM unnest($1::uuid[], $3::uuid[], $4::uuid[], $5::uuid[], $6::channel[], $7::text[],
                                          $8::text[], $9::text[], $10::int4[], $11::text[], $12::text[], $13::text[])
                        AS t (job_id, id, delivery_id, attempt_id, channel, message_id, provider_response,
                              payload_sha256, attempt, worker, attested_by, detail)
                   JOIN done ON done.id = t.job_id),
               receipt AS (
                   INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response,
                                         payload_sha256, attempt, worker, attested_by)
                   SELECT id, delivery_id, attempt_id, channel, message_id, provider_response, payload_sha256,
                          attempt, worker, attested_by FROM sent),
               attempt AS (
                   UPDATE send_attempts a SET outcome = 'sent', detail = sent.detail, finished_at = now()
                   FROM sent WHERE a.id = sent.attempt_id AND a.outcome IS NULL)
               SELECT count(*) FROM done"#,
            queue::complete_many_sql()
        )
    });
    let done: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(sent.iter().map(|(l, _, _)| l.id).collect::<Vec<_>>())
        .bind(sent.iter().map(|(l, _, _)| l.attempt).collect::<Vec<_>>())
        .bind(sent.iter().map(|_| Uuid::now_v7()).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.delivery_id).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.attempt_id).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.channel).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.message_id).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.provider_response).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.payload_sha256).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.attempt).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.worker).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, r, _)| r.attested_by).collect::<Vec<_>>())
        .bind(sent.iter().map(|(_, _, detail)| *detail).collect::<Vec<_>>())
        .fetch_one(db)
        .await?;
    Ok(done as usize)
}

/// Sets the outcome of an attempt that has none yet.
pub async fn finish_attempt(
    db: impl PgExecutor<'_>,
    attempt_id: Uuid,
    outcome: &str,
    detail: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        r#"UPDATE send_attempts SET outcome = $2, detail = $3, finished_at = now()
           WHERE id = $1 AND outcome IS NULL"#,
    )
    .bind(attempt_id)
    .bind(outcome)
    .bind(detail)
    .execute(db)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Closes every open attempt of a job (the rescuer, after its holder vanished).
pub async fn finish_open_attempts_of_job(
    db: impl PgExecutor<'_>,
    job_id: Uuid,
    outcome: &str,
) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        r#"UPDATE send_attempts SET outcome = $2, detail = 'the worker lost its lease before recording an outcome',
               finished_at = now()
           WHERE job_id = $1 AND outcome IS NULL"#,
    )
    .bind(job_id)
    .bind(outcome)
    .execute(db)
    .await?;
    Ok(r.rows_affected())
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Attempt {
    pub id: Uuid,
    pub job_id: Uuid,
    pub lease_attempt: i32,
    pub worker: String,
    pub artifact_sha256: String,
    pub started_at: DateTime<Utc>,
    pub outcome: Option<String>,
    pub detail: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
}

pub async fn attempts(db: impl PgExecutor<'_>, delivery_id: Uuid) -> Result<Vec<Attempt>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, job_id, lease_attempt, worker, artifact_sha256, started_at, outcome, detail, finished_at
           FROM send_attempts WHERE delivery_id = $1 ORDER BY started_at, id"#,
    )
    .bind(delivery_id)
    .fetch_all(db)
    .await
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Receipt {
    pub channel: Channel,
    pub message_id: Option<String>,
    pub provider_response: Option<String>,
    pub payload_sha256: String,
    pub sent_at: DateTime<Utc>,
    pub attempt: i32,
    pub worker: Option<String>,
    pub attested_by: Option<String>,
}

/// What a receipt records.
#[derive(Debug, Clone)]
pub struct NewReceipt<'a> {
    pub delivery_id: Uuid,
    pub attempt_id: Option<Uuid>,
    pub channel: Channel,
    pub message_id: Option<&'a str>,
    pub provider_response: Option<&'a str>,
    pub payload_sha256: &'a str,
    pub attempt: i32,
    pub worker: Option<&'a str>,
    pub attested_by: Option<&'a str>,
}

pub async fn insert_receipt(db: impl PgExecutor<'_>, r: &NewReceipt<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO receipts (id, delivery_id, attempt_id, channel, message_id, provider_response,
                                 payload_sha256, attempt, worker, attested_by)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"#,
    )
    .bind(Uuid::now_v7())
    .bind(r.delivery_id)
    .bind(r.attempt_id)
    .bind(r.channel)
    .bind(r.message_id)
    .bind(r.provider_response)
    .bind(r.payload_sha256)
    .bind(r.attempt)
    .bind(r.worker)
    .bind(r.attested_by)
    .execute(db)
    .await?;
    Ok(())
}

pub async fn receipt(db: impl PgExecutor<'_>, delivery_id: Uuid) -> Result<Option<Receipt>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT channel, message_id, provider_response, payload_sha256, sent_at, attempt, worker, attested_by
           FROM receipts WHERE delivery_id = $1"#,
    )
    .bind(delivery_id)
    .fetch_optional(db)
    .await
}

/// The global send switch.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct SendSwitch {
    pub enabled: bool,
    pub updated_by: String,
    pub updated_at: DateTime<Utc>,
    pub reason: String,
}

pub async fn send_switch(db: impl PgExecutor<'_>) -> Result<SendSwitch, sqlx::Error> {
    sqlx::query_as("SELECT send_enabled AS enabled, updated_by, updated_at, reason FROM settings WHERE id = 1")
        .fetch_one(db)
        .await
}

/// Reads the switch with a share lock: a flip waits for this transaction, and this
/// transaction sees any flip committed before it.
pub async fn send_enabled_locked(db: impl PgExecutor<'_>) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT send_enabled FROM settings WHERE id = 1 FOR SHARE").fetch_one(db).await
}

pub async fn set_send_switch(
    db: impl PgExecutor<'_>,
    enabled: bool,
    by: &str,
    reason: &str,
) -> Result<SendSwitch, sqlx::Error> {
    sqlx::query_as(
        r#"UPDATE settings SET send_enabled = $1, updated_by = $2, reason = $3, updated_at = now() WHERE id = 1
           RETURNING send_enabled AS enabled, updated_by, updated_at, reason"#,
    )
    .bind(enabled)
    .bind(by)
    .bind(reason)
    .fetch_one(db)
    .await
}
