//! Start, run and stop one adapter process.
//!
//! Start: the descriptor goes out first (before any connection, so it is never late), the
//! sampler starts ticking, then the adapter connects and applies airlock's migrations,
//! retrying until Postgres answers (a replica restarted after SIGKILL may find it down).
//! Run: an airlock worker (concurrency `WORKER_COUNT`, claiming only the bench queue), the
//! producer, and the depth poller. None of them exits on a database error: the worker's
//! claim loop and LISTEN reconnect by themselves, the pool replaces dead connections, and
//! the adapter's own loops log, back off and retry. A worker that fails to start is
//! started again.
//! Stop (SIGTERM): the producer stops at once, the worker drains within its grace period
//! and releases what it did not finish; whatever is still pending when [`STOP_BUDGET`] is
//! spent is abandoned (leases expire and the rescuer returns those jobs to the queue), so
//! the process always exits 0 within the harness's five seconds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_core::config::{Config, DatabaseConfig};
use airlock_worker::{Registry, Worker, WorkerSettings};
use chrono::Utc;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::depth::{self, DepthGauge};
use crate::job::{self, PayloadFactory};
use crate::latency::RollingLatency;
use crate::producer::{self, Counters, Producer, Tokens};
use crate::protocol::{Descriptor, Emitter};
use crate::retry::Backoff;
use crate::sampler::{self, Completions, LATENCY_WINDOW, Sources};
use crate::settings::{ProducerMode, Settings};

/// From SIGTERM to the end of `run`; the harness allows five seconds to exit.
pub const STOP_BUDGET: Duration = Duration::from_millis(4000);

/// Defaults for airlock's own configuration in the benchmark, below any
/// `AIRLOCK__SECTION__KEY` the environment sets.
const AIRLOCK_DEFAULTS: &[(&str, &str)] = &[
    // A short acquire timeout keeps a stop quick while Postgres is away.
    ("AIRLOCK__DATABASE__ACQUIRE_TIMEOUT_SECONDS", "3"),
    // A SIGKILLed replica's jobs come back after the lease plus the rescue interval.
    ("AIRLOCK__WORKER__LEASE_SECONDS", "10"),
    ("AIRLOCK__WORKER__RESCUE_INTERVAL_SECONDS", "2"),
    // The fallback when a NOTIFY is missed (e.g. while LISTEN reconnects).
    ("AIRLOCK__WORKER__POLL_INTERVAL_MS", "200"),
    ("AIRLOCK__WORKER__SHUTDOWN_GRACE_SECONDS", "2"),
    ("AIRLOCK__WORKER__HEARTBEAT_SECONDS", "5"),
];

/// airlock's configuration for this process: the defaults above, then `AIRLOCK__*` from
/// `env`, then what the benchmark decides (`DATABASE_URL`, `WORKER_COUNT`).
pub fn airlock_config(settings: &Settings, env: &[(String, String)]) -> anyhow::Result<Config> {
    let mut vars: Vec<(String, String)> =
        AIRLOCK_DEFAULTS.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    // Enough connections for every handler's completion, plus claim, LISTEN, heartbeat,
    // rescuer, retention, producer and depth poller.
    vars.push(("AIRLOCK__DATABASE__MAX_CONNECTIONS".into(), (settings.worker_count + 10).to_string()));
    vars.extend(env.iter().filter(|(k, _)| k.starts_with("AIRLOCK__")).cloned());
    vars.push(("AIRLOCK__WORKER__CONCURRENCY".into(), settings.worker_count.to_string()));
    vars.push(("AIRLOCK__DATABASE__URL".into(), settings.database_url.expose().to_string()));
    Ok(Config::from_sources(None, &vars)?)
}

/// Runs the adapter until `shutdown` fires, then stops within [`STOP_BUDGET`].
pub async fn run(settings: Settings, env: &[(String, String)], shutdown: CancellationToken) -> anyhow::Result<()> {
    let emitter = Arc::new(Emitter::new(std::io::stdout()));
    emitter.emit(&Descriptor::new(&settings.db_name, settings.instance_id, Utc::now()));
    let config = airlock_config(&settings, env)?;
    let settings = Arc::new(settings);

    let tokens = Arc::new(Tokens::default());
    producer::spawn_stdin_reader(settings.pacing, tokens.clone());

    let latency = Arc::new(Mutex::new(RollingLatency::new(LATENCY_WINDOW)));
    let counters = Arc::new(Counters::default());
    let completions = Arc::new(Completions::default());
    let gauge = Arc::new(DepthGauge::default());
    let sampler = tokio::spawn(sampler::run(
        settings.sample_every,
        Sources {
            latency: latency.clone(),
            counters: counters.clone(),
            completions: completions.clone(),
            depth: gauge.clone(),
            reports_depth: settings.reports_depth(),
            instance_id: settings.instance_id,
        },
        emitter.clone(),
        shutdown.clone(),
    ));

    let Some(pool) = connect(&config.database, &shutdown).await else {
        let _ = sampler.await;
        return Ok(());
    };
    tracing::info!(db = %settings.db_name, workers = settings.worker_count, "connected and migrated; running");

    let mut registry = Registry::new();
    job::register(&mut registry, settings.job_work, latency);
    let mut loops = tokio::task::JoinSet::new();
    loops.spawn(supervise_worker(
        pool.clone(),
        Arc::new(config),
        registry,
        settings.clone(),
        completions,
        shutdown.clone(),
    ));
    loops.spawn(
        Producer {
            pool: pool.clone(),
            settings: settings.clone(),
            counters: counters.clone(),
            tokens,
            depth: gauge.clone(),
            payloads: PayloadFactory::new(uuid::Uuid::now_v7(), settings.job_payload_bytes),
            next_seq: 0,
        }
        .run(shutdown.clone()),
    );
    let depth_target = settings.producer_mode == ProducerMode::DepthTarget;
    if settings.reports_depth() || depth_target {
        let every = if depth_target { Duration::from_millis(200) } else { Duration::from_secs(1) };
        loops.spawn(depth::poll(pool.clone(), every, counters.enqueued.clone(), gauge, shutdown.clone()));
    }

    shutdown.cancelled().await;
    let deadline = tokio::time::Instant::now() + STOP_BUDGET;
    while !loops.is_empty() {
        match tokio::time::timeout_at(deadline, loops.join_next()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(left = loops.len(), "stop budget spent: abandoning the rest (leases will expire)");
                loops.abort_all();
                break;
            }
        }
    }
    let _ = sampler.await;
    tracing::info!(enqueued = counters.enqueued(), "stopped");
    Ok(())
}

/// Connects and applies the migrations, retrying until both succeed; `None` on shutdown.
async fn connect(cfg: &DatabaseConfig, shutdown: &CancellationToken) -> Option<PgPool> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        let attempt = async {
            let pool = airlock_core::db::connect(cfg).await?;
            airlock_core::db::migrate(&pool).await?;
            Ok::<_, anyhow::Error>(pool)
        };
        let error = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = attempt => match r {
                Ok(pool) => return Some(pool),
                Err(e) => e,
            },
        };
        let delay = backoff.next_delay();
        tracing::warn!(error = %error, retry_in_ms = delay.as_millis() as u64, "cannot connect and migrate yet");
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Runs an airlock worker until `shutdown`; starts a new one if it fails to start.
async fn supervise_worker(
    pool: PgPool,
    config: Arc<Config>,
    registry: Registry,
    settings: Arc<Settings>,
    completions: Arc<Completions>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    while !shutdown.is_cancelled() {
        let mut ws = WorkerSettings::from_config(&config, WorkerSettings::new_id());
        ws.queues = Some(vec![job::QUEUE.to_string()]);
        ws.retention = settings.retention;
        ws.retention_interval = Duration::from_secs(10);
        let worker = Worker::new(pool.clone(), registry.clone(), ws);
        completions.start(worker.stats());
        let result = worker.run(shutdown.clone()).await;
        completions.end();
        match result {
            Ok(()) => return,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "worker stopped; starting it again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn airlock_configuration_layers() {
        let env = vars(&[
            ("DATABASE_URL", "postgres://127.0.0.1/bench"),
            ("WORKER_COUNT", "6"),
            ("AIRLOCK__WORKER__LEASE_SECONDS", "20"),
            ("AIRLOCK__WORKER__CONCURRENCY", "99"),
        ]);
        let settings = Settings::from_vars(&env).unwrap();
        let c = airlock_config(&settings, &env).unwrap();
        assert_eq!(c.worker.concurrency, 6, "WORKER_COUNT wins");
        assert_eq!(c.worker.lease_seconds, 20, "the environment overrides the bench defaults");
        assert_eq!(c.worker.poll_interval_ms, 200);
        assert_eq!(c.database.max_connections, 16);
        assert_eq!(c.database.url.expose(), "postgres://127.0.0.1/bench");
    }
}
