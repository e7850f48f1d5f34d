//! airlock-admin: the reviewer/operator HTTP API and the operator CLI.
//!
//! [`cli`] is the command line (`serve`, `migrate`, `token create`); [`server`] builds the
//! HTTP router, so tests can start it in-process.

pub mod capsule;
pub mod cli;
pub mod page;
pub mod sandbox;
pub mod server;
