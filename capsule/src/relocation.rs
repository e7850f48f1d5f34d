//! The `relocations` table: one row per move of an agent between nodes (a `capsule.migrate`
//! job), with its phase recorded after every step of the protocol, so that another worker
//! resumes a half-done move. Phases are an enum with one table of legal moves ([`next`]).
//!
//! Phases, in order: `created` → `frozen` (source frozen, checkpoint fixed) → `proposed`
//! (target staging the new epoch) → `transferred` (missing blobs sent) → `prepared` →
//! `activating` (recorded *before* the activate call: the point of no return) →
//! `activated` → `retired` (source retired) → `completed`. Any failure before the point of
//! no return goes `aborting` → `aborted` (target staging discarded, source resumed). The
//! legal moves are [`Phase::can_advance`]. Every phase write by a worker is fenced on the
//! job's lease as well as on the expected phase.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::{FromRow, PgExecutor, Postgres, Transaction};
use uuid::Uuid;

use super::agents::{self, AgentError};
use super::{AgentId, NodeId};
use airlock_core::error::{DomainError, ErrorKind};
use airlock_queue::{self as queue, EffectClass, Lease, NewJob};

/// The job kind that drives a migration.
pub const MIGRATE_JOB: &str = "capsule.migrate";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, sqlx::Type)]
#[sqlx(type_name = "relocation_phase", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Created,
    Frozen,
    Proposed,
    Transferred,
    Prepared,
    Activating,
    Activated,
    Retired,
    Completed,
    Aborting,
    Aborted,
}

impl Phase {
    pub const ALL: [Phase; 11] = [
        Phase::Created,
        Phase::Frozen,
        Phase::Proposed,
        Phase::Transferred,
        Phase::Prepared,
        Phase::Activating,
        Phase::Activated,
        Phase::Retired,
        Phase::Completed,
        Phase::Aborting,
        Phase::Aborted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Created => "created",
            Phase::Frozen => "frozen",
            Phase::Proposed => "proposed",
            Phase::Transferred => "transferred",
            Phase::Prepared => "prepared",
            Phase::Activating => "activating",
            Phase::Activated => "activated",
            Phase::Retired => "retired",
            Phase::Completed => "completed",
            Phase::Aborting => "aborting",
            Phase::Aborted => "aborted",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Completed | Phase::Aborted)
    }

    /// Whether the point of no return has been crossed (the target may hold the agent).
    pub fn past_point_of_no_return(self) -> bool {
        matches!(self, Phase::Activating | Phase::Activated | Phase::Retired | Phase::Completed)
    }

    /// Whether [`next`] has a move from this phase to `to`.
    pub fn can_advance(self, to: Phase) -> bool {
        Step::ALL.iter().any(|step| next(self, *step) == Some(to))
    }
}

/// The steps of the protocol (DESIGN §6), each recorded once done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    Freeze,
    Propose,
    Transfer,
    Prepare,
    /// Recorded *before* the activate call: the point of no return.
    Activate,
    Activated,
    Retire,
    Complete,
    /// Before the point of no return; from `activating` only once the target has answered
    /// that it does not hold the new epoch.
    Abort,
    Aborted,
}

impl Step {
    pub const ALL: [Step; 10] = [
        Step::Freeze,
        Step::Propose,
        Step::Transfer,
        Step::Prepare,
        Step::Activate,
        Step::Activated,
        Step::Retire,
        Step::Complete,
        Step::Abort,
        Step::Aborted,
    ];
}

/// The one table of a relocation's legal moves.
pub fn next(from: Phase, step: Step) -> Option<Phase> {
    use Phase as P;
    use Step as S;
    match (from, step) {
        (P::Created, S::Freeze) => Some(P::Frozen),
        (P::Frozen, S::Propose) => Some(P::Proposed),
        (P::Proposed, S::Transfer) => Some(P::Transferred),
        (P::Transferred, S::Prepare) => Some(P::Prepared),
        (P::Prepared, S::Activate) => Some(P::Activating),
        (P::Activating, S::Activated) => Some(P::Activated),
        (P::Activated, S::Retire) => Some(P::Retired),
        (P::Retired, S::Complete) => Some(P::Completed),
        (P::Created | P::Frozen | P::Proposed | P::Transferred | P::Prepared | P::Activating, S::Abort) => {
            Some(P::Aborting)
        }
        (P::Aborting, S::Aborted) => Some(P::Aborted),
        _ => None,
    }
}

#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Relocation {
    pub id: Uuid,
    pub agent_id: String,
    pub source_node: Option<String>,
    pub target_node: String,
    pub from_epoch: i64,
    pub epoch: i64,
    pub phase: Phase,
    pub manifest_sha256: Option<String>,
    pub blobs_total: i32,
    pub blobs_sent: i32,
    pub blobs_skipped: i32,
    pub bytes_sent: i64,
    pub reason: Option<String>,
    pub requested_by: String,
    pub job_id: Option<Uuid>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl Relocation {
    pub fn agent(&self) -> Result<AgentId, RelocationError> {
        AgentId::parse(&self.agent_id).map_err(|e| RelocationError::Invalid(e.to_string()))
    }

    /// `completed`, `aborted`, or `None` while it runs.
    pub fn outcome(&self) -> Option<&'static str> {
        match self.phase {
            Phase::Completed => Some("completed"),
            Phase::Aborted => Some("aborted"),
            _ => None,
        }
    }
}

/// One entry of a migration's history.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct PhaseEvent {
    pub phase: Phase,
    pub at: DateTime<Utc>,
    pub worker: Option<String>,
    pub detail: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum RelocationError {
    #[error("migration {0} not found")]
    NotFound(Uuid),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("migration {id} cannot go from {from} to {to}")]
    IllegalMove { id: Uuid, from: &'static str, to: &'static str },
    /// The phase moved on, or the job's lease was lost: the caller must stop.
    #[error("migration {id} is no longer at {expected} under this lease")]
    Fenced { id: Uuid, expected: &'static str },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for RelocationError {
    fn kind(&self) -> ErrorKind {
        match self {
            RelocationError::NotFound(_) | RelocationError::Agent(AgentError::NotFound(_)) => ErrorKind::NotFound,
            RelocationError::Invalid(_) => ErrorKind::Validation,
            RelocationError::Db(_) | RelocationError::Agent(AgentError::Db(_)) => ErrorKind::Internal,
            RelocationError::Queue(q) => q.kind(),
            RelocationError::Agent(AgentError::InvalidTransition(_))
            | RelocationError::IllegalMove { .. }
            | RelocationError::Fenced { .. } => ErrorKind::InvalidTransition,
        }
    }
}

/// Creates a migration of `agent` to `target` and enqueues its job, in the caller's
/// transaction: takes the agent (`migrating`) and allocates its fresh epoch.
pub async fn create(
    tx: &mut Transaction<'_, Postgres>,
    agent: &AgentId,
    target: &NodeId,
    requested_by: &str,
    max_attempts: i32,
) -> Result<Relocation, RelocationError> {
    let a = agents::get(&mut **tx, agent).await?.ok_or_else(|| AgentError::NotFound(agent.to_string()))?;
    if a.holder.as_deref() == Some(target.as_str()) {
        return Err(AgentError::InvalidTransition(format!("agent {agent} already runs on {target}")).into());
    }
    let a = agents::begin_migration(&mut **tx, agent).await?;
    let id = Uuid::now_v7();
    let job = NewJob::new(MIGRATE_JOB, json!({"migration_id": id}))
        .effect_class(EffectClass::Idempotent)
        .max_attempts(max_attempts)
        .unique_key(format!("{MIGRATE_JOB}:{agent}"));
    let enq = queue::enqueue(tx, &job).await?;
    if !enq.inserted {
        return Err(AgentError::InvalidTransition(format!("a migration job of agent {agent} is still live")).into());
    }
    let m: Relocation = sqlx::query_as(
        r#"INSERT INTO relocations (id, agent_id, source_node, target_node, from_epoch, epoch, requested_by, job_id)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING *"#,
    )
    .bind(id)
    .bind(agent.as_str())
    .bind(a.holder.as_deref())
    .bind(target.as_str())
    .bind(a.epoch)
    .bind(a.max_epoch)
    .bind(requested_by)
    .bind(enq.id)
    .fetch_one(&mut **tx)
    .await?;
    record_event(&mut **tx, id, Phase::Created, None, json!({"target": target.as_str(), "epoch": a.max_epoch})).await?;
    Ok(m)
}

pub async fn get(db: impl PgExecutor<'_>, id: Uuid) -> Result<Option<Relocation>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM relocations WHERE id = $1").bind(id).fetch_optional(db).await
}

pub async fn history(db: impl PgExecutor<'_>, id: Uuid) -> Result<Vec<PhaseEvent>, sqlx::Error> {
    sqlx::query_as("SELECT phase, at, worker, detail FROM relocation_events WHERE relocation_id = $1 ORDER BY id")
        .bind(id)
        .fetch_all(db)
        .await
}

async fn record_event(
    db: impl PgExecutor<'_>,
    id: Uuid,
    phase: Phase,
    worker: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO relocation_events (relocation_id, phase, worker, detail) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(phase)
        .bind(worker)
        .bind(detail)
        .execute(db)
        .await?;
    Ok(())
}

/// What a phase change also records.
#[derive(Debug, Clone, Default)]
pub struct Changes {
    pub manifest_sha256: Option<String>,
    /// `(total, sent, skipped, bytes)`
    pub blobs: Option<(i32, i32, i32, i64)>,
    pub reason: Option<String>,
}

/// Moves a migration from `from` to `to`, fenced on the phase and on the job's lease, and
/// appends the history entry, in one transaction.
#[allow(clippy::too_many_arguments)]
pub async fn advance(
    tx: &mut Transaction<'_, Postgres>,
    lease: Lease,
    id: Uuid,
    from: Phase,
    to: Phase,
    worker: &str,
    changes: Changes,
    detail: serde_json::Value,
) -> Result<Relocation, RelocationError> {
    if !from.can_advance(to) {
        return Err(RelocationError::IllegalMove { id, from: from.as_str(), to: to.as_str() });
    }
    let (total, sent, skipped, bytes) = match changes.blobs {
        Some((t, s, k, b)) => (Some(t), Some(s), Some(k), Some(b)),
        None => (None, None, None, None),
    };
    let mut qb = queue::piece::Builder::new("UPDATE relocations SET phase = ");
    qb.push_bind(to).push(", updated_at = now(), finished_at = CASE WHEN ");
    qb.push_bind(to).push("::relocation_phase IN ('completed', 'aborted') THEN now() END, manifest_sha256 = coalesce(");
    qb.push_bind(changes.manifest_sha256).push(", manifest_sha256), blobs_total = coalesce(");
    qb.push_bind(total).push(", blobs_total), blobs_sent = coalesce(");
    qb.push_bind(sent).push(", blobs_sent), blobs_skipped = coalesce(");
    qb.push_bind(skipped).push(", blobs_skipped), bytes_sent = coalesce(");
    qb.push_bind(bytes).push(", bytes_sent), reason = coalesce(");
    qb.push_bind(changes.reason).push(", reason) WHERE id = ");
    qb.push_bind(id).push(" AND phase = ").push_bind(from).push(" AND ");
    queue::piece::push_is_held(&mut qb, lease);
    qb.push(" RETURNING *");
    let m: Option<Relocation> = qb.build_query_as().fetch_optional(&mut **tx).await?;
    let m = m.ok_or(RelocationError::Fenced { id, expected: from.as_str() })?;
    record_event(&mut **tx, id, to, Some(worker), detail).await?;
    Ok(m)
}

/// Notes, without changing the phase, why a migration waits (e.g. a node does not answer
/// after the point of no return); fenced like [`advance`].
pub async fn note_waiting(
    db: impl PgExecutor<'_>,
    lease: Lease,
    id: Uuid,
    phase: Phase,
    reason: &str,
) -> Result<(), RelocationError> {
    let mut qb = queue::piece::Builder::new("UPDATE relocations SET reason = ");
    qb.push_bind(reason.to_string()).push(", updated_at = now() WHERE id = ");
    qb.push_bind(id).push(" AND phase = ").push_bind(phase).push(" AND ");
    queue::piece::push_is_held(&mut qb, lease);
    let r = qb.build().execute(db).await?;
    if r.rows_affected() == 0 {
        return Err(RelocationError::Fenced { id, expected: phase.as_str() });
    }
    Ok(())
}

/// Lists an agent's migrations, newest first.
pub async fn list_for_agent(
    db: impl PgExecutor<'_>,
    agent: &AgentId,
    limit: i64,
) -> Result<Vec<Relocation>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM relocations WHERE agent_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2")
        .bind(agent.as_str())
        .bind(limit)
        .fetch_all(db)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_table() {
        let moves: usize =
            Phase::ALL.iter().map(|p| Step::ALL.iter().filter(|s| next(*p, **s).is_some()).count()).sum();
        assert_eq!(moves, 8 + 6 + 1, "the happy path, six ways to abort, and the end of an abort");
        for p in [Phase::Completed, Phase::Aborted] {
            assert!(Step::ALL.iter().all(|s| next(p, *s).is_none()), "{p:?} is final");
            assert!(p.is_terminal());
        }
    }

    #[test]
    fn legal_moves() {
        use Phase::*;
        let happy = [Created, Frozen, Proposed, Transferred, Prepared, Activating, Activated, Retired, Completed];
        for w in happy.windows(2) {
            assert!(w[0].can_advance(w[1]), "{:?} -> {:?}", w[0], w[1]);
        }
        for p in [Created, Frozen, Proposed, Transferred, Prepared, Activating] {
            assert!(p.can_advance(Aborting));
        }
        for p in [Activated, Retired, Completed, Aborted] {
            assert!(!p.can_advance(Aborting), "no way back after the target confirmed: {p:?}");
        }
        assert!(!Created.can_advance(Activating));
        assert!(!Aborted.can_advance(Created));
        for p in Phase::ALL {
            assert_eq!(Phase::parse(p.as_str()), Some(p));
        }
    }
}
