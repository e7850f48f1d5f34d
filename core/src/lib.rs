//! airlock-core: what every airlock crate shares, and nothing domain-specific.
//!
//! A tour:
//! - [`config`]: typed, layered configuration (defaults < TOML file < environment), every
//!   section of every crate, checked at start with errors that name the key.
//! - [`db`]: the Postgres pool and the embedded migrations (the one schema).
//! - [`telemetry`]: tracing set-up and the process's TLS crypto provider.
//! - [`metrics`]: the metric names every process reports and the Prometheus recorder.
//! - [`ids`]: typed ids (`DeliveryId`, `JobId`, `RunId`, `TaskId`, `AgentId`, …).
//! - [`secret`]: values that are never printed, read by name from the environment or from
//!   the host keyring.
//! - [`audit`]: the append-only, hash-chained log of human actions.
//! - [`principals`]: bearer tokens and roles.
//! - [`fault`]: named fault points at step boundaries, no-ops unless a test arms them.
//! - [`shutdown`]: the root cancellation token fired by SIGTERM/SIGINT.
//! - [`error`]: the kind of a failure ([`error::ErrorKind`]), which every crate's error
//!   names and only `airlock-http` maps to a status.
//! - [`sync`]: locking the process-local state tasks share.
//!
//! No HTTP, SMTP, process or file-format code lives here; SQL here is only for the tables
//! these modules own (`principals`, `audit_log`).

pub mod audit;
pub mod config;
pub mod db;
pub mod error;
pub mod fault;
pub mod ids;
pub mod metrics;
pub mod principals;
pub mod secret;
pub mod shutdown;
pub mod sync;
pub mod telemetry;
pub mod text;
