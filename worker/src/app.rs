//! Wires the binary: configuration, pool, migrations, handlers, signals.

use airlock_core::config::Config;
use tokio_util::sync::CancellationToken;

use crate::handler::Registry;
use crate::runtime::{Worker, WorkerSettings};

/// Every handler this build knows, as configured.
pub fn registry(cfg: &Config) -> Registry {
    let mut r = Registry::new();
    if cfg.worker.diagnostic_jobs {
        crate::diag::register(&mut r);
    }
    r
}

/// Connects, migrates and runs a worker until `shutdown` fires.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let pool = airlock_core::db::connect(&cfg.database).await?;
    airlock_core::db::migrate(&pool).await?;
    let registry = registry(&cfg);
    let settings = WorkerSettings::from_config(&cfg, WorkerSettings::new_id());
    Worker::new(pool, registry, settings).run(shutdown).await
}
