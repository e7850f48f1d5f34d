//! airlock-admin: the reviewer/operator HTTP API, its web page and the operator CLI.
//!
//! A tour:
//! - [`cli`]: the command line (`serve`, `migrate`, `token`, `jobs`, `capsule`, `sandbox`).
//! - [`server`]: the HTTP router and its handlers (deliveries, review, the send switch,
//!   grants, audit, jobs and workers), built so tests can start it in-process.
//! - [`suppressions`]: recipients nothing may be sent to.
//! - [`capsule`]: the capsule commands and the agent and relocation routes.
//! - [`replay`]: `replay-eval`, a run's recorded decisions asked again of another model.
//! - [`runs`]: the runs, one run's replay log and effects, cancellation, and a human's
//!   settlement of an effect whose outcome nobody knows.
//! - [`turns`]: the calls of agent turns waiting for a human (grant bound to the arguments'
//!   hash, deny), and one turn.
//! - [`sandbox`]: the operator's sandbox routes and the `sandbox report` command.
//! - [`queues`]: queue pauses by hand (routes and the command line), and who is signed in.
//! - [`page`]: the web page served at `/`.

pub mod capsule;
pub mod cli;
pub mod page;
pub mod queues;
pub mod replay;
pub mod runs;
pub mod sandbox;
pub mod server;
pub mod suppressions;
pub mod turns;
