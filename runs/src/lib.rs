//! airlock-runs: durable runs, an agent's unit of long work, kept in Postgres so that
//! whatever process drives a run can die at any instruction and the next one resumes at the
//! step that was running, repeating no effect.
//!
//! A tour:
//! - [`state`]: run states and the one table of legal moves.
//! - [`run`]: the `runs` table: creation, the holder epoch (claim), the end of a run,
//!   waiting for a human, and why a write was refused.
//! - [`budget`]: the limits a run gets within its agent's ceilings, and what a step spends.
//! - [`steps`]: the replay log, recorded with its budget spent in one statement.
//! - [`effects`]: the effects ledger (begin, outcome, a human's resolution).
//! - [`key`]: the one derivation of an effect's idempotency key from `(run, step)`.
//! - [`piece`]: spending and recording inside another crate's statement (deliveries).
//! - [`view`]: the JSON shapes.
//! - [`error`]: what can be refused, and what kind of failure each is.
//!
//! Invariants: every write of a holder names the epoch it holds, and an older one changes
//! nothing; a recorded step is returned as recorded; a step and its budget are one
//! statement; a terminal run accepts nothing more; a run belongs to one agent, and every
//! read names it, so another agent's run is simply not found.

pub mod budget;
pub mod effects;
pub mod error;
pub mod key;
pub mod piece;
pub mod run;
pub mod state;
pub mod steps;
pub mod view;

pub use error::RunError;
pub use run::Run;
pub use state::RunState;
