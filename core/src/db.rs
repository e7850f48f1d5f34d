//! Connecting to Postgres and applying the one schema.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::config::DatabaseConfig;

/// The migrations under `migrations/`, embedded once here for every binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Opens a pool. Connections are checked before use, so a restarted Postgres is survived
/// by the next query rather than by a restart of the process. Statements are prepared
/// once per connection, and Postgres decides per statement whether to plan each execution
/// with its values or keep a generic plan.
pub async fn connect(cfg: &DatabaseConfig) -> Result<PgPool, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = cfg.url.expose().parse()?;
    PgPoolOptions::new()
        .max_connections(cfg.max_connections)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(cfg.acquire_timeout_seconds))
        .test_before_acquire(true)
        .connect_with(options)
        .await
}

/// A pool of at most `max_connections` to the same database as `pool`, with its settings,
/// whose connections keep one generic plan per prepared statement
/// (`plan_cache_mode = force_generic_plan`). For the queue's hottest statements, whose
/// right plan does not depend on their values (a test checks their generic plans): left to
/// choose, Postgres re-plans them at every execution, because a plan made for the actual
/// values looks cheaper than the generic one, and that planning was about a fifth of its
/// CPU under load. Connections open when first needed.
pub fn generic_plans(pool: &PgPool, max_connections: u32) -> PgPool {
    let options = (*pool.connect_options()).clone().options([("plan_cache_mode", "force_generic_plan")]);
    pool.options().clone().max_connections(max_connections).min_connections(0).connect_lazy_with(options)
}

/// Applies every pending migration; safe to run concurrently from several processes
/// (sqlx takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}

/// Whether the database answers and every embedded migration is applied.
pub async fn ready(pool: &PgPool) -> bool {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Result<Option<i64>, _> =
        sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool).await;
    matches!(applied, Ok(Some(v)) if v >= latest)
}
