//! Clients that are not ours against the real system: the official Python MCP SDK over
//! streamable HTTP (`/mcp` on airlock-api) and over stdio (the `airlock-mcp` binary), the
//! tool list's schemas and hostile input at `/mcp`; the receivers' Standard Webhooks
//! library on airlock's requests; an independent validator on both OpenAPI documents; the
//! reviewers' and operators' web page in a real browser.
//!
//! One test binary for the group; each module is a suite. The stdio and browser suites
//! spawn real binaries: `cargo build --workspace --bins` first (as `scripts/test` does).
//! The Python clients come from `tests/python/requirements.txt` (`harness::python()`).
#![allow(clippy::unwrap_used)]

mod mcp;
mod openapi;
mod page;
mod schemas;
mod webhook_signatures;
