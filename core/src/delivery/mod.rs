//! The delivery pipeline: persist → score → review → approve → send → receipt.
//!
//! [`state`] is the one table of legal moves; [`store`] is the SQL; [`pipeline`] is the
//! operations the services and jobs perform, each one transaction.

pub mod pipeline;
pub mod state;
pub mod store;
pub mod view;
