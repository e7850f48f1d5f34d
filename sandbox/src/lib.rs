//! airlock-sandbox: sandboxed tasks. An agent's command runs in a sandbox of a configured tier, chosen by
//! the agent, by central rules, by a human, or by the agent within bounds, and every
//! choice is logged with its outcome so choices can be reviewed.
//!
//! A sandbox is a resource a task uses, not the place an agent lives: the agent's durable
//! context stays in Postgres and is copied read-only into each run by reference.
//!
//! A tour:
//! - the `sandbox` configuration (tiers, per-agent scopes, platform rules) is parsed and
//!   checked with the rest, in [`airlock_core::config::sandbox`].
//! - [`spec`]: parsing `POST /v1/tasks` (bad input is refused before any row exists).
//! - [`state`]: task states, modes, verdicts, and the one table of legal transitions.
//! - [`selection`]: tier selection, a pure function of request, configuration and facts.
//! - [`store`]: the SQL. [`service`]: the operations, one transaction each.
//! - [`provider`]: the seam where commands run; [`local`]: the built-in provider, which
//!   isolates every run with [`bubblewrap`] (namespaces, a uid of its own from [`uids`],
//!   limits read from [`procs`]) and gives tiers with a network one that cannot reach
//!   what the worker protects ([`network`]).
//! - [`context`]: durable context as read-only files. Secrets come by name from the
//!   host keyring ([`airlock_core::secret::Keyring`], configured by `capsules.keyring_*`).
//! - [`report`]: outcomes by tier and mode; over- and under-provisioned runs.
//! - [`view`]: the JSON shapes.
//!
//! Lifecycle: `POST /v1/tasks` stores the task (`selecting`) and a `sandbox.select` job in
//! one transaction. The job decides: a chosen tier queues a `sandbox.run` job (`queued`),
//! an escalation waits for an operator (`awaiting_choice`), a denial ends it (`denied`).
//! The run job records its start, runs the command through the provider with no
//! transaction open, then records the outcome on the decision and ends the task
//! (`succeeded`, `failed`, `timed_out`). Both jobs survive a lost worker: selection has no
//! effect and is simply rerun; a run is `pure` or `idempotent` (the task declares which)
//! and is rerun by the rescuer, its lost start closed as `lost`.

pub mod bubblewrap;
pub mod context;
pub mod local;
pub mod network;
pub mod procs;
pub mod provider;
pub mod report;
pub mod selection;
pub mod service;
pub mod spec;
pub mod state;
pub mod store;
pub mod uids;
pub mod view;

pub use airlock_core::config::sandbox::{SandboxConfig, Tier};

use airlock_core::error::{DomainError, ErrorKind};
use airlock_queue::QueueError;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// Bad input (400).
    #[error("{0}")]
    Invalid(String),
    #[error("{0} not found")]
    NotFound(&'static str),
    /// Not allowed in the task's current state (409).
    #[error("{0}")]
    InvalidTransition(String),
    /// The job's lease was lost (or another queue refusal): the holder stops.
    #[error(transparent)]
    Queue(QueueError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl From<QueueError> for SandboxError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::Db(e) => SandboxError::Db(e),
            other => SandboxError::Queue(other),
        }
    }
}

impl DomainError for SandboxError {
    fn kind(&self) -> ErrorKind {
        match self {
            SandboxError::Invalid(_) => ErrorKind::Validation,
            SandboxError::NotFound(_) => ErrorKind::NotFound,
            SandboxError::InvalidTransition(_) | SandboxError::Queue(_) => ErrorKind::InvalidTransition,
            SandboxError::Db(_) => ErrorKind::Internal,
        }
    }
}
