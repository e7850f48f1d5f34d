//! Durable runs and agent turns: the routes and their answers, crash convergence of a
//! real agent process (and of a worker driving a turn) killed at every boundary of its
//! work, and replay as evaluation.
//!
//! One test binary for the group; each module is a suite. The crash suites need the
//! binaries: `cargo build --workspace --bins` (as `scripts/test` does).
#![allow(clippy::unwrap_used)]

mod api;
mod crash;
mod replay_eval;
mod turn_crash;
mod turns;
