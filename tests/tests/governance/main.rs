//! Governance: grants, four-eyes review, batch approval, the audit chain, token revocation.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod database_role;
mod grants_and_review;
mod judge;
mod limits;
