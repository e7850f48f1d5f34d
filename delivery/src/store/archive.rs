//! The event log's partitions and its archive (`migrations/0027_event_partitions.sql`):
//! `delivery_events` is partitioned by delivery id (UUID v7, so by creation period);
//! partitions are made ahead of the writers, and a finished period's partition moves to
//! `delivery_events_archive`, where it is sealed.
//!
//! Invariants:
//! - A partition moves only when every delivery of its period is in a terminal state
//!   (checked when it is picked, and again under the log's lock): no chain is split and
//!   none grows once archived.
//! - A lock of the hot log waits at most the lock timeout; a move that cannot have it is
//!   left for the next pass, never forced. The scans (validating the partition's range,
//!   sealing it) hold no lock that stops the pipeline.
//! - Every archived partition is sealed once; a seal counts broken chains and strays.
//! - The archive is append-only like the hot log, and read with it (see [`events`]).
//!
//! [`events`]: crate::store::events()

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgExecutor, PgPool};
use uuid::Uuid;

/// What an archived partition was found to hold once archived.
#[derive(Debug, Clone, FromRow, Serialize, PartialEq, Eq)]
pub struct Seal {
    pub partition: String,
    /// The period's ids, `lo` (none: from the first) up to `hi` excluded.
    pub lo: Option<Uuid>,
    pub hi: Uuid,
    pub deliveries: i64,
    pub events: i64,
    /// Deliveries whose chain in the archive does not end at their head or holds a
    /// different number of events than their version counts: 0 for a sound archive.
    pub broken: i64,
    /// Events that belong to no delivery of the period: 0 for a sound archive.
    pub strays: i64,
    pub archived_at: DateTime<Utc>,
}

impl Seal {
    pub fn sound(&self) -> bool {
        self.broken == 0 && self.strays == 0
    }
}

fn millis(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Makes partitions of `period` for every gap up to `ahead` periods from now (cutting an
/// empty partition of a longer period first); returns the partitions created, none while
/// another caller is at it.
pub async fn ensure_partitions(
    db: impl PgExecutor<'_>,
    period: Duration,
    ahead: u32,
    lock_timeout: Duration,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT p FROM airlock_delivery_events_partitions($1, $2, $3) p")
        .bind(period.as_secs().max(1) as i64)
        .bind(ahead.max(1) as i32)
        .bind(millis(lock_timeout))
        .fetch_all(db)
        .await
}

/// What one [`archive_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Archived {
    /// No partition is due (or the oldest due one still has a delivery moving).
    Nothing,
    /// The partition is due but the hot log's lock could not be had in time.
    Busy(String),
    /// The partition moved to the archive, with its seal.
    Moved(Seal),
}

/// Moves the oldest partition whose period ended `older_than` ago or more, if every
/// delivery of it is finished, to the archive and seals it: four statements, each its own
/// transaction (see the invariants above). First seals any partition an interrupted pass
/// archived without a seal.
pub async fn archive_once(
    pool: &PgPool,
    older_than: Duration,
    lock_timeout: Duration,
) -> Result<Archived, sqlx::Error> {
    for part in unsealed(pool).await? {
        seal(pool, &part).await?;
    }
    let part: Option<String> = sqlx::query_scalar("SELECT airlock_archive_prepare($1, $2)")
        .bind(older_than.as_secs() as i64)
        .bind(millis(lock_timeout))
        .fetch_one(pool)
        .await?;
    let Some(part) = part else { return Ok(Archived::Nothing) };
    sqlx::query("SELECT airlock_archive_validate($1)").bind(&part).execute(pool).await?;
    let moved: bool = sqlx::query_scalar("SELECT airlock_archive_move($1, $2)")
        .bind(&part)
        .bind(millis(lock_timeout))
        .fetch_one(pool)
        .await?;
    if !moved {
        return Ok(Archived::Busy(part));
    }
    Ok(Archived::Moved(seal(pool, &part).await?))
}

/// Seals an archived partition (once; later calls return the first seal).
pub async fn seal(db: impl PgExecutor<'_>, part: &str) -> Result<Seal, sqlx::Error> {
    sqlx::query_as("SELECT * FROM airlock_archive_seal($1)").bind(part).fetch_one(db).await
}

/// Archived partitions without a seal.
async fn unsealed(db: impl PgExecutor<'_>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        r#"SELECT p.part::text FROM airlock_partitions('delivery_events_archive') p
           WHERE NOT EXISTS (SELECT 1 FROM delivery_event_archives a WHERE a.partition = p.part::text)"#,
    )
    .fetch_all(db)
    .await
}

/// Every seal, oldest period first.
pub async fn seals(db: impl PgExecutor<'_>) -> Result<Vec<Seal>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM delivery_event_archives ORDER BY lo NULLS FIRST").fetch_all(db).await
}
