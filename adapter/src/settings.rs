//! The benchmark's environment, parsed once at start into typed settings.
//!
//! Every variable has the benchmark's default when it is unset or empty; a value that does
//! not parse is refused with a message naming the variable, so a misconfigured run fails at
//! start rather than producing numbers that mean something else.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use airlock_core::secret::Secret;

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{var}: {message}")]
    Invalid { var: &'static str, message: String },
}

fn invalid(var: &'static str, message: impl Into<String>) -> SettingsError {
    SettingsError::Invalid { var, message: message.into() }
}

/// The lifecycle the harness asks for. Only the long-horizon one exists so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// A steady producer and consumer that run until SIGTERM.
    LongHorizon,
}

/// How the producer decides how many jobs to insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerMode {
    /// A fixed offered rate (`PRODUCER_RATE`, or the rate-control file).
    Fixed,
    /// Keep the number of available jobs near `TARGET_DEPTH`.
    DepthTarget,
}

/// Who paces a fixed-rate producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pacing {
    /// The adapter meters the rate itself.
    Adapter,
    /// The harness writes `ENQUEUE <n>` lines on stdin; each asks for n jobs.
    Harness,
}

/// What one adapter process was asked to do.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the queue lives; may carry a password.
    pub database_url: Secret,
    /// The database name, reported in the descriptor.
    pub db_name: String,
    pub scenario: Scenario,
    pub producer_mode: ProducerMode,
    /// Jobs per second this replica offers (fixed mode), until the control file says else.
    pub producer_rate_per_s: f64,
    /// Available jobs the depth-target producer keeps in the queue.
    pub target_depth: u64,
    /// Handlers running at once in this replica (the worker's concurrency).
    pub worker_count: usize,
    /// Approximate size of each job's JSON payload.
    pub job_payload_bytes: usize,
    /// How long each handler sleeps: the synthetic work.
    pub job_work: Duration,
    /// Telemetry cadence; ticks fall on wall-clock multiples of it.
    pub sample_every: Duration,
    /// This replica's number; only replica 0 reports queue-wide depths.
    pub instance_id: u32,
    /// A file holding the current target rate, re-read on every producer tick.
    pub rate_control_file: Option<PathBuf>,
    pub pacing: Pacing,
    /// Most jobs in one INSERT.
    pub producer_batch_max: usize,
    /// The producer's tick in adapter pacing.
    pub producer_batch: Duration,
    /// Completed jobs older than this are deleted by the worker's retention loop; `None`
    /// keeps them (`AIRLOCK_BENCH_RETENTION_SECONDS=0`), which a loss check needs.
    pub retention: Option<Duration>,
}

impl Settings {
    /// Reads the settings from a list of environment variables (the process environment
    /// in the binary; tests pass their own).
    pub fn from_vars(vars: &[(String, String)]) -> Result<Self, SettingsError> {
        let get = |name: &str| -> Option<&str> {
            vars.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.trim()).filter(|v| !v.is_empty())
        };
        let url = get("DATABASE_URL").ok_or_else(|| invalid("DATABASE_URL", "is required"))?;
        let options = sqlx::postgres::PgConnectOptions::from_str(url)
            .map_err(|e| invalid("DATABASE_URL", format!("not a Postgres URL: {e}")))?;
        let db_name = options.get_database().unwrap_or_else(|| options.get_username()).to_string();

        let scenario = match get("SCENARIO").unwrap_or("long_horizon") {
            "long_horizon" => Scenario::LongHorizon,
            other => return Err(invalid("SCENARIO", format!("`{other}` is not supported (long_horizon is)"))),
        };
        let producer_mode = match get("PRODUCER_MODE").unwrap_or("fixed") {
            "fixed" => ProducerMode::Fixed,
            "depth-target" | "depth_target" => ProducerMode::DepthTarget,
            other => return Err(invalid("PRODUCER_MODE", format!("`{other}`: expected fixed or depth-target"))),
        };
        let pacing = match get("PRODUCER_PACING").unwrap_or("adapter") {
            "adapter" => Pacing::Adapter,
            "harness" => Pacing::Harness,
            other => return Err(invalid("PRODUCER_PACING", format!("`{other}`: expected adapter or harness"))),
        };
        let producer_rate_per_s: f64 = parse(get, "PRODUCER_RATE", 200.0)?;
        if !(producer_rate_per_s.is_finite() && producer_rate_per_s >= 0.0) {
            return Err(invalid("PRODUCER_RATE", "must be a non-negative number"));
        }
        let worker_count: usize = parse(get, "WORKER_COUNT", 4)?;
        if !(1..=1000).contains(&worker_count) {
            return Err(invalid("WORKER_COUNT", "must be between 1 and 1000"));
        }
        let sample_every_s: f64 = parse(get, "SAMPLE_EVERY_S", 5.0)?;
        if !(sample_every_s.is_finite() && (0.1..=3600.0).contains(&sample_every_s)) {
            return Err(invalid("SAMPLE_EVERY_S", "must be between 0.1 and 3600"));
        }
        let producer_batch_max: usize = parse(get, "PRODUCER_BATCH_MAX", 128)?;
        if producer_batch_max == 0 {
            return Err(invalid("PRODUCER_BATCH_MAX", "must be at least 1"));
        }
        let producer_batch_ms: u64 = parse(get, "PRODUCER_BATCH_MS", 25)?;
        if producer_batch_ms == 0 {
            return Err(invalid("PRODUCER_BATCH_MS", "must be at least 1"));
        }
        let retention_s: u64 = parse(get, "AIRLOCK_BENCH_RETENTION_SECONDS", 60)?;
        Ok(Self {
            database_url: Secret::new(url),
            db_name,
            scenario,
            producer_mode,
            producer_rate_per_s,
            target_depth: parse(get, "TARGET_DEPTH", 1000)?,
            worker_count,
            job_payload_bytes: parse(get, "JOB_PAYLOAD_BYTES", 256)?,
            job_work: Duration::from_millis(parse(get, "JOB_WORK_MS", 1)?),
            sample_every: Duration::from_millis((sample_every_s * 1000.0).round() as u64),
            instance_id: parse(get, "BENCH_INSTANCE_ID", 0)?,
            rate_control_file: get("PRODUCER_RATE_CONTROL_FILE").map(PathBuf::from),
            pacing,
            producer_batch_max,
            producer_batch: Duration::from_millis(producer_batch_ms),
            retention: (retention_s > 0).then(|| Duration::from_secs(retention_s)),
        })
    }

    /// Whether this replica reports the queue-wide depth metrics.
    pub fn reports_depth(&self) -> bool {
        self.instance_id == 0
    }
}

fn parse<'a, T: FromStr>(
    get: impl Fn(&str) -> Option<&'a str>,
    var: &'static str,
    default: T,
) -> Result<T, SettingsError>
where
    T::Err: std::fmt::Display,
{
    match get(var) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|e| invalid(var, format!("`{v}`: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn defaults_are_the_benchmarks() {
        let s =
            Settings::from_vars(&vars(&[("DATABASE_URL", "postgres://u:pw@127.0.0.1:5432/airlock_bench")])).unwrap();
        assert_eq!(s.db_name, "airlock_bench");
        assert_eq!(s.scenario, Scenario::LongHorizon);
        assert_eq!(s.producer_mode, ProducerMode::Fixed);
        assert_eq!(s.pacing, Pacing::Adapter);
        assert_eq!(s.job_payload_bytes, 256);
        assert_eq!(s.job_work, Duration::from_millis(1));
        assert_eq!(s.sample_every, Duration::from_secs(5));
        assert_eq!(s.producer_batch_max, 128);
        assert_eq!(s.producer_batch, Duration::from_millis(25));
        assert_eq!(s.instance_id, 0);
        assert!(s.reports_depth());
        assert_eq!(s.retention, Some(Duration::from_secs(60)));
        assert!(!format!("{s:?}").contains("pw"), "the URL is never printed");
    }

    #[test]
    fn values_and_refusals_name_the_variable() {
        let base = ("DATABASE_URL", "postgres://127.0.0.1/b?sslmode=disable");
        let s = Settings::from_vars(&vars(&[
            base,
            ("PRODUCER_MODE", "depth-target"),
            ("PRODUCER_PACING", "harness"),
            ("PRODUCER_RATE", "150.5"),
            ("WORKER_COUNT", "8"),
            ("SAMPLE_EVERY_S", "0.5"),
            ("BENCH_INSTANCE_ID", "2"),
            ("PRODUCER_RATE_CONTROL_FILE", "/tmp/rate"),
            ("AIRLOCK_BENCH_RETENTION_SECONDS", "0"),
            ("JOB_WORK_MS", ""),
        ]))
        .unwrap();
        assert_eq!(s.db_name, "b");
        assert_eq!(s.producer_mode, ProducerMode::DepthTarget);
        assert_eq!(s.pacing, Pacing::Harness);
        assert_eq!(s.producer_rate_per_s, 150.5);
        assert_eq!(s.worker_count, 8);
        assert_eq!(s.sample_every, Duration::from_millis(500));
        assert!(!s.reports_depth());
        assert_eq!(s.rate_control_file.as_deref(), Some(std::path::Path::new("/tmp/rate")));
        assert_eq!(s.retention, None);
        assert_eq!(s.job_work, Duration::from_millis(1), "empty means the default");

        let err = |extra: (&str, &str)| Settings::from_vars(&vars(&[base, extra])).unwrap_err().to_string();
        assert!(err(("SCENARIO", "burst")).starts_with("SCENARIO"));
        assert!(err(("PRODUCER_MODE", "random")).starts_with("PRODUCER_MODE"));
        assert!(err(("WORKER_COUNT", "0")).starts_with("WORKER_COUNT"));
        assert!(err(("WORKER_COUNT", "four")).starts_with("WORKER_COUNT"));
        assert!(err(("PRODUCER_RATE", "-1")).starts_with("PRODUCER_RATE"));
        assert!(err(("SAMPLE_EVERY_S", "0")).starts_with("SAMPLE_EVERY_S"));
        assert!(err(("PRODUCER_BATCH_MAX", "0")).starts_with("PRODUCER_BATCH_MAX"));
        assert!(Settings::from_vars(&[]).unwrap_err().to_string().starts_with("DATABASE_URL"));
    }
}
