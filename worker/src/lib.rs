//! airlock-worker: claims jobs from the queue and runs their handlers until told to stop.
//!
//! A tour:
//! - [`runtime`]: the worker itself, [`Worker`] (claim, run, complete, drain), and its
//!   maintenance loops, each with a `run_once` that tests call directly:
//!   [`runtime::heartbeat`] (leases kept alive; a lease missed twice cancels its job),
//!   [`runtime::rescue`] (expired leases settled), [`runtime::retention`] (old jobs
//!   pruned) and [`runtime::statistics`] (a new table's first analysis);
//!   [`runtime::in_flight`] is the set of jobs it holds. Its private parts:
//!   `claim` (the claim loop and its caches), `execute` (slots and handlers), `complete`
//!   (batched completions) and `listen` (LISTEN/NOTIFY wake-ups).
//! - [`handler`]: how job kinds plug in (a [`Handler`] per kind in a [`Registry`]).
//! - [`batch`]: lets handlers running at once share transactions.
//! - [`delivery`]: the pipeline's kinds (`delivery.score`, `delivery.send`).
//! - [`sandbox`]: the sandboxed tasks' kinds (`sandbox.select`, `sandbox.run`).
//! - [`turn`]: the `agent.turn` kind, driving an agent turn against a model.
//! - [`migrate`]: the `capsule.migrate` kind, moving an agent between nodes.
//! - [`node`]: the node service, for a worker that hosts agents.
//! - [`diag`]: diagnostic kinds used to check a fleet (and by the crash suites).
//! - [`app`]: wires configuration, handlers and signals for the binary.

pub mod app;
pub mod batch;
pub mod delivery;
pub mod diag;
pub mod handler;
pub mod migrate;
pub mod node;
pub mod runtime;
pub mod sandbox;
pub mod turn;

pub use handler::{Handler, HandlerError, JobContext, Outcome, Registry};
pub use runtime::{Worker, WorkerSettings, WorkerStats};
