//! Jobs: the row, its states, what repeating its effect would do, and what a new one says.
//!
//! [`JobState`] mirrors the Postgres enum `job_state`; [`next`] is the one table of legal
//! moves, and every statement of this crate that moves a job guards on the states the table
//! allows (a test drives each move against the real statements).

use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::ids::JobId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::FromRow;

use crate::lease::Lease;

/// Default queue for jobs that do not name one.
pub const DEFAULT_QUEUE: &str = "default";

/// The types of the schema that the queue's statements read or write (see
/// `airlock_core::db::queue_plans`).
pub const QUEUE_TYPES: [&str; 2] = ["job_state", "effect_class"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "job_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Available,
    Running,
    Completed,
    Failed,
    Parked,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 6] = [
        JobState::Available,
        JobState::Running,
        JobState::Completed,
        JobState::Failed,
        JobState::Parked,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Available => "available",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Parked => "parked",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// What moves a job, and who: a worker claims it; its holder (under the lease) completes,
/// retries (a retryable failure, a snooze, a release), fails or parks it; the rescuer
/// retries, fails or parks it once the lease has expired; an operator or the job's owner
/// cancels it or retries it now; a human settles a parked one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobAction {
    Claim,
    Complete,
    Retry,
    Fail,
    Park,
    Cancel,
    RetryNow,
    /// A human found the parked job's effect done.
    Settle,
}

impl JobAction {
    pub const ALL: [JobAction; 8] = [
        JobAction::Claim,
        JobAction::Complete,
        JobAction::Retry,
        JobAction::Fail,
        JobAction::Park,
        JobAction::Cancel,
        JobAction::RetryNow,
        JobAction::Settle,
    ];
}

/// The one table of a job's legal moves: the state `action` takes a job in `from` to.
/// `parked` is not terminal: it waits for a human.
pub fn next(from: JobState, action: JobAction) -> Option<JobState> {
    use JobAction as A;
    use JobState as S;
    match (from, action) {
        (S::Available, A::Claim) => Some(S::Running),
        (S::Running, A::Complete) => Some(S::Completed),
        (S::Running, A::Retry) => Some(S::Available),
        (S::Running, A::Fail) => Some(S::Failed),
        (S::Running, A::Park) => Some(S::Parked),
        (S::Available | S::Parked, A::Cancel) => Some(S::Cancelled),
        (S::Parked | S::Failed, A::RetryNow) => Some(S::Available),
        (S::Parked, A::Settle) => Some(S::Completed),
        _ => None,
    }
}

/// What repeating a job's effect would do to the outside world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "effect_class", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum EffectClass {
    /// No external effect: safe to run again.
    Pure,
    /// Safe to repeat with the same idempotency key.
    Idempotent,
    /// Never repeated without a human.
    NonRepeatable,
}

/// A job row.
#[derive(Debug, Clone, FromRow, Serialize)]
pub struct Job {
    pub id: JobId,
    pub kind: String,
    pub queue: String,
    pub payload: serde_json::Value,
    pub state: JobState,
    pub priority: i16,
    pub run_at: DateTime<Utc>,
    pub attempt: i32,
    pub max_attempts: i32,
    pub effect_class: EffectClass,
    pub effect_started_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub attempted_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub unique_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The partition of `jobs_live` the job was read in (`jobs_ring_<slot>`, or `jobs_long`
    /// for -1; see `0028_job_ring`), when the statement that read it said so.
    #[sqlx(default)]
    #[serde(skip)]
    pub slot: Option<i16>,
}

impl Job {
    /// The fencing handle for this claim.
    pub fn lease(&self) -> Lease {
        Lease { id: self.id, attempt: self.attempt, slot: self.slot }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The job is no longer held under this epoch: another holder took it over, or it
    /// was rescued, cancelled or finished. The caller must abandon it without effects.
    #[error("lease lost on job {id} at attempt {attempt}")]
    LeaseLost { id: JobId, attempt: i32 },
    #[error("job {0} not found")]
    NotFound(JobId),
    #[error("job {id} cannot go from {from} by {action}")]
    InvalidTransition { id: JobId, from: &'static str, action: &'static str },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for QueueError {
    fn kind(&self) -> ErrorKind {
        match self {
            QueueError::LeaseLost { .. } | QueueError::InvalidTransition { .. } => ErrorKind::InvalidTransition,
            QueueError::NotFound(_) => ErrorKind::NotFound,
            QueueError::Db(_) => ErrorKind::Internal,
        }
    }
}

impl QueueError {
    pub fn lost(lease: Lease) -> Self {
        QueueError::LeaseLost { id: lease.id, attempt: lease.attempt }
    }
}

/// A job to enqueue.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub kind: String,
    pub queue: String,
    pub payload: serde_json::Value,
    pub priority: i16,
    pub run_at: Option<DateTime<Utc>>,
    pub max_attempts: i32,
    pub effect_class: EffectClass,
    pub unique_key: Option<String>,
}

impl NewJob {
    pub fn new(kind: impl Into<String>, payload: serde_json::Value) -> Self {
        Self {
            kind: kind.into(),
            queue: DEFAULT_QUEUE.into(),
            payload,
            priority: 100,
            run_at: None,
            max_attempts: 10,
            effect_class: EffectClass::Pure,
            unique_key: None,
        }
    }
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = queue.into();
        self
    }
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }
    pub fn effect_class(mut self, class: EffectClass) -> Self {
        self.effect_class = class;
        self
    }
    pub fn unique_key(mut self, key: impl Into<String>) -> Self {
        self.unique_key = Some(key.into());
        self
    }
}

/// The result of enqueueing one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    pub id: JobId,
    /// False when a live job with the same unique key already existed; `id` is that job.
    pub inserted: bool,
}

/// An error text as stored: at most 2,000 characters.
pub(crate) fn truncate_error(e: &str) -> &str {
    match e.char_indices().nth(2000) {
        Some((i, _)) => &e[..i],
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_table() {
        use JobAction as A;
        use JobState as S;
        let expected = [
            (S::Available, A::Claim, S::Running),
            (S::Running, A::Complete, S::Completed),
            (S::Running, A::Retry, S::Available),
            (S::Running, A::Fail, S::Failed),
            (S::Running, A::Park, S::Parked),
            (S::Available, A::Cancel, S::Cancelled),
            (S::Parked, A::Cancel, S::Cancelled),
            (S::Parked, A::RetryNow, S::Available),
            (S::Failed, A::RetryNow, S::Available),
            (S::Parked, A::Settle, S::Completed),
        ];
        for from in S::ALL {
            for action in A::ALL {
                let want = expected.iter().find(|(f, a, _)| *f == from && *a == action).map(|(_, _, to)| *to);
                assert_eq!(next(from, action), want, "{from:?} by {action:?}");
            }
        }
        for s in [S::Completed, S::Cancelled] {
            assert!(A::ALL.iter().all(|a| next(s, *a).is_none()), "{s:?} is final");
        }
        for s in S::ALL {
            assert_eq!(S::parse(s.as_str()), Some(s));
        }
    }
}
