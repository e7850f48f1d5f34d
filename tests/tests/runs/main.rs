//! Durable runs: the routes and their answers, and crash convergence of a real agent
//! process killed at every boundary of its work.
//!
//! One test binary for the group; each module is a suite. The crash suites need the
//! binaries: `cargo build --workspace --bins` (as `scripts/test` does).
#![allow(clippy::unwrap_used)]

mod api;
mod crash;
mod replay_eval;
mod turns;
