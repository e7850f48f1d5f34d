//! The MCP server of the tools: lists them, checks a call's arguments against the tool's
//! closed schema, turns them into the route call, and answers the route's JSON.
//!
//! The route is reached through an [`AgentApi`]: in `airlock-api` the agent routes
//! themselves, in process; in `airlock-mcp` the agent API over HTTP. Either way the
//! answer is the route's body: a 2xx body is the tool's result, anything else is a tool
//! error (`isError`) whose content is the route's `{"error": {"code", "message"}}`.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Extensions, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use serde_json::{Map, Value, json};

use crate::tools::{RouteCall, TOOLS, ToolDef};

/// What a route answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    /// The JSON body (`Null` when there was none or it was not JSON).
    pub body: Value,
}

/// A way to call the agent routes as the calling agent.
pub trait AgentApi: Send + Sync + 'static {
    /// Calls the route. `extensions` are the MCP request's (over streamable HTTP they hold
    /// the HTTP request's parts, and so who is calling). `Err` is a failure to get any
    /// answer, said in words.
    fn call(&self, extensions: &Extensions, call: RouteCall) -> impl Future<Output = Result<Answer, String>> + Send;
}

/// The error body of a refusal made here, in the routes' shape.
pub fn error_body(code: &str, message: impl Into<String>) -> Value {
    json!({"error": {"code": code, "message": message.into()}})
}

/// The tools as MCP describes them, and their compiled schemas, built once.
struct Catalogue {
    tools: Vec<Tool>,
    validators: Vec<jsonschema::Validator>,
}

fn catalogue() -> &'static Catalogue {
    static CATALOGUE: OnceLock<Catalogue> = OnceLock::new();
    CATALOGUE.get_or_init(|| {
        let mut tools = Vec::new();
        let mut validators = Vec::new();
        for def in TOOLS {
            let schema = def.input_schema();
            // The schemas are constants of this crate; a test compiles every one.
            #[allow(clippy::expect_used)]
            let validator = jsonschema::validator_for(&schema).expect("a tool's input schema compiles");
            let Value::Object(schema) = schema else { unreachable!("a tool's input schema is an object") };
            tools.push(Tool::new(def.name, def.description, Arc::new(schema)));
            validators.push(validator);
        }
        Catalogue { tools, validators }
    })
}

/// Every tool as listed to clients.
pub fn listed_tools() -> Vec<Tool> {
    catalogue().tools.clone()
}

/// Checks arguments against the tool's schema: the first violations, said with where.
pub fn check_arguments(name: &str, arguments: &Value) -> Result<(), String> {
    let i = TOOLS.iter().position(|t| t.name == name).ok_or_else(|| format!("unknown tool `{name}`"))?;
    let errors: Vec<String> = catalogue().validators[i]
        .iter_errors(arguments)
        .take(5)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() { e.to_string() } else { format!("{at}: {e}") }
        })
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("; ")) }
}

/// The longest argument text echoed back in a message.
const ECHO_LIMIT: usize = 300;

/// The MCP server of the agent tools over an [`AgentApi`].
pub struct AgentTools<A> {
    api: Arc<A>,
}

impl<A> Clone for AgentTools<A> {
    fn clone(&self) -> Self {
        Self { api: self.api.clone() }
    }
}

impl<A: AgentApi> AgentTools<A> {
    pub fn new(api: Arc<A>) -> Self {
        Self { api }
    }

    /// One tool call: checked, routed, answered. `Err` only for a tool that does not exist
    /// (a protocol error, as MCP says); everything else is a result.
    pub async fn call(
        &self,
        extensions: &Extensions,
        name: &str,
        arguments: Option<Map<String, Value>>,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(def) = crate::tools::find(name) else {
            let shown: String = name.chars().take(ECHO_LIMIT).collect();
            return Err(ErrorData::invalid_params(format!("unknown tool `{shown}`"), None));
        };
        let arguments = arguments.unwrap_or_default();
        Ok(self.call_def(extensions, def, arguments).await)
    }

    async fn call_def(&self, extensions: &Extensions, def: &ToolDef, arguments: Map<String, Value>) -> CallToolResult {
        let arguments = Value::Object(arguments);
        if let Err(why) = check_arguments(def.name, &arguments) {
            let why: String = why.chars().take(4 * ECHO_LIMIT).collect();
            return CallToolResult::structured_error(error_body("VALIDATION", format!("arguments: {why}")));
        }
        let Value::Object(arguments) = arguments else { unreachable!("built from an object") };
        let call = match def.route_call(&arguments) {
            Ok(c) => c,
            Err(why) => return CallToolResult::structured_error(error_body("VALIDATION", why)),
        };
        match self.api.call(extensions, call).await {
            Ok(answer) => result_of(answer),
            Err(why) => CallToolResult::structured_error(error_body("UNAVAILABLE", why)),
        }
    }
}

/// A route's answer as a tool result: 2xx is the result, anything else an error carrying
/// the route's error body (or one in its shape when the answer had none).
pub fn result_of(answer: Answer) -> CallToolResult {
    if (200..300).contains(&answer.status) {
        let body = if answer.body.is_object() { answer.body } else { json!({"result": answer.body}) };
        return CallToolResult::structured(body);
    }
    if answer.body["error"]["code"].is_string() {
        return CallToolResult::structured_error(answer.body);
    }
    let (code, message) = match answer.status {
        400 => ("VALIDATION", "the request was refused"),
        401 => ("UNAUTHENTICATED", "a valid bearer token is required"),
        403 => ("FORBIDDEN", "not allowed"),
        404 => ("NOT_FOUND", "not found"),
        408 => ("UNAVAILABLE", "the request timed out"),
        413 => ("PAYLOAD_TOO_LARGE", "request body too large"),
        429 => ("RATE_LIMITED", "too many requests"),
        500..=599 => ("UNAVAILABLE", "airlock could not answer"),
        _ => ("INTERNAL", "unexpected answer"),
    };
    CallToolResult::structured_error(error_body(code, format!("{message} (HTTP {})", answer.status)))
}

const INSTRUCTIONS: &str = "airlock lets you act on the world safely. Start a run (start_run), then submit \
emails or webhook calls as steps of it (submit_email, submit_webhook) and follow them (get_delivery). \
Nothing is sent without airlock's checks, a human's approval where policy asks for it, and the \
operators' send switch: a delivery waiting for review or approval is a normal answer. Record \
non-deterministic inputs (record_step) and external writes (begin_effect, record_outcome) so a \
resumed run (claim_run) replays instead of repeating. Errors carry a code; each tool says what to do.";

impl<A: AgentApi> rmcp::ServerHandler for AgentTools<A> {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("airlock", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(listed_tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        catalogue().tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.call(&context.extensions, &request.name, request.arguments).await.map(Into::into)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn answers_keep_the_routes_bodies() {
        let ok = result_of(Answer { status: 202, body: json!({"state": "awaiting_human"}) });
        assert_eq!(ok.is_error, Some(false));
        assert_eq!(ok.structured_content, Some(json!({"state": "awaiting_human"})));
        let refused = error_body("STALE_EPOCH", "epoch 1 is older than 2");
        let err = result_of(Answer { status: 409, body: refused.clone() });
        assert_eq!(err.is_error, Some(true));
        assert_eq!(err.structured_content, Some(refused));
        let bare = result_of(Answer { status: 408, body: Value::Null });
        assert_eq!(bare.structured_content.unwrap()["error"]["code"], "UNAVAILABLE");
    }
}
