//! The ring: how the live jobs' partitions are reclaimed whatever a long transaction pins.
//!
//! Live jobs (`available`, `running`, `parked`) lie in the partitions of `jobs_live`: a ring of
//! slots (`jobs_ring_0` …), one of which is current (`job_ring`) and receives new jobs, and
//! `jobs_long`, for the live jobs that outlived their slot. A finished job moves to
//! `jobs_done` at once. Every version a claim, heartbeat or completion leaves behind stays in
//! its slot until the slot is truncated, which needs no vacuum and so no xmin horizon: while
//! a transaction pins the horizon, nothing else could remove them. See
//! `migrations/0028_job_ring.sql`.
//!
//! A worker's maintenance, every tick ([`recycle`] then [`switch`]):
//! - truncates each slot that is no longer current once none of its jobs is live;
//! - makes the next slot current when the current one has been so for long enough, if
//!   that slot is fit (truncated, nothing in it since);
//! - when every other slot still holds live jobs then (parked, in a paused queue, running
//!   for long), moves those of the oldest one to `jobs_long` ([`evacuate`], then
//!   [`recycle`] with `evacuate`) so the ring keeps turning.
//!
//! Invariants:
//! - A slot is truncated only under its ACCESS EXCLUSIVE lock, after checking under it that
//!   no job in it is live (or after moving every live one out): no job is ever lost, and no
//!   statement can see a job half moved. The lock waits at most the timeout given; the
//!   queue's other statements wait behind it meanwhile.
//! - Running jobs move only under that lock, so a holder's fenced write never finds its job
//!   gone in the middle of a move: it waits, then finds it in `jobs_long`.
//! - One caller at a time changes the ring (an advisory lock); the others return at once.

use std::time::Duration;

use sqlx::{FromRow, PgExecutor};

use crate::job::QueueError;

/// What one [`recycle`] did to one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromRow)]
pub struct Recycled {
    pub slot: i16,
    /// False: the slot's lock could not be had in time, or a job arrived in it meanwhile.
    pub truncated: bool,
    /// Live jobs moved to `jobs_long` first (with `evacuate` only).
    pub moved: i64,
}

/// Truncates the oldest slot that is no longer current and holds no live job, or, with
/// `evacuate`, that slot once every job still live in it (running ones included) has moved to
/// `jobs_long`; under the slot's lock, waiting at most `lock_timeout` for it. `None`: no slot
/// needs it, or another caller is at it. Runs in a transaction of its own.
#[tracing::instrument(skip_all, fields(evacuate))]
pub async fn recycle(
    db: impl PgExecutor<'_>,
    lock_timeout: Duration,
    evacuate: Option<i16>,
) -> Result<Option<Recycled>, QueueError> {
    Ok(sqlx::query_as("SELECT slot, truncated, moved FROM airlock_job_ring_recycle($1, $2)")
        .bind(millis(lock_timeout))
        .bind(evacuate)
        .fetch_optional(db)
        .await?)
}

/// What one [`switch`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromRow)]
pub struct Switch {
    /// The slot made current.
    pub switched: Option<i16>,
    /// The current slot had been so for `slot_seconds` (with no slot `switched` to, every
    /// other slot still holds live jobs or waits to be truncated).
    pub due: bool,
}

/// Makes the next fit slot current if the current one has been so for `slot_seconds`.
/// `None`: another caller is at it.
#[tracing::instrument(skip_all)]
pub async fn switch(db: impl PgExecutor<'_>, slot_seconds: u64) -> Result<Option<Switch>, QueueError> {
    Ok(sqlx::query_as("SELECT switched, due FROM airlock_job_ring_switch($1)")
        .bind(i32::try_from(slot_seconds).unwrap_or(i32::MAX))
        .fetch_optional(db)
        .await?)
}

/// Moves up to `batch` jobs of `slot` that nobody holds (available or parked; those another
/// statement has locked are passed over) to `jobs_long`; returns how many moved. For a slot
/// that is not current, whose live jobs outlived it.
#[tracing::instrument(skip_all, fields(slot))]
pub async fn evacuate(db: impl PgExecutor<'_>, slot: i16, batch: i32) -> Result<u64, QueueError> {
    let n: i64 =
        sqlx::query_scalar("SELECT airlock_job_ring_evacuate($1, $2)").bind(slot).bind(batch).fetch_one(db).await?;
    Ok(n.max(0) as u64)
}

/// The slot after the current one in ring order: the oldest, which the ring turns to next.
pub async fn oldest(db: impl PgExecutor<'_>) -> Result<Option<i16>, QueueError> {
    Ok(sqlx::query_scalar(
        "SELECT g.slot FROM airlock_job_ring() g, job_ring r WHERE g.slot <> r.current
         ORDER BY g.slot < r.current, g.slot LIMIT 1",
    )
    .fetch_optional(db)
    .await?)
}

/// One slot of the ring as it is now.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize)]
pub struct SlotState {
    pub slot: i16,
    pub current: bool,
    /// Since when it is current.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Its size on disk, indexes included.
    pub bytes: i64,
    /// Fit to be made current: truncated, and nothing in it since.
    pub fit: bool,
    /// A job of it is live.
    pub live: bool,
    /// Row versions in it that no transaction can see any more but that are still there
    /// (the statistics' count, which a truncation resets).
    pub dead: i64,
}

/// Every slot of the ring, in slot order. Reads each slot up to its first live job.
pub async fn state(db: impl PgExecutor<'_>) -> Result<Vec<SlotState>, QueueError> {
    Ok(sqlx::query_as(
        "SELECT s.slot, s.current, s.since, s.bytes, s.fit, s.live, coalesce(t.n_dead_tup, 0) AS dead
         FROM airlock_job_ring_state() s
         JOIN airlock_job_ring() g ON g.slot = s.slot
         LEFT JOIN pg_stat_user_tables t ON t.relid = g.leaf
         ORDER BY s.slot",
    )
    .fetch_all(db)
    .await?)
}

fn millis(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1)
}
