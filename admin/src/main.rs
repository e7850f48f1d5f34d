//! `airlock-admin`: reviewer/operator HTTP API, web page and operator CLI.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    airlock_core::telemetry::install_crypto_provider();
    airlock_core::telemetry::init();
    let cli = airlock_admin::cli::Cli::parse();
    match airlock_admin::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("airlock-admin: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
