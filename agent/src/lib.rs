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
//! - [`catalogue`]: the tools, each with a closed JSON schema and an effect class, fixed
//!   when the process starts.
//! - [`turn`]: the `agent_turns` table, its states and legal moves, its events.
//! - [`authorization`]: a non-repeatable call held for a human, granted bound to the hash of
//!   its exact arguments, or denied.
//! - [`context`]: the transcript as journal events, appended to the agent's journal and
//!   rendered for the model with the capsule renderers, fitted to its window.
//! - [`engine`]: one execution of a turn's job: record or replay each round, call tools
//!   through the run's effects ledger, pause for humans, end.
//! - [`tools`]: what each tool does when called.
//! - [`view`]: the JSON shapes.
//! - [`judge`]: a configured model as the delivery pipeline's second scorer
//!   (`scoring.model`), fail closed.
//!
//! Invariants: nothing a model says or a tool returns changes a turn's tools, grants or
//! scope; no tool runs on an answer that broke the protocol; a non-repeatable call runs only
//! once a human granted those exact arguments, and at most once; every model answer and
//! tool result is a step of the run before the next round; a write of a driver that lost
//! the turn changes nothing.

pub mod authorization;
pub mod catalogue;
pub mod context;
pub mod engine;
pub mod error;
pub mod judge;
pub mod protocol;
pub mod provider;
pub mod tools;
pub mod turn;
pub mod view;

pub use engine::{Drove, Engine, EngineError};
pub use error::TurnError;
pub use turn::{TURN_JOB, Turn, TurnState};
