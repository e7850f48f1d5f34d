//! The job queue against a real Postgres: claims, fencing, rescue, retention, wake-ups,
//! and the worker's maintenance passes.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod jobs;
mod lifecycle;
mod maintenance;
