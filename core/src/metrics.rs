//! Prometheus metrics, the same names in every process.
//!
//! Counters and histograms are recorded where things happen (the worker runtime, the send
//! path, the HTTP layer); gauges of queue depth, deliveries by state and the send switch
//! are sampled from Postgres when `/metrics` is scraped (by the [`Gauges`] of the crates
//! that own those tables), so every process reports the same, current picture.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

/// Jobs claimed, by kind.
pub const JOBS_CLAIMED: &str = "airlock_jobs_claimed_total";
/// Jobs that ended, by kind and outcome (completed, retried, failed, parked, lease_lost).
pub const JOBS_ENDED: &str = "airlock_jobs_ended_total";
/// Seconds one claim statement took.
pub const CLAIM_SECONDS: &str = "airlock_claim_seconds";
/// Seconds a handler ran, by kind.
pub const JOB_SECONDS: &str = "airlock_job_seconds";
/// Expired leases the rescuer moved, by outcome (retried, failed, parked).
pub const LEASES_RESCUED: &str = "airlock_leases_rescued_total";
/// Jobs by kind and state, sampled.
pub const QUEUE_DEPTH: &str = "airlock_queue_depth";
/// Deliveries by state, sampled.
pub const DELIVERIES: &str = "airlock_deliveries";
/// Send attempts by channel and outcome.
pub const SEND_ATTEMPTS: &str = "airlock_send_attempts_total";
/// Receipts written, by channel.
pub const RECEIPTS: &str = "airlock_receipts_total";
/// 1 when sending is on, 0 when off, sampled.
pub const SEND_ENABLED: &str = "airlock_send_enabled";
/// Steps recorded in runs' replay logs, by kind.
pub const RUN_STEPS: &str = "airlock_run_steps_total";
/// Events of runs' effects, by event (started, succeeded, failed, awaiting_human, and a
/// human's confirmed_done, retry, abandon).
pub const RUN_EFFECTS: &str = "airlock_run_effects_total";
/// Runs by state, sampled.
pub const RUNS: &str = "airlock_runs";
/// Agent turns that reached a state, by state.
pub const TURNS: &str = "airlock_turns_total";
/// Model completions asked by turns, by model and outcome (ok, unavailable, ignored).
pub const TURN_MODEL_CALLS: &str = "airlock_turn_model_calls_total";
/// Tool calls of turns, by tool and outcome (ok, failed, denied, awaiting).
pub const TURN_TOOL_CALLS: &str = "airlock_turn_tool_calls_total";
/// Authorizations asked for and decided, by state.
pub const TURN_AUTHORIZATIONS: &str = "airlock_turn_authorizations_total";
/// HTTP requests by service, method, route and status.
pub const HTTP_REQUESTS: &str = "airlock_http_requests_total";

/// Every metric name, for documentation and tests.
pub const ALL: &[&str] = &[
    JOBS_CLAIMED,
    JOBS_ENDED,
    CLAIM_SECONDS,
    JOB_SECONDS,
    LEASES_RESCUED,
    QUEUE_DEPTH,
    DELIVERIES,
    SEND_ATTEMPTS,
    RECEIPTS,
    SEND_ENABLED,
    RUN_STEPS,
    RUN_EFFECTS,
    RUNS,
    TURNS,
    TURN_MODEL_CALLS,
    TURN_TOOL_CALLS,
    TURN_AUTHORIZATIONS,
    HTTP_REQUESTS,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder (once) and returns the handle that renders it.
pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // A recorder installed earlier (another component of the same process) keeps
        // working; this handle then renders an empty registry, so prefer installing early.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// Samples gauges from the database into the recorder: each crate that owns a table
/// whose figures are gauges provides one (queue depth, deliveries by state, the switch).
pub type Gauges = for<'a> fn(&'a PgPool) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>>;

/// When the gauges were last sampled; held while sampling, so concurrent scrapes wait
/// for one sample instead of each counting.
static LAST_SAMPLE: tokio::sync::Mutex<Option<std::time::Instant>> = tokio::sync::Mutex::const_new(None);

/// Renders everything in Prometheus text, sampling the gauges only when the last sample
/// of this process is older than `every` (`http.metrics_sample_seconds`): a scrape costs
/// the database at most one count per interval, however many scrapers there are.
pub async fn render_sampled(pool: &PgPool, gauges: Gauges, every: std::time::Duration) -> String {
    let handle = install();
    {
        let mut last = LAST_SAMPLE.lock().await;
        if last.is_none_or(|at| every.is_zero() || at.elapsed() >= every) {
            match gauges(pool).await {
                Ok(()) => *last = Some(std::time::Instant::now()),
                Err(e) => tracing::warn!(error = %e, "sampling gauges for /metrics failed"),
            }
        }
    }
    handle.render()
}
