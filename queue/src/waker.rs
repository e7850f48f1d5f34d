//! Waking idle workers: the NOTIFY channel, and a [`Waker`] that wakes them for many
//! committed transactions at once.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_core::sync::lock;
use sqlx::PgPool;

/// The channel workers LISTEN on; the payload is the queue name.
pub const NOTIFY_CHANNEL: &str = "airlock_jobs";

/// The least time between two NOTIFYs of one [`Waker`].
pub const WAKE_SPACING: Duration = Duration::from_millis(2);

/// Wakes idle workers for jobs enqueued without a NOTIFY of their own
/// ([`enqueue_many_quiet`]), after the enqueuing transactions have committed.
///
/// A transaction that sends a NOTIFY holds one lock, shared by the whole database, from
/// just before its commit until the commit has reached disk, so such commits cannot share
/// a disk flush: under load, a fifth of the pipeline's busy connections were waiting for
/// it at COMMIT. A waker sends one NOTIFY per queue poked since its last one, at most one
/// every [`WAKE_SPACING`], in a transaction of its own that writes nothing else, whose
/// commit Postgres therefore does not flush to disk: it holds that lock only for a moment.
/// An idle worker then claims up to [`WAKE_SPACING`] later than it would have, and a busy
/// fleet is not woken once per enqueue. A process that dies between a commit and its
/// wake-up leaves the job to the workers' poll (`worker.poll_interval_ms`).
#[derive(Clone)]
pub struct Waker {
    pending: Arc<Mutex<BTreeSet<String>>>,
    poke: tokio::sync::mpsc::Sender<()>,
}

impl Waker {
    /// A waker sending on `pool`; its task ends with the last clone. Needs a Tokio runtime.
    pub fn new(pool: PgPool) -> Self {
        let pending: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        // One slot: a poke while one is waiting already is the same wake-up.
        let (poke, mut pokes) = tokio::sync::mpsc::channel::<()>(1);
        let queues = Arc::clone(&pending);
        tokio::spawn(async move {
            while pokes.recv().await.is_some() {
                let started = tokio::time::Instant::now();
                let batch: Vec<String> = std::mem::take(&mut *lock(&queues)).into_iter().collect();
                if batch.is_empty() {
                    continue;
                }
                if let Err(e) = notify_queues(&pool, &batch).await {
                    tracing::warn!(error = %e, queues = ?batch, "wake-up not sent; idle workers find the jobs at their next poll");
                }
                tokio::time::sleep_until(started + WAKE_SPACING).await;
            }
        });
        Self { pending, poke }
    }

    /// Wakes idle workers for `queue` soon; call it after the commit that made its jobs.
    pub fn wake(&self, queue: &str) {
        {
            let mut pending = lock(&self.pending);
            if !pending.contains(queue) {
                pending.insert(queue.to_string());
            }
        }
        let _ = self.poke.try_send(());
    }
}

/// One NOTIFY per queue, in a transaction of their own.
async fn notify_queues(pool: &PgPool, queues: &[String]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, q) FROM unnest($2::text[]) AS q")
        .bind(NOTIFY_CHANNEL)
        .bind(queues)
        .execute(pool)
        .await?;
    Ok(())
}
