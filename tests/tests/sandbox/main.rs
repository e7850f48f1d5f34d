//! Sandboxed tasks: selection modes, limits, isolation and real processes.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod isolation;
mod modes;
mod process;
mod support;
