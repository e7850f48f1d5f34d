//! The rescuer: jobs whose lease expired go back to `available` (with backoff) or to
//! `failed`; a `non_repeatable` job whose effect may have started goes to `parked`.

use airlock_core::ids::JobId;
use sqlx::{Postgres, Transaction};

use crate::job::{Job, JobState, QueueError};

/// What the rescuer did with one expired job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RescueOutcome {
    Retried,
    Failed,
    Parked,
}

/// A job the rescuer moved, with its state before the move, so that the owner of the
/// job's kind can update its own rows in the same transaction.
#[derive(Debug, Clone)]
pub struct Rescued {
    pub job: Job,
    pub outcome: RescueOutcome,
    /// Whether the effect may have started under the expired lease.
    pub effect_started: bool,
}

/// Counts from one pass of the rescuer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RescueCounts {
    pub retried: usize,
    pub failed: usize,
    pub parked: usize,
}

/// Takes up to `$1` jobs whose lease expired, oldest lease first (SKIP LOCKED: several
/// rescuers share the work): a `non_repeatable` one whose effect may have started is parked,
/// one with attempts left goes back to `available` after the backoff, the others move to the
/// finished jobs as `failed`. Returns each one's id and whether its effect may have started.
const RESCUE_SQL: &str = concat!(
    r#"
    WITH expired AS (
        SELECT id, effect_started_at IS NOT NULL AS effect_started,
               effect_class = 'non_repeatable' AND effect_started_at IS NOT NULL AS park,
               attempt >= max_attempts AS last
        FROM jobs
        WHERE lease_owner IS NOT NULL AND state = 'running' AND lease_expires_at < now()
        ORDER BY lease_expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ),
    kept AS (
        UPDATE jobs j SET
            state = CASE WHEN e.park THEN 'parked'::job_state ELSE 'available'::job_state END,
            run_at = CASE WHEN e.park THEN j.run_at ELSE now() + airlock_backoff(j.attempt) END,
            effect_started_at = CASE WHEN e.park THEN j.effect_started_at END,
            last_error = CASE WHEN e.park THEN 'lease expired after the effect may have started: parked for a human'
                              ELSE 'lease expired' END,
            lease_owner = NULL, lease_expires_at = NULL
        FROM expired e WHERE j.id = e.id AND (e.park OR NOT e.last) AND j.state = 'running'
        RETURNING j.id, e.effect_started
    ),
    gone AS (
        DELETE FROM jobs j USING expired e WHERE j.id = e.id AND NOT e.park AND e.last AND j.state = 'running'
        RETURNING j.*, e.effect_started
    ),
    failed AS (INSERT INTO jobs_done ("#,
    job_columns!(),
    ") SELECT ",
    finished_row!("'failed'", "'lease expired'"),
    r#" FROM gone RETURNING id)
    SELECT id, effect_started FROM kept UNION ALL SELECT id, effect_started FROM gone
    "#
);

/// One pass of the rescuer over at most `limit` jobs whose lease expired, in the caller's
/// transaction (so the caller can update the rows the jobs serve before it commits).
/// Several workers may run it at once: SKIP LOCKED gives each its own rows.
#[tracing::instrument(skip_all)]
pub async fn rescue_expired(tx: &mut Transaction<'_, Postgres>, limit: i64) -> Result<Vec<Rescued>, QueueError> {
    let rows: Vec<(JobId, bool)> = sqlx::query_as(RESCUE_SQL).bind(limit).fetch_all(&mut **tx).await?;
    let mut out = Vec::with_capacity(rows.len());
    for (id, effect_started) in rows {
        let job: Job = sqlx::query_as("SELECT * FROM jobs WHERE id = $1").bind(id).fetch_one(&mut **tx).await?;
        let outcome = match job.state {
            JobState::Parked => RescueOutcome::Parked,
            JobState::Failed => RescueOutcome::Failed,
            _ => RescueOutcome::Retried,
        };
        out.push(Rescued { job, outcome, effect_started });
    }
    Ok(out)
}

impl RescueCounts {
    pub fn of(rescued: &[Rescued]) -> Self {
        let mut c = RescueCounts::default();
        for r in rescued {
            match r.outcome {
                RescueOutcome::Retried => c.retried += 1,
                RescueOutcome::Failed => c.failed += 1,
                RescueOutcome::Parked => c.parked += 1,
            }
        }
        c
    }
}
