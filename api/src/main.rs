//! `airlock-api`: the agent-facing HTTP API.

use airlock_api::{AppState, router};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    airlock_core::telemetry::install_crypto_provider();
    airlock_core::telemetry::init();
    let cfg = airlock_core::config::Config::load()?;
    let pool = airlock_core::db::connect(&cfg.database).await?;
    airlock_core::db::migrate(&pool).await?;
    let listener = tokio::net::TcpListener::bind(cfg.api.listen).await?;
    tracing::info!(listen = %listener.local_addr()?, "api listening");
    let shutdown = airlock_core::shutdown::on_signals()?;
    let limits = airlock_http::ServeLimits::from(&cfg.http);
    let app = router(AppState::new(pool, std::sync::Arc::new(cfg))?);
    airlock_http::serve(listener, app, limits, shutdown).await?;
    Ok(())
}
