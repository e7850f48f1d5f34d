//! airlock-queue: the Postgres job queue, and the only code that writes `jobs`.
//!
//! A tour:
//! - [`job`]: the row, its states and their one table of moves, effect classes, new jobs.
//! - [`enqueue`]: enqueueing in the caller's transaction.
//! - [`waker`]: NOTIFY wake-ups, and a [`Waker`] that sends one for many commits.
//! - [`claim`]: the claim statement (`SKIP LOCKED`, bumping the lease epoch).
//! - [`lease`]: the lease handle, the only way to change or finish a claimed job.
//! - [`piece`]: typed parts of other crates' statements that fence on or finish a held job
//!   in the same round trip, so no other crate writes SQL for `jobs`.
//! - [`rescue`]: expired leases, retried, failed or parked.
//! - [`retention`]: pruning finished jobs.
//! - [`ring`]: the slots live jobs lie in, made current in turn and truncated once done with.
//! - [`slotted`]: completions of one held job that name its partition.
//! - [`pauses`]: pausing and resuming named queues.
//! - [`operate`]: what operators do to jobs nobody holds, and what they read.
//! - [`fleet`]: the `workers` table, the processes that hold leases.
//!
//! `jobs` is partitioned (`migrations/0028_job_ring.sql`): live jobs lie in a ring of slots
//! that are truncated in turn (see [`ring`]), finished ones in `jobs_done`, which claims never
//! read. Whoever reads `jobs` reads them all.
//!
//! Invariants:
//! - A claim is one statement (`FOR UPDATE SKIP LOCKED`) that moves rows to `running` and
//!   bumps `attempt`, the lease epoch. No two holders ever share an epoch.
//! - Every later write of a holder names `(id, attempt)` and `state = 'running'`; when it
//!   matches no row the lease was lost and the caller gets [`QueueError::LeaseLost`],
//!   never a silent overwrite.
//! - Lease arithmetic uses the database clock.
//! - Enqueue runs in the caller's transaction, so a job commits with the row it serves,
//!   and sends one NOTIFY per statement (a wake-up hint; polling is the fallback), or
//!   none, leaving the wake-up to a [`Waker`] the caller pokes after its commit.
//! - The rescuer returns expired `pure`/`idempotent` jobs to `available` (with backoff) or
//!   `failed`; a `non_repeatable` job whose effect may have started goes to `parked`.
//! - A job that finishes (completed, failed, cancelled) is deleted from its live partition
//!   and inserted into `jobs_done` by one statement, never updated across partitions (see
//!   `airlock_jobs_complete`); every other move updates it where it is.
//! - A write over held jobs found by their ids (heartbeats, effect marks, completions) runs
//!   in one of the schema's functions (`airlock_jobs_*`), whose plans reach each job by its
//!   primary key whatever the planner believes of the ring's slots.
//! - A unique key is held by at most one live job: whatever makes a job live asks
//!   `airlock_job_key_free`, which holds the key until its transaction ends.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this process's completions delete the job's row instead of keeping it.
static DELETE_COMPLETED: AtomicBool = AtomicBool::new(false);

/// Makes every completion this process makes delete the job's row (`true`), as a queue
/// that keeps no finished work does, instead of keeping it `completed` until retention
/// prunes it (`false`, the default). Failed, parked and cancelled jobs are kept either way.
/// A worker sets it once, at start, from `retention.delete_completed_jobs`: every
/// statement of this crate that completes a job reads it.
pub fn set_delete_completed(on: bool) {
    DELETE_COMPLETED.store(on, Ordering::Relaxed);
}

/// Whether completions delete the job's row (see [`set_delete_completed`]).
pub fn deletes_completed() -> bool {
    DELETE_COMPLETED.load(Ordering::Relaxed)
}

/// The columns of `jobs`, in table order: what a statement that moves jobs between its
/// partitions inserts.
macro_rules! job_columns {
    () => {
        "id, kind, queue, payload, state, priority, run_at, attempt, max_attempts, effect_class, \
         effect_started_at, lease_owner, lease_expires_at, heartbeat_at, attempted_at, last_error, unique_key, \
         created_at, finished_at, slot"
    };
}

/// The row a job becomes when it finishes, selected from the row of the live job just
/// deleted: in state `$state`, with `$error` as its last error, its lease and effect mark
/// cleared, finished now.
macro_rules! finished_row {
    ($state:expr, $error:expr) => {
        concat!(
            "id, kind, queue, payload, ",
            $state,
            ", priority, run_at, attempt, max_attempts, effect_class, NULL, NULL, NULL, heartbeat_at, attempted_at, ",
            $error,
            ", unique_key, created_at, now(), slot"
        )
    };
}

pub mod claim;
pub mod enqueue;
pub mod fleet;
pub mod job;
pub mod lease;
pub mod operate;
pub mod pauses;
pub mod piece;
pub mod rescue;
pub mod retention;
pub mod ring;
pub mod slotted;
pub mod waker;

pub use claim::{
    CLAIM_SQL, COMPLETE_AND_CLAIM_SQL, Claim, ClaimFilter, ClaimFrom, Claimed, RING_SLOTS, claim_batch,
    complete_and_claim,
};
pub use enqueue::{enqueue, enqueue_many, enqueue_many_quiet};
pub use job::{DEFAULT_QUEUE, EffectClass, Enqueued, Job, JobAction, JobState, NewJob, QUEUE_TYPES, QueueError, next};
pub use lease::{
    COMPLETE_SQL, ENSURE_HELD_SQL, FailOutcome, HEARTBEAT_SQL, Lease, MARK_EFFECT_STARTED_SQL, complete, complete_many,
    ensure_held, fail, heartbeat, heartbeat_many, mark_effect_started, park, release, snooze,
};
pub use operate::{
    QueueCount, StateCount, cancel, count_by_kind_state, count_by_queue_state, find_live, get, list, retry_now,
    sample_depth, settle_parked,
};
pub use pauses::{PAUSE_NOTIFY_PREFIX, PAUSES_MAX_AGE, Pause, list_pauses, pause_queue, paused_queues, resume_queue};
pub use rescue::{RescueCounts, RescueOutcome, Rescued, rescue_expired};
pub use retention::prune_finished;
pub use waker::{NOTIFY_CHANNEL, WAKE_SPACING, Waker};
