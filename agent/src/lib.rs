//! airlock-agent: airlock drives a local model through a strict action protocol, inside a
//! durable run (DESIGN §8).
//!
//! A tour:
//! - [`protocol`]: the `airlock.action.v1` contract: exactly one JSON object, a tool call
//!   or a final answer, parsed strictly (no text around it, no fence, no duplicate or
//!   unknown keys, nothing that claims an authorization).
//! - [`provider`]: the OpenAI-compatible client (`POST /v1/chat/completions` on a
//!   loopback endpoint): no proxy, no redirects, no cookies, a timeout per call, and
//!   `model_unavailable` for any failure, with no fallback.

pub mod protocol;
pub mod provider;
