//! airlock-tests: the shared harness for airlock's integration suites (the suites are the
//! group binaries under `tests/tests/`).
//!
//! A tour:
//! - [`browser`]: runs a scenario of the page's browser script (Chromium, playwright-core).
//! - [`harness`]: finds binaries, databases and the Python test tools, spawns processes,
//!   waits with bounds.
//! - [`app`]: [`app::TestApp`], the whole system in-process on port 0 against a fresh
//!   database, with a real SMTP server and webhook receiver.
//! - [`smtp`]: an in-process SMTP server (STARTTLS, implicit TLS or plain) with
//!   per-connection fault injection: a relay that refuses, drops or half-accepts.
//! - [`webhook`]: a webhook receiver that records every request and answers as told.
//! - [`model`]: a scripted OpenAI-compatible server (a model's answers, scripted).
//! - [`pgproxy`]: a TCP proxy in front of Postgres that can cut or stall connections.
//! - [`reliability`]: helpers of the crash and fault suites.
//! - [`scripted`]: the operations of the scripted agent (`airlock-scripted-agent`), a
//!   resumable client of a durable run.
//! - [`invariants`]: the promises every suite checks at its end (nothing lost, nothing
//!   sent twice, every chain intact).
//! - [`chaos`]: the chaos run (`airlock-chaos`): real workers killed at random.
//! - [`capsule`]: a fleet of nodes for the capsule and relocation suites.

pub mod app;
pub mod browser;
pub mod capsule;
pub mod chaos;
pub mod harness;
pub mod invariants;
pub mod model;
pub mod pgproxy;
pub mod reliability;
pub mod scripted;
pub mod smtp;
pub mod webhook;
