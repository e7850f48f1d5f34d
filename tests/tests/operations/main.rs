//! Operating airlock: health and metrics, the compose file, the operator commands, the configuration reference and the benchmark adapter.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod service;
mod configuration;
mod bench_adapter;
