//! The provider seam: where a task's command actually runs.
//!
//! A provider gets a [`RunSpec`] (the command, its environment, the read-only context
//! files, the tier's limits) and returns a [`RunOutcome`]. It holds no database handle:
//! the `sandbox.run` job reads what it needs before and writes the outcome after, so a
//! provider never runs inside a transaction. The built-in provider is
//! [`super::local::LocalProvider`]; others (a VM pool, a container service, a cluster
//! scheduler running a Kubernetes `Job` per task) plug in here.
//!
//! What every provider must guarantee (`docs/sandboxes.md`, "Other providers"): the
//! command runs as an identity that is neither root nor the worker's nor another run's;
//! it gets no environment, file, credential or network of the worker's (no network at all
//! for a tier without one, never the database, relay, node protocol or APIs for a tier
//! with one, and [`ProviderError::Refused`] when that cannot be ensured); the tier's
//! limits hold and every stop is reported in `killed_for`; and once `run` returns, `cancel`
//! fires or the future is dropped, nothing the command started is still running.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::state::RunEnd;
use airlock_core::config::sandbox::Tier;
use airlock_core::secret::Secret;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A file of durable context, copied read-only into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextFile {
    /// Relative to the context directory, `/`-separated, no `..`.
    pub path: String,
    pub bytes: Vec<u8>,
}

/// Everything a provider needs to run one task once.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub task_id: Uuid,
    /// 1 for the first start, more after a lost worker.
    pub run: i32,
    pub command: Vec<String>,
    /// The spec's literal variables.
    pub env: BTreeMap<String, String>,
    /// Resolved from the keyring by name; exposed only to the command.
    pub secrets: Vec<(String, Secret)>,
    pub context: Vec<ContextFile>,
    pub tier: Tier,
    /// For an idempotent task: the key its effects must carry (stable across reruns).
    pub idempotency_key: Option<String>,
    /// How much of each output stream to keep.
    pub max_output_bytes: usize,
}

/// Why a run was stopped by a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KilledFor {
    Timeout,
    Memory,
    Cpu,
    Disk,
    /// More processes and threads than the tier's `max_processes`.
    Processes,
}

impl KilledFor {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Memory => "memory",
            Self::Cpu => "cpu",
            Self::Disk => "disk",
            Self::Processes => "processes",
        }
    }
}

/// What a run did and used.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    /// The exit status, when the command exited (not killed by a signal).
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    pub duration_ms: u64,
    pub peak_rss_kib: u64,
    /// Bytes written to stdout and stderr together (all of it, not only what was kept).
    pub output_bytes: u64,
    pub timed_out: bool,
    pub killed_for: Option<KilledFor>,
    /// The head of each stream, at most `max_output_bytes` each.
    pub stdout: String,
    pub stderr: String,
    /// The limits the provider could enforce on this run (e.g. `wall_clock`, `memory`,
    /// `rlimit_cpu`): a review can tell an unenforced limit from a respected one.
    pub limits: Vec<String>,
}

impl RunOutcome {
    /// The task's end state for this outcome.
    pub fn end(&self) -> RunEnd {
        if self.timed_out {
            RunEnd::TimedOut
        } else if self.exit_code == Some(0) && self.killed_for.is_none() {
            RunEnd::Succeeded
        } else {
            RunEnd::Failed
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The job's lease was lost or the worker is stopping; the run was killed.
    #[error("the run was cancelled")]
    Cancelled,
    /// The sandbox could not be prepared (directory, wrapper); worth another try.
    #[error("preparing the sandbox: {0}")]
    Setup(String),
    /// This worker will not run the spec as it is (a tier whose network it cannot make
    /// safe, a variable that steers how programs load): another try would be refused too.
    #[error("{0}")]
    Refused(String),
}

/// Runs commands in sandboxes of a tier.
pub trait Provider: Send + Sync + 'static {
    fn name(&self) -> &'static str;

    /// Runs the spec once. Must kill everything it started when `cancel` fires, and when
    /// the returned future is dropped.
    fn run(&self, spec: RunSpec, cancel: CancellationToken) -> BoxFuture<'static, Result<RunOutcome, ProviderError>>;
}
