//! The job queue against a real Postgres: claims, fencing, rescue, retention, wake-ups,
//! the worker's maintenance passes, and the ring of live partitions.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod jobs;
mod lifecycle;
mod maintenance;
mod ring;
