//! airlock-tests: the shared harness for airlock's integration suites.
//!
//! [`harness`] finds binaries and databases, spawns processes and waits with bounds.

pub mod harness;
pub mod smtp;
