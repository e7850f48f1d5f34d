//! airlock-tests: the shared harness for airlock's integration suites.
//!
//! [`harness`] finds binaries and databases, spawns processes and waits with bounds;
//! [`smtp`] is an in-process SMTP server (STARTTLS, implicit TLS or plain) with
//! per-connection fault injection, used to check what airlock does when a mail relay
//! refuses, drops or half-accepts a message.

pub mod app;
pub mod capsule;
pub mod chaos;
pub mod harness;
pub mod invariants;
pub mod pgproxy;
pub mod reliability;
pub mod smtp;
pub mod webhook;
