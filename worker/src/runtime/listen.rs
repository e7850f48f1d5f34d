//! Wake-ups: LISTENs for enqueue notifications so an idle worker claims within
//! milliseconds instead of at its next poll.
//!
//! Invariants:
//! - A notification is a hint; polling stays the fallback, so a missed one delays a claim
//!   by at most the poll interval.
//! - Whenever notifications may have been missed (a (re)connect) or a pause or resume is
//!   announced, the worker's caches are forgotten: the paused queues are re-read and the
//!   next claim starts from the front of the claim index.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use airlock_queue as queue;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::claim::{ClaimCursor, Pauses};
use super::{WorkerStats, bump};

/// LISTENs for enqueue notifications and wakes the claim loop. Reconnects by itself; after
/// a reconnect it wakes the loop once, since notifications may have been missed.
pub(super) async fn listen_loop(
    pool: PgPool,
    wake: Arc<Notify>,
    pauses: Arc<Pauses>,
    cursor: Arc<ClaimCursor>,
    stats: Arc<WorkerStats>,
    stop: CancellationToken,
) {
    // What the worker keeps between claims may be stale: the paused queues, and whether a
    // job now sorts before its claim cursor.
    let forget = || {
        pauses.invalidate();
        cursor.rewind();
    };
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let listener = async {
            let mut l = PgListener::connect_with(&pool).await?;
            l.listen(queue::NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            _ = stop.cancelled() => return,
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN failed; polling until it is back");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(100);
        forget();
        stats.listening.store(true, Ordering::SeqCst);
        wake.notify_one();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                n = listener.try_recv() => match n {
                    Ok(Some(n)) => {
                        if n.payload().starts_with(queue::PAUSE_NOTIFY_PREFIX) {
                            forget();
                        }
                        bump(&stats.notify_wakeups);
                        wake.notify_one();
                    }
                    // The connection was lost and re-established: notifications may be missed.
                    Ok(None) => {
                        forget();
                        wake.notify_one();
                    }
                    Err(e) => {
                        stats.listening.store(false, Ordering::SeqCst);
                        tracing::warn!(error = %e, "LISTEN connection failed");
                        break;
                    }
                }
            }
        }
    }
}
