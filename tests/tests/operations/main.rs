//! Operating airlock: health and metrics, the compose file, the operator commands (the send switch and queue pauses too), the configuration reference and the benchmark adapter.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod bench_adapter;
mod configuration;
mod plans;
mod service;
mod switch_and_queues;
mod tokens;
