//! airlock-mcp: the agent API as Model Context Protocol tools.
//!
//! A tour: [`tools`] is the table of tools (name, description for a model, closed input
//! schema, the agent route each wraps); [`server`] is the MCP server over any
//! [`server::AgentApi`] — it checks a call's arguments against the schema, calls the route
//! and answers its JSON, an error answer as a tool error carrying the route's code and
//! message; [`remote`] is the agent API over HTTP, which the `airlock-mcp` binary serves
//! over stdio. `airlock-api` serves the same server at `/mcp` over streamable HTTP, calling
//! its own routes in process.
//!
//! This crate knows no database and no domain type: a tool is only a way to call an agent
//! route, so what an agent may do over MCP is exactly what its token may do over HTTP.

pub mod remote;
pub mod server;
pub mod tools;

pub use server::{AgentApi, AgentTools, Answer};
pub use tools::{Method, RouteCall, TOOLS};
