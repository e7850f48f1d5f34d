//! The chaos run (`scripts/chaos`, which starts the throwaway Postgres cluster it needs):
//! deliveries through real workers that are SIGKILLed at random, a relay that fails at
//! every phase, Postgres restarted mid-run; then every promise is checked. Prints a
//! summary table; exits 1 on any violation.
//!
//! Usage: `airlock-chaos --database-url URL [--pg-restart CMD] [--deliveries 2000]
//! [--workers 4] [--seed N] [--kill-every-ms 200-600] [--smtp-fault-p 0.1]
//! [--lease-seconds 5] [--max-chaos-seconds 3600] [--settle-seconds 300] [--log-dir DIR]
//! [--summary-file PATH]`

use std::path::PathBuf;
use std::time::Duration;

use airlock_tests::chaos::{self, ChaosConfig};
use anyhow::{Context as _, bail};

fn usage() -> ! {
    eprintln!(
        "usage: airlock-chaos --database-url URL [--pg-restart CMD] [--deliveries N] [--workers N] [--seed N] \
         [--kill-every-ms MIN-MAX] [--smtp-fault-p P] [--lease-seconds N] [--max-chaos-seconds N] \
         [--settle-seconds N] [--log-dir DIR] [--summary-file PATH]"
    );
    std::process::exit(2)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cfg = ChaosConfig {
        deliveries: 2000,
        workers: 4,
        seed: 42,
        kill_min_ms: 200,
        kill_max_ms: 600,
        smtp_fault_p: 0.1,
        lease_seconds: 5,
        database_url: std::env::var("DATABASE_URL").unwrap_or_default(),
        pg_restart: None,
        worker_bin: chaos::worker_bin(),
        log_dir: PathBuf::new(),
        max_chaos: Duration::from_secs(3600),
        settle_timeout: Duration::from_secs(300),
    };
    let mut log_base = std::env::temp_dir();
    let mut summary_file: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            usage();
        }
        let value = args.next().unwrap_or_else(|| usage());
        let num = |v: &str| v.parse::<u64>().with_context(|| format!("{flag}: not a number: {v}"));
        match flag.as_str() {
            "--database-url" => cfg.database_url = value,
            "--pg-restart" => cfg.pg_restart = Some(value).filter(|v| !v.is_empty()),
            "--deliveries" => cfg.deliveries = num(&value)? as usize,
            "--workers" => cfg.workers = (num(&value)? as usize).max(1),
            "--seed" => cfg.seed = num(&value)?,
            "--kill-every-ms" => {
                let (lo, hi) = value.split_once('-').unwrap_or((&value, &value));
                (cfg.kill_min_ms, cfg.kill_max_ms) = (num(lo)?, num(hi)?);
                if cfg.kill_min_ms > cfg.kill_max_ms {
                    bail!("--kill-every-ms: MIN must not exceed MAX");
                }
            }
            "--smtp-fault-p" => cfg.smtp_fault_p = value.parse().context("--smtp-fault-p: not a number")?,
            "--lease-seconds" => cfg.lease_seconds = num(&value)?.max(1),
            "--max-chaos-seconds" => cfg.max_chaos = Duration::from_secs(num(&value)?),
            "--settle-seconds" => cfg.settle_timeout = Duration::from_secs(num(&value)?),
            "--log-dir" => log_base = PathBuf::from(value),
            "--summary-file" => summary_file = Some(PathBuf::from(value)),
            _ => usage(),
        }
    }
    if cfg.database_url.is_empty() {
        bail!("--database-url (or DATABASE_URL) is required: a throwaway cluster the run may restart");
    }
    cfg.log_dir = chaos::log_dir(&log_base);
    eprintln!(
        "chaos: {} deliveries, {} workers, kill every {}-{} ms, SMTP fault p={}, seed {}, logs in {}",
        cfg.deliveries,
        cfg.workers,
        cfg.kill_min_ms,
        cfg.kill_max_ms,
        cfg.smtp_fault_p,
        cfg.seed,
        cfg.log_dir.display()
    );

    let summary = chaos::run(&cfg).await?;
    let table = summary.table(&cfg);
    println!("{table}");
    if let Some(path) = summary_file {
        std::fs::write(&path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    if summary.violations.is_empty() {
        eprintln!("chaos: every promise held ({})", summary.database);
        Ok(())
    } else {
        eprintln!("chaos: {} VIOLATION(S) (database {}):", summary.violations.len(), summary.database);
        for v in summary.violations.iter().take(50) {
            eprintln!("  {v}");
        }
        std::process::exit(1)
    }
}
