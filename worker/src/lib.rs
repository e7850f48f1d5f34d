//! airlock-worker: claims jobs from the queue and runs their handlers until told to stop.
//!
//! [`runtime::Worker`] is the loop (claim, run, heartbeat, rescue, prune, drain);
//! [`handler`] is how job kinds plug in; [`batch`] lets handlers share transactions; [`delivery`] holds the pipeline's kinds; [`diag`] holds diagnostic kinds used to check a
//! fleet (and by the crash suites); [`app`] wires configuration, handlers and signals for
//! the binary; [`sandbox`] holds the sandboxed tasks' kinds (`sandbox.select`, `sandbox.run`).

pub mod app;
pub mod batch;
pub mod delivery;
pub mod diag;
pub mod handler;
pub mod migrate;
pub mod node;
pub mod runtime;
pub mod sandbox;

pub use handler::{Handler, HandlerError, JobContext, Outcome, Registry};
pub use runtime::{Worker, WorkerSettings, WorkerStats};
