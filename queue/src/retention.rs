//! Retention: completed and cancelled jobs are deleted after a configurable age.

use std::time::Duration;

use sqlx::PgExecutor;

use crate::job::QueueError;

/// Deletes at most `batch` completed or cancelled jobs that finished more than `age` ago.
/// Returns how many were deleted; call again while it returns `batch`.
pub async fn prune_finished(db: impl PgExecutor<'_>, age: Duration, batch: i64) -> Result<u64, QueueError> {
    let r = sqlx::query(
        r#"DELETE FROM jobs WHERE id IN (
               SELECT id FROM jobs
               WHERE state IN ('completed', 'cancelled') AND finished_at < now() - make_interval(secs => $1)
               ORDER BY finished_at
               LIMIT $2
               FOR UPDATE SKIP LOCKED)"#,
    )
    .bind(age.as_secs_f64())
    .bind(batch)
    .execute(db)
    .await?;
    Ok(r.rows_affected())
}
