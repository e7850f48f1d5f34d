//! Diagnostic job kinds, registered only with `worker.diagnostic_jobs = true`: they let an
//! operator (or a crash suite) check a fleet end to end without touching the outside world.
//!
//! - `diag.sleep` `{"ms": N}`: a pure job that waits N ms, then completes.
//! - `diag.effect` `{"ms": N}`: a job that commits "effect started" (as a send does), waits
//!   N ms as if the effect were in flight, then completes.

use std::time::Duration;

use airlock_queue as queue;

use crate::handler::{HandlerError, JobContext, Outcome, Registry};

fn wait_ms(ctx: &JobContext) -> Duration {
    Duration::from_millis(ctx.job.payload.get("ms").and_then(|v| v.as_u64()).unwrap_or(0).min(600_000))
}

pub fn register(registry: &mut Registry) {
    registry.register_fn("diag.sleep", |ctx: JobContext| async move {
        // A zero wait must not go through the timer: its one-millisecond resolution would
        // turn a no-op job into a 1 ms job.
        let wait = wait_ms(&ctx);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(Outcome::Completed)
    });
    registry.register_fn("diag.effect", |ctx: JobContext| async move {
        let mut tx = ctx.pool.begin().await.map_err(|e| HandlerError::retry(e.to_string()))?;
        queue::mark_effect_started(&mut *tx, ctx.lease()).await.map_err(|e| HandlerError::retry(e.to_string()))?;
        tx.commit().await.map_err(|e| HandlerError::retry(e.to_string()))?;
        tokio::time::sleep(wait_ms(&ctx)).await;
        Ok(Outcome::Completed)
    });
}
