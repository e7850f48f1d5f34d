//! airlock's promises about deliveries — nothing unapproved, nothing twice, nothing
//! unrecorded, nothing lost — checked against the database *and* against what the outside
//! world actually received (the SMTP server's accepted messages, the webhook receiver's
//! requests), after a run has settled.
//!
//! [`check`] is shared by the step-boundary crash matrix, the database-fault and lease
//! suites, and the chaos run, so every scenario is judged by the same rules. It returns the
//! violations as sentences, never panics on a broken invariant, and also counts what it saw
//! for the chaos summary. The rules:
//!
//! 1. *Settled*: every delivery is `sent`, `failed`, `parked`, `rejected` or `cancelled`;
//!    no job is left `available` or `running`; no send attempt is left open.
//! 2. *Receipts*: a delivery is `sent` if and only if it has a receipt; a worker's receipt
//!    names an attempt of that delivery whose outcome is `sent`, under the same lease epoch.
//! 3. *Email, nothing twice*: no Message-ID is accepted twice by the SMTP server.
//! 4. *Email, nothing unrecorded*: every accepted message belongs to a delivery that is
//!    `sent` (whose receipt names that Message-ID) or `parked`; every `sent` email was
//!    accepted exactly once.
//! 5. *Webhook, nothing twice*: every request with an `Idempotency-Key` carries the body of
//!    the delivery that owns the key, and no body arrives under two keys.
//! 6. *Webhook, nothing unrecorded*: every sent webhook was answered 2xx under its key; a
//!    2xx answer belongs to a `sent` delivery, or to one that failed after a worker vanished
//!    mid-call (attempts exhausted: a known limit).
//! 7. *Parked*: a parked delivery has a started attempt whose outcome is unknown
//!    (`ambiguous`, or `lease_expired`), and its send job is parked.
//! 8. *Nothing unapproved*: every attempt sent an artifact hash some approval of that
//!    delivery names.
//! 9. *Audit*: every delivery's event chain verifies and ends in its current state; no
//!    event, recipient row or run step names a delivery or run that does not exist; the
//!    audit log's chain verifies.

use std::collections::{BTreeMap, HashMap, HashSet};

use airlock_delivery::state::DeliveryState;
use airlock_delivery::store::{self, Event};
use serde_json::Value;
use sqlx::{FromRow, PgPool, Row};
use uuid::Uuid;

use crate::smtp::Received;
use crate::webhook::Hit;

/// What [`check`] found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// One sentence per broken rule; empty when every promise held.
    pub violations: Vec<String>,
    /// Deliveries by state.
    pub states: BTreeMap<String, i64>,
    /// Deliveries by channel.
    pub channels: BTreeMap<String, i64>,
    /// Deliveries by channel and state.
    pub by_channel: BTreeMap<(String, String), i64>,
    pub deliveries: i64,
    /// Messages the SMTP server accepted (250 after the payload).
    pub smtp_accepted: usize,
    /// Webhook requests received, and distinct keys answered 2xx.
    pub webhook_requests: usize,
    pub webhook_effects: usize,
    /// Message-IDs accepted more than once, plus webhook bodies that arrived under more
    /// than one key or keys that carried more than one body.
    pub duplicates: usize,
}

impl Report {
    pub fn state(&self, s: DeliveryState) -> i64 {
        self.states.get(s.as_str()).copied().unwrap_or(0)
    }

    /// Panics with every violation, for the suites.
    pub fn assert_clean(&self) {
        assert!(
            self.violations.is_empty(),
            "{} invariant violation(s):\n  {}",
            self.violations.len(),
            self.violations.join("\n  ")
        );
    }
}

#[derive(FromRow)]
struct DeliveryRow {
    id: Uuid,
    state: DeliveryState,
    channel: String,
    idempotency_key: String,
    version: i32,
    event_hash: String,
    body: Value,
}

#[derive(FromRow)]
struct ReceiptRow {
    delivery_id: Uuid,
    attempt_id: Option<Uuid>,
    message_id: Option<String>,
    attempt: i32,
    attested_by: Option<String>,
}

#[derive(FromRow)]
struct AttemptRow {
    id: Uuid,
    delivery_id: Uuid,
    lease_attempt: i32,
    artifact_sha256: String,
    outcome: Option<String>,
}

fn bare(message_id: &str) -> &str {
    message_id.trim().trim_start_matches('<').trim_end_matches('>')
}

/// Checks every rule against the database behind `pool`, the messages an SMTP server
/// accepted and the requests a webhook receiver got. Call it once the run has settled.
pub async fn check(pool: &PgPool, accepted: &[Received], hooks: &[Hit]) -> Result<Report, sqlx::Error> {
    let mut r = Report::default();
    let mut v: Vec<String> = Vec::new();

    let deliveries: Vec<DeliveryRow> = sqlx::query_as(
        r#"SELECT d.id, d.state, d.channel::text AS channel, d.idempotency_key, d.version, d.event_hash, a.body
           FROM deliveries d JOIN artifacts a ON a.sha256 = d.artifact_sha256 ORDER BY d.id"#,
    )
    .fetch_all(pool)
    .await?;
    let receipts: Vec<ReceiptRow> =
        sqlx::query_as("SELECT delivery_id, attempt_id, message_id, attempt, attested_by FROM receipts")
            .fetch_all(pool)
            .await?;
    let attempts: Vec<AttemptRow> = sqlx::query_as(
        "SELECT id, delivery_id, lease_attempt, artifact_sha256, outcome FROM send_attempts ORDER BY started_at, id",
    )
    .fetch_all(pool)
    .await?;
    let approvals: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT delivery_id, artifact_sha256 FROM approvals").fetch_all(pool).await?;
    let send_jobs: HashMap<Uuid, String> = sqlx::query_as::<_, (String, String)>(
        r#"SELECT payload->>'delivery_id', state::text FROM jobs
           WHERE kind = 'delivery.send' AND state IN ('available', 'running', 'parked')"#,
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .filter_map(|(id, state)| Some((Uuid::parse_str(&id).ok()?, state)))
    .collect();
    let live_jobs: Vec<(String, String, i64)> = sqlx::query_as(
        r#"SELECT kind, state::text, count(*) FROM jobs WHERE state IN ('available', 'running')
           GROUP BY kind, state ORDER BY kind, state"#,
    )
    .fetch_all(pool)
    .await?;

    r.deliveries = deliveries.len() as i64;
    let receipt_of: HashMap<Uuid, &ReceiptRow> = receipts.iter().map(|x| (x.delivery_id, x)).collect();
    let mut attempts_of: HashMap<Uuid, Vec<&AttemptRow>> = HashMap::new();
    for a in &attempts {
        attempts_of.entry(a.delivery_id).or_default().push(a);
    }
    let approved: HashSet<(Uuid, &str)> = approvals.iter().map(|(d, s)| (*d, s.as_str())).collect();
    let by_key: HashMap<&str, &DeliveryRow> = deliveries.iter().map(|d| (d.idempotency_key.as_str(), d)).collect();
    let started_unknown = |id: Uuid| {
        attempts_of.get(&id).is_some_and(|list| list.iter().any(|a| a.outcome.as_deref() == Some("lease_expired")))
    };

    // 1. Settled.
    for (kind, state, n) in &live_jobs {
        v.push(format!("{n} {kind} job(s) still {state}"));
    }
    for a in attempts.iter().filter(|a| a.outcome.is_none()) {
        v.push(format!("delivery {}: attempt {} is still open", a.delivery_id, a.id));
    }
    for d in &deliveries {
        *r.states.entry(d.state.as_str().to_string()).or_insert(0) += 1;
        *r.channels.entry(d.channel.clone()).or_insert(0) += 1;
        *r.by_channel.entry((d.channel.clone(), d.state.as_str().to_string())).or_insert(0) += 1;
        if !(d.state.is_terminal() || d.state == DeliveryState::Parked) {
            v.push(format!("delivery {} ({}) is still {}", d.id, d.channel, d.state));
        }
    }

    // 2. Receipts.
    for d in &deliveries {
        match (d.state == DeliveryState::Sent, receipt_of.get(&d.id)) {
            (true, None) => v.push(format!("delivery {} is sent without a receipt", d.id)),
            (false, Some(_)) => v.push(format!("delivery {} has a receipt but is {}", d.id, d.state)),
            _ => {}
        }
    }
    for rc in &receipts {
        if rc.attested_by.is_some() {
            continue;
        }
        let ok = rc.attempt_id.and_then(|aid| attempts.iter().find(|a| a.id == aid)).is_some_and(|a| {
            a.delivery_id == rc.delivery_id && a.outcome.as_deref() == Some("sent") && a.lease_attempt == rc.attempt
        });
        if !ok {
            v.push(format!("delivery {}: the receipt does not name its sent attempt", rc.delivery_id));
        }
    }

    // 3 and 4. Email.
    r.smtp_accepted = accepted.len();
    let mut accepted_count: HashMap<&str, usize> = HashMap::new();
    for m in accepted {
        match m.message_id.as_deref() {
            Some(id) => *accepted_count.entry(bare(id)).or_insert(0) += 1,
            None => v.push("the SMTP server accepted a message without a Message-ID".into()),
        }
    }
    for (id, n) in &accepted_count {
        if *n > 1 {
            r.duplicates += n - 1;
            v.push(format!("Message-ID {id} was accepted {n} times"));
        }
        let key = id.split('@').next().unwrap_or_default();
        match by_key.get(key) {
            None => v.push(format!("Message-ID {id} matches no delivery")),
            Some(d) if d.channel != "email" => v.push(format!("Message-ID {id} names a {} delivery", d.channel)),
            Some(d) => match d.state {
                DeliveryState::Sent => {
                    let named = receipt_of.get(&d.id).and_then(|rc| rc.message_id.as_deref()).map(bare);
                    if named != Some(*id) {
                        v.push(format!("delivery {}: receipt names {named:?}, the server accepted {id}", d.id));
                    }
                }
                DeliveryState::Parked => {}
                other => v.push(format!("Message-ID {id} was accepted but its delivery {} is {other}", d.id)),
            },
        }
    }
    for d in deliveries.iter().filter(|d| d.channel == "email" && d.state == DeliveryState::Sent) {
        let Some(rc) = receipt_of.get(&d.id) else { continue };
        if rc.attested_by.is_some() {
            continue;
        }
        let id = rc.message_id.as_deref().map(bare).unwrap_or_default();
        let n = accepted_count.get(id).copied().unwrap_or(0);
        if n != 1 {
            v.push(format!("delivery {} is sent but its message {id} was accepted {n} times", d.id));
        }
    }

    // 5 and 6. Webhooks.
    r.webhook_requests = hooks.len();
    let mut bodies_of_key: HashMap<&str, HashSet<String>> = HashMap::new();
    let mut keys_of_body: HashMap<String, HashSet<&str>> = HashMap::new();
    let mut answered_2xx: HashSet<&str> = HashSet::new();
    for h in hooks {
        let Some(key) = h.idempotency_key.as_deref() else {
            v.push(format!("a webhook request to {} had no Idempotency-Key", h.path));
            continue;
        };
        let body: Value = serde_json::from_slice(&h.body).unwrap_or(Value::Null);
        let canonical = body.to_string();
        bodies_of_key.entry(key).or_default().insert(canonical.clone());
        keys_of_body.entry(canonical).or_default().insert(key);
        if (200..300).contains(&h.answered) {
            answered_2xx.insert(key);
        }
        match by_key.get(key) {
            None => v.push(format!("webhook key {key} matches no delivery")),
            Some(d) if d.body["webhook"]["body"] != body => {
                v.push(format!("webhook key {key} carried a body that is not delivery {}'s", d.id))
            }
            Some(_) => {}
        }
    }
    for (key, bodies) in &bodies_of_key {
        if bodies.len() > 1 {
            r.duplicates += bodies.len() - 1;
            v.push(format!("webhook key {key} carried {} different bodies", bodies.len()));
        }
    }
    for (body, keys) in &keys_of_body {
        if keys.len() > 1 {
            r.duplicates += keys.len() - 1;
            v.push(format!("webhook body {body} arrived under {} keys", keys.len()));
        }
    }
    r.webhook_effects = answered_2xx.len();
    for key in &answered_2xx {
        if let Some(d) = by_key.get(key) {
            let fine = d.state == DeliveryState::Sent || (d.state == DeliveryState::Failed && started_unknown(d.id));
            if !fine {
                v.push(format!("webhook {key} was answered 2xx but its delivery {} is {}", d.id, d.state));
            }
        }
    }
    for d in deliveries.iter().filter(|d| d.channel == "webhook" && d.state == DeliveryState::Sent) {
        let attested = receipt_of.get(&d.id).is_some_and(|rc| rc.attested_by.is_some());
        if !attested && !answered_2xx.contains(d.idempotency_key.as_str()) {
            v.push(format!("webhook delivery {} is sent but was never answered 2xx", d.id));
        }
    }

    // 7. Parked.
    for d in deliveries.iter().filter(|d| d.state == DeliveryState::Parked) {
        let last = attempts_of.get(&d.id).and_then(|list| list.last());
        match last.and_then(|a| a.outcome.as_deref()) {
            Some("ambiguous" | "lease_expired") => {}
            other => v.push(format!("parked delivery {} has no started attempt of unknown outcome ({other:?})", d.id)),
        }
        if send_jobs.get(&d.id).map(String::as_str) != Some("parked") {
            v.push(format!("parked delivery {} has no parked send job", d.id));
        }
    }

    // 8. Nothing unapproved.
    for a in &attempts {
        if !approved.contains(&(a.delivery_id, a.artifact_sha256.as_str())) {
            v.push(format!("delivery {}: attempt {} sent an artifact nobody approved", a.delivery_id, a.id));
        }
    }

    // 9. Audit: event chains (read in one pass, from the hot log and the archive: a chain
    // lies whole in one of them, and one found in both breaks) and the audit log.
    let rows = sqlx::query(
        r#"SELECT delivery_id, seq, from_state, to_state, actor, reason, data, at, prev_hash, hash
           FROM (SELECT * FROM delivery_events UNION ALL SELECT * FROM delivery_events_archive) e
           ORDER BY delivery_id, seq"#,
    )
    .fetch_all(pool)
    .await?;
    let mut events: HashMap<Uuid, Vec<Event>> = HashMap::new();
    for row in &rows {
        events.entry(row.try_get("delivery_id")?).or_default().push(Event::from_row(row)?);
    }
    for d in &deliveries {
        let chain = events.get(&d.id).map(Vec::as_slice).unwrap_or_default();
        if let Some(seq) = store::verify_chain(d.id.into(), chain) {
            v.push(format!("delivery {}: the event chain breaks at seq {seq}", d.id));
        }
        if chain.last().map(|e| e.to_state) != Some(d.state) {
            v.push(format!("delivery {}: the last event does not end in {}", d.id, d.state));
        }
        if chain.last().map(|e| (e.seq, e.hash.as_str())) != Some((d.version, d.event_hash.as_str())) {
            v.push(format!("delivery {}: its head (version {}) is not its last event", d.id, d.version));
        }
    }
    // The logs' rows name a parent their writers made in the same statement (no foreign
    // key checks it for them): none may name a delivery or a run that does not exist. The
    // events are read above already.
    let known: HashSet<Uuid> = deliveries.iter().map(|d| d.id).collect();
    let stray_events = events.iter().filter(|(id, _)| !known.contains(*id)).map(|(_, chain)| chain.len() as i64).sum();
    let mut orphans: Vec<(String, i64)> = sqlx::query_as(
        r#"SELECT 'delivery_recipients', count(*) FROM delivery_recipients r
               WHERE NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.id = r.delivery_id)
           UNION ALL SELECT 'run_steps', count(*) FROM run_steps s
               WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = s.run_id)"#,
    )
    .fetch_all(pool)
    .await?;
    orphans.push(("delivery_events".into(), stray_events));
    for (table, n) in orphans {
        if n > 0 {
            v.push(format!("{n} rows of {table} name a parent that does not exist"));
        }
    }
    for seal in store::archive::seals(pool).await? {
        if !seal.sound() {
            v.push(format!(
                "archived partition {}: {} broken chains, {} stray events",
                seal.partition, seal.broken, seal.strays
            ));
        }
    }
    if let Some(id) = airlock_core::audit::verify(pool).await? {
        v.push(format!("the audit log's chain breaks at entry {id}"));
    }

    r.violations = v;
    Ok(r)
}
