//! airlock-bench-adapter: airlock's entry into the long-horizon Postgres job-queue
//! benchmark, built on airlock's public queue API only.
//!
//! The benchmark drives every system through one adapter process: environment in,
//! JSON-lines telemetry out on stdout, logs on stderr, SIGTERM to stop. A tour:
//! - [`settings`]: the benchmark's environment, parsed and checked at start.
//! - [`protocol`]: the descriptor and sample records, the time format, wall-clock ticks,
//!   and the tables and indexes declared to the harness (equal to `adapter.json`).
//! - [`job`]: the bench job kind, its payload (enqueue time, run id, sequence number)
//!   and the handler that records pickup latency and sleeps `JOB_WORK_MS`.
//! - [`latency`]: a rolling 30 s window of HDR histograms, in bounded memory.
//! - [`producer`]: fixed-rate (self- or harness-paced) and depth-target producers over
//!   `queue::enqueue_many`; the stdin reader.
//! - [`depth`]: the queue-depth poller.
//! - [`sampler`]: one sample per metric at every tick.
//! - [`lifecycle`]: start (descriptor, connect, migrate), run (worker, producer, poller)
//!   and stop within the harness's five seconds; nothing in it exits on a database error.
//! - [`retry`]: back-off between attempts.
//!
//! How the queue behaves under the benchmark, and what was measured, is in
//! `docs/benchmark-adapter.md`.

pub mod depth;
pub mod job;
pub mod latency;
pub mod lifecycle;
pub mod producer;
pub mod protocol;
pub mod retry;
pub mod sampler;
pub mod settings;

pub use lifecycle::run;
pub use settings::Settings;
