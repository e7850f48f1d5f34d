//! `airlock-bench-adapter`: runs airlock's queue under the long-horizon Postgres
//! job-queue benchmark. Configuration is the benchmark's environment (see
//! `airlock_bench_adapter::settings`); telemetry goes to stdout, logs to stderr.

use std::time::Duration;

fn main() -> anyhow::Result<()> {
    airlock_core::telemetry::install_crypto_provider();
    airlock_core::telemetry::init();
    let env: Vec<(String, String)> = std::env::vars().collect();
    let settings = airlock_bench_adapter::Settings::from_vars(&env)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        let shutdown = airlock_core::shutdown::on_signals()?;
        airlock_bench_adapter::run(settings, &env, shutdown).await
    });
    // Work abandoned at the end of the stop budget must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}
