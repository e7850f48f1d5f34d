//! The queue's ring (see `airlock_queue::ring`): every tick, a pass truncates the slots that
//! are done with, makes the next slot current when the current one is due, and, when no
//! slot is fit for it, empties the oldest one of the live jobs that outlived it.
//!
//! Invariants:
//! - Each truncation is a statement of its own, waiting at most `lock_timeout` for its
//!   slot's lock; a busy slot is left for the next tick.
//! - Live jobs are moved, never dropped: those nobody holds in batches, without the slot's
//!   lock; the running ones last, under it, with the truncation.
//! - A failed pass is logged and tried again at the next tick; it never stops the worker.

use std::time::Duration;

use airlock_queue::QueueError;
use airlock_queue::ring::{self, Recycled};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{next_tick, ticker};

/// How the ring turns (`worker.ring_*`).
#[derive(Debug, Clone, Copy)]
pub struct RingSettings {
    /// How long a slot stays current.
    pub slot_seconds: u64,
    /// The longest a truncation waits for its slot's lock.
    pub lock_timeout: Duration,
    /// Jobs moved per statement when a slot is emptied.
    pub move_batch: i32,
}

impl RingSettings {
    pub fn from_config(w: &airlock_core::config::WorkerConfig) -> Self {
        Self {
            slot_seconds: w.ring_slot_seconds.max(1),
            lock_timeout: Duration::from_millis(w.ring_lock_timeout_ms.max(1)),
            move_batch: w.ring_move_batch.max(1),
        }
    }

    /// How often a pass runs: a quarter of a slot's time, between 100 ms and a second, so a
    /// slot left behind is truncated soon after its last job ends.
    pub fn tick(&self) -> Duration {
        Duration::from_millis((self.slot_seconds * 250).clamp(100, 1000))
    }
}

impl Default for RingSettings {
    /// The configuration's defaults.
    fn default() -> Self {
        Self::from_config(&airlock_core::config::WorkerConfig::default())
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Slots truncated, in order.
    pub truncated: Vec<i16>,
    /// A slot due for truncation whose lock was busy.
    pub busy: Option<i16>,
    /// The slot made current.
    pub switched: Option<i16>,
    /// A slot emptied because no slot was fit to be made current, and the jobs moved out of it.
    pub evacuated: Option<(i16, u64)>,
}

/// One pass (see the module's header), stopping between two statements once `stop` fires.
pub async fn run_once(pool: &PgPool, s: &RingSettings, stop: &CancellationToken) -> Result<Pass, QueueError> {
    let mut pass = Pass::default();
    truncate_done(pool, s, stop, &mut pass).await?;
    let Some(switch) = ring::switch(pool, s.slot_seconds).await? else { return Ok(pass) };
    pass.switched = switch.switched;
    if switch.switched.is_some() {
        // The slot just left goes at once if every job in it is done.
        truncate_done(pool, s, stop, &mut pass).await?;
        return Ok(pass);
    }
    if !switch.due || stop.is_cancelled() {
        return Ok(pass);
    }
    // Due, and every other slot still holds live jobs: the oldest one's move out.
    let Some(slot) = ring::oldest(pool).await? else { return Ok(pass) };
    let mut moved = 0;
    loop {
        let n = ring::evacuate(pool, slot, s.move_batch).await?;
        moved += n;
        if n < s.move_batch as u64 || stop.is_cancelled() {
            break;
        }
    }
    match ring::recycle(pool, s.lock_timeout, Some(slot)).await? {
        Some(Recycled { truncated: true, moved: m, .. }) => {
            moved += m.max(0) as u64;
            pass.truncated.push(slot);
            tracing::info!(slot, moved, "ring slot emptied of the live jobs that outlived it");
            pass.switched = ring::switch(pool, s.slot_seconds).await?.and_then(|s| s.switched);
        }
        Some(_) => pass.busy = Some(slot),
        None => {}
    }
    pass.evacuated = Some((slot, moved));
    Ok(pass)
}

/// Truncates every slot done with, one statement each, until none is left or one is busy
/// (and no more times than the ring could need, should jobs keep arriving in old slots).
async fn truncate_done(
    pool: &PgPool,
    s: &RingSettings,
    stop: &CancellationToken,
    pass: &mut Pass,
) -> Result<(), QueueError> {
    for _ in 0..16 {
        if stop.is_cancelled() {
            break;
        }
        match ring::recycle(pool, s.lock_timeout, None).await? {
            Some(r) if r.truncated => pass.truncated.push(r.slot),
            Some(r) => {
                pass.busy = Some(r.slot);
                return Ok(());
            }
            None => return Ok(()),
        }
    }
    Ok(())
}

/// Runs a pass every tick until `stop` fires.
pub(super) async fn ring_loop(pool: PgPool, s: RingSettings, stop: CancellationToken) {
    let mut tick = ticker(s.tick());
    while next_tick(&mut tick, &stop).await {
        match run_once(&pool, &s, &stop).await {
            Ok(pass) => {
                if let Some(slot) = pass.busy {
                    tracing::debug!(slot, "ring slot busy; truncation left for the next tick");
                }
            }
            Err(e) => tracing::warn!(error = %e, "queue ring pass failed"),
        }
    }
}
