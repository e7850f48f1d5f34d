//! airlock-core: everything the airlock binaries share.
//!
//! A tour:
//! - [`config`]: typed, layered configuration (defaults < TOML file < environment).
//! - [`db`]: connecting to Postgres and applying the embedded migrations.
//! - [`queue`]: the Postgres job queue — enqueue, batch claim with `SKIP LOCKED`, fenced
//!   completion, heartbeats, the rescuer and retention. Every write of a lease holder is
//!   fenced on `(id, attempt, state = 'running')`.
//! - [`fault`]: named fault points at step boundaries, no-ops unless a test arms them.
//! - [`principals`]: bearer tokens and roles.
//! - [`sandbox`]: sandboxed tasks — tiers, tier selection with every decision logged, and
//!   the provider that runs commands under the chosen tier's limits.
//! - [`telemetry`]: tracing set-up.
//!
//! SQL lives here and nowhere else; functions take an executor so the caller decides the
//! transaction.

pub mod artifact;
pub mod audit;
pub mod capsule;
pub mod channels;
pub mod config;
pub mod db;
pub mod delivery;
pub mod fault;
pub mod fleet;
pub mod grants;
pub mod http;
pub mod metrics;
pub mod policy;
pub mod principals;
pub mod queue;
pub mod sandbox;
pub mod scoring;
pub mod secret;
pub mod sync;
pub mod telemetry;
