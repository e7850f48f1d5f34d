//! `airlock-mcp`: the agent API as an MCP server over stdio, for desktop agents. Calls the
//! agent API at `AIRLOCK_API_URL` with the agent's token `AIRLOCK_TOKEN`; refuses plain
//! `http://` to a host that is not loopback. Standard output carries only MCP messages;
//! anything said to a human goes to standard error.

use std::sync::Arc;

use airlock_mcp::AgentTools;
use airlock_mcp::remote::RemoteApi;
use anyhow::Context;
use rmcp::ServiceExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("AIRLOCK_API_URL").context("AIRLOCK_API_URL must name the agent API (https://…)")?;
    let token = std::env::var("AIRLOCK_TOKEN").context("AIRLOCK_TOKEN must hold the agent's bearer token")?;
    let api = RemoteApi::new(&url, &token).map_err(anyhow::Error::msg)?;
    let server = AgentTools::new(Arc::new(api)).serve(rmcp::transport::stdio()).await.context("MCP over stdio")?;
    server.waiting().await.context("MCP over stdio")?;
    Ok(())
}
