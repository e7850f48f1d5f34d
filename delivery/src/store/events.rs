//! SQL of `delivery_events` and of every state change: [`transition`] and [`advance`] are a
//! guarded `UPDATE … WHERE state = expected` plus hash-chained event rows, in the caller's
//! transaction. The legal moves come from [`crate::state::next`], nowhere else.

use airlock_core::ids::DeliveryId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};

use crate::actor::Actor;
use crate::state::{Action, DeliveryState, next};
use crate::store::deliveries::{Delivery, DeliveryError};

#[derive(Debug, Clone, FromRow, Serialize, Deserialize)]
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
    id: Vec<DeliveryId>,
    from: Vec<&'static str>,
    to: Vec<&'static str>,
    steps: Vec<i32>,
    head: Vec<String>,
    version: Vec<i32>,
}

/// The events of one [`advance`] or [`advance_many`], column by column (bound as arrays).
#[derive(Default)]
struct EventColumns<'a> {
    delivery: Vec<DeliveryId>,
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
    pub delivery_id: DeliveryId,
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

/// The statement of [`events`]: the events of the delivery `$1`, oldest first.
pub const EVENTS_SQL: &str = r#"SELECT seq, from_state, to_state, actor, reason, data, at, prev_hash, hash
    FROM delivery_events WHERE delivery_id = $1
    UNION ALL
    SELECT seq, from_state, to_state, actor, reason, data, at, prev_hash, hash
    FROM delivery_events_archive WHERE delivery_id = $1
    ORDER BY seq"#;

/// A delivery's events, oldest first, from the hot log or the archive (a delivery's chain
/// lies whole in one of them, see [`crate::store::archive`]).
pub async fn events(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as(EVENTS_SQL).bind(id).fetch_all(db).await
}

/// Recomputes a delivery's event chain; returns the first seq that does not verify.
pub fn verify_chain(delivery_id: DeliveryId, events: &[Event]) -> Option<i32> {
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
