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

/// One pass of the rescuer over at most `limit` jobs whose lease expired, in the caller's
/// transaction (so the caller can update the rows the jobs serve before it commits).
/// Several workers may run it at once: SKIP LOCKED gives each its own rows.
#[tracing::instrument(skip_all)]
pub async fn rescue_expired(tx: &mut Transaction<'_, Postgres>, limit: i64) -> Result<Vec<Rescued>, QueueError> {
    let rows: Vec<(JobId, bool)> = sqlx::query_as(
        r#"
        WITH expired AS (
            SELECT id, effect_started_at IS NOT NULL AS effect_started FROM jobs
            WHERE lease_owner IS NOT NULL AND state = 'running' AND lease_expires_at < now()
            ORDER BY lease_expires_at
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs j SET
            state = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN 'parked'::job_state
                WHEN j.attempt >= j.max_attempts THEN 'failed'::job_state
                ELSE 'available'::job_state END,
            finished_at = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN NULL
                WHEN j.attempt >= j.max_attempts THEN now() END,
            run_at = CASE
                WHEN j.effect_class <> 'non_repeatable' OR NOT e.effect_started THEN now() + airlock_backoff(j.attempt)
                ELSE j.run_at END,
            effect_started_at = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started THEN j.effect_started_at END,
            last_error = CASE
                WHEN j.effect_class = 'non_repeatable' AND e.effect_started
                    THEN 'lease expired after the effect may have started: parked for a human'
                ELSE 'lease expired' END,
            lease_owner = NULL, lease_expires_at = NULL
        FROM expired e WHERE j.id = e.id
        RETURNING j.id, e.effect_started
        "#,
    )
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
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
