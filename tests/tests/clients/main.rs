//! Clients of airlock driven from outside: the reviewers' and operators' web page in a
//! real browser.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod page;
