//! airlock-runs: durable runs, an agent's unit of long work.
//!
//! A tour:
//! - [`state`]: run states and the one table of legal moves.
//! - [`store`]: the SQL of `runs` (creation, reads).
//! - [`piece`]: spending from a run inside another crate's statement.
//!
//! A run belongs to one agent; every read names the agent, so another agent's run is
//! simply not found.

pub mod piece;
pub mod state;
pub mod store;

pub use state::RunState;
pub use store::Run;
