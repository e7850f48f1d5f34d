//! airlock-delivery: the delivery pipeline, persist → score → review → approve → send →
//! receipt, without any transport (the worker plugs in `airlock-channels`).
//!
//! A tour:
//! - [`actor`]: who made a change (an agent, a human, a worker, the system).
//! - [`artifact`]: what an agent hands over (an email or a webhook call), parsed and
//!   content-addressed by sha256.
//! - [`policy`]: the send policy: verified senders, allowed webhook origins, idempotency
//!   keys, Message-IDs and webhook signatures.
//! - [`scoring`]: the deterministic, explainable scorer behind the [`scoring::Scorer`] trait.
//! - [`grants`]: standing, scoped, expiring, count-limited approvals.
//! - [`suppressions`]: recipients nothing may be sent to.
//! - [`state`]: delivery states and the one table of legal moves.
//! - [`store`]: the SQL of deliveries and what hangs off them (events, scores, reviews,
//!   approvals, attempts, receipts, the send switch).
//! - [`pipeline`]: the operations the services and jobs perform, each one transaction.
//! - [`outcome`]: what a transport knows after a send.
//! - [`view`]: the JSON shapes. [`metrics`]: the gauges this crate's tables feed.

pub mod actor;
pub mod artifact;
pub mod grants;
pub mod metrics;
pub mod outcome;
pub mod pipeline;
pub mod policy;
pub mod scoring;
pub mod state;
pub mod store;
pub mod suppressions;
pub mod view;
