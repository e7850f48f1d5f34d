//! `airlock-worker`: claim and run jobs until SIGTERM/SIGINT, then shut down gracefully.

use clap::Parser;

/// Claims and runs airlock jobs until SIGTERM or SIGINT. Configuration comes from
/// AIRLOCK_CONFIG and AIRLOCK__SECTION__KEY environment variables.
#[derive(Parser)]
#[command(version)]
struct Cli {}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = Cli::parse();
    airlock_core::telemetry::install_crypto_provider();
    airlock_core::telemetry::init();
    airlock_core::fault::arm_from_env().map_err(anyhow::Error::msg)?;
    let cfg = airlock_core::config::Config::load()?;
    let shutdown = airlock_core::shutdown::on_signals()?;
    airlock_worker::app::run(cfg, shutdown).await
}
