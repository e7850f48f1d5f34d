//! Capsules: the format, the journal, provider rendering and live migration (with faults).
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod faults;
mod format;
mod journal;
mod migration;
mod processes;
mod render;
mod tar_limits;
