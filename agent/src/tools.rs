//! What each tool does when a turn calls it. The engine decides whether a call runs (its
//! effect class, the ledger, a human's authorization); this module runs it.
//!
//! - `delivery.email`, `delivery.webhook`: a delivery of the run, keyed by the call's step
//!   (the same call again is the same delivery), entering the pipeline at `persisted`:
//!   scoring, review, approval and the send switch still decide whether it goes out.
//! - `memory.read`, `journal.search`: the agent's capsule (its archived checkpoint) and the
//!   journal airlock wrote for it; pure reads.
//! - `sandbox.run`: a task of the agent, keyed by the call's step, waited for.
//! - declared HTTP tools: `POST <url>` of the arguments through the [`Transport`] the
//!   worker gives (signed like a webhook, with the call's `Idempotency-Key`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use airlock_capsule::archive::Archive;
use airlock_capsule::files::WORKING_MEMORY;
use airlock_capsule::journal::{EventKind, Journal};
use airlock_core::config::Config;
use airlock_core::ids::{AgentId, RunId};
use airlock_delivery::artifact::Artifact;
use airlock_delivery::pipeline::{self, PipelineError, Submission};
use airlock_queue::Waker;
use airlock_runs::RunError;
use serde_json::{Map, Value, json};
use sqlx::PgPool;

use crate::catalogue::{Tool, ToolKind};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a declared HTTP tool is reached: the worker's webhook transport (allow-listed
/// origins, checked addresses, signatures). `Ok` is the 2xx JSON body.
pub trait Transport: Send + Sync + 'static {
    fn post<'a>(
        &'a self,
        url: &'a str,
        body: &'a Value,
        idempotency_key: &'a str,
    ) -> BoxFuture<'a, Result<Value, String>>;
}

/// Why a call has no result for the model.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The call was refused or failed: the model is told (`ok: false`).
    #[error("{0}")]
    Failed(Value),
    /// The run's budget cannot pay for it: the turn and the run end `budget_exhausted`.
    #[error("the run's budget is spent")]
    BudgetExhausted,
    /// The run ended or is no longer this driver's: stop, nothing more.
    #[error("{0}")]
    RunGone(String),
    /// Infrastructure: try the job again later.
    #[error("{0}")]
    Retry(String),
}

fn failed(message: impl Into<String>) -> CallError {
    CallError::Failed(json!({"error": message.into()}))
}

/// Runs tools for turns.
#[derive(Clone)]
pub struct ToolBox {
    pub pool: PgPool,
    pub config: Arc<Config>,
    pub waker: Waker,
    pub archive: Arc<dyn Archive>,
    pub transport: Option<Arc<dyn Transport>>,
}

/// Who calls, and as which step.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub agent: &'a str,
    /// The token that asked for the turn.
    pub principal_id: Option<uuid::Uuid>,
    pub run_id: RunId,
    pub call_step: &'a str,
    pub idempotency_key: &'a str,
}

impl ToolBox {
    /// Runs `tool` with `arguments` (already checked against its schema).
    pub async fn call(&self, tool: &Tool, arguments: &Map<String, Value>, who: Caller<'_>) -> Result<Value, CallError> {
        match &tool.kind {
            ToolKind::Email => {
                let mut email = arguments.clone();
                email.entry("cc").or_insert_with(|| json!([]));
                self.deliver("email", Some(&Value::Object(email)), None, who).await
            }
            ToolKind::Webhook => {
                let mut hook = arguments.clone();
                hook.entry("headers").or_insert_with(|| json!({}));
                self.deliver("webhook", None, Some(&Value::Object(hook)), who).await
            }
            ToolKind::MemoryRead => self.memory(who.agent).await,
            ToolKind::JournalSearch => {
                let query = arguments.get("query").and_then(Value::as_str).unwrap_or_default();
                let limit = arguments.get("limit").and_then(Value::as_u64).unwrap_or(5).clamp(1, 20) as usize;
                self.search(who.agent, query, limit).await
            }
            ToolKind::SandboxRun => self.sandbox(arguments, who).await,
            ToolKind::Http { url } => {
                let Some(t) = &self.transport else {
                    return Err(CallError::Retry("this process has no transport for HTTP tools".into()));
                };
                t.post(url, &Value::Object(arguments.clone()), who.idempotency_key).await.map_err(failed)
            }
        }
    }

    /// A delivery of the run, as the call's step.
    pub async fn deliver(
        &self,
        channel: &str,
        email: Option<&Value>,
        webhook: Option<&Value>,
        who: Caller<'_>,
    ) -> Result<Value, CallError> {
        let limits = pipeline::limits(&self.config);
        let artifact = Artifact::from_parts(channel, email, webhook, &limits).map_err(|e| failed(e.to_string()))?;
        self.submit(artifact, who).await
    }

    /// Submits an artifact as the call's step; the result names the delivery.
    pub async fn submit(&self, artifact: Artifact, who: Caller<'_>) -> Result<Value, CallError> {
        let s = Submission { run_id: who.run_id, step_id: who.call_step.to_string(), artifact };
        match pipeline::submit(&self.pool, &self.config, &self.waker, who.agent, s).await {
            Ok((d, _)) => Ok(json!({
                "delivery_id": d.id, "state": d.state, "artifact_sha256": d.artifact_sha256,
                "note": "submitted, not sent: scoring, review, approval and the send switch decide",
            })),
            Err(PipelineError::BudgetExhausted | PipelineError::Run(RunError::BudgetExhausted { .. })) => {
                Err(CallError::BudgetExhausted)
            }
            Err(PipelineError::Run(e @ (RunError::StaleEpoch { .. } | RunError::InvalidTransition(_)))) => {
                Err(CallError::RunGone(e.to_string()))
            }
            Err(e @ (PipelineError::Db(_) | PipelineError::Queue(_))) => Err(CallError::Retry(e.to_string())),
            Err(PipelineError::InvalidTransition(m)) => Err(CallError::RunGone(m)),
            Err(e) => Err(failed(e.to_string())),
        }
    }

    /// A sandboxed task of the agent, keyed by the call (the same call again is the same
    /// task), waited for up to `agent.sandbox_wait_seconds`; its outcome is the result.
    async fn sandbox(&self, arguments: &Map<String, Value>, who: Caller<'_>) -> Result<Value, CallError> {
        use airlock_sandbox::spec::{TaskBody, TaskRequest};
        let body = json!({
            "command": arguments.get("command"), "requested_tier": arguments.get("requested_tier"),
            "reason": arguments.get("reason"), "mode": "agent", "effect": "idempotent",
        });
        let body: TaskBody = serde_json::from_value(body).map_err(|e| failed(format!("arguments: {e}")))?;
        let req = TaskRequest::parse(body, &self.config.sandbox).map_err(failed)?;
        let Some(principal) = who.principal_id else {
            return Err(failed("this turn has no principal to start a task as"));
        };
        let (task, _) =
            airlock_sandbox::service::submit_keyed(&self.pool, principal, who.agent, &req, Some(who.idempotency_key))
                .await
                .map_err(|e| match e {
                    airlock_sandbox::SandboxError::Db(_) | airlock_sandbox::SandboxError::Queue(_) => {
                        CallError::Retry(e.to_string())
                    }
                    other => failed(other.to_string()),
                })?;
        let wait = std::time::Duration::from_secs(self.config.agent.sandbox_wait_seconds);
        let until = tokio::time::Instant::now() + wait;
        loop {
            let t = airlock_sandbox::store::get_task(&self.pool, task.id)
                .await
                .map_err(|e| CallError::Retry(e.to_string()))?
                .ok_or_else(|| CallError::Retry("the task vanished".into()))?;
            if t.state.is_terminal() {
                let view = airlock_sandbox::view::task(&self.pool, &t, false)
                    .await
                    .map_err(|e| CallError::Retry(e.to_string()))?;
                return if t.state == airlock_sandbox::state::TaskState::Succeeded {
                    Ok(view)
                } else {
                    Err(CallError::Failed(view))
                };
            }
            if tokio::time::Instant::now() >= until {
                return Err(failed(format!(
                    "task {} did not end within {} s (agent.sandbox_wait_seconds); it is {}",
                    t.id,
                    wait.as_secs(),
                    t.state.as_str()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    async fn capsule_journal(&self, agent: &str) -> Result<Option<(Journal, Option<String>)>, CallError> {
        let Ok(id) = AgentId::parse(agent) else { return Ok(None) };
        let archive = self.archive.clone();
        let cap = tokio::task::spawn_blocking(move || archive.get_checkpoint(&id))
            .await
            .map_err(|e| CallError::Retry(e.to_string()))?
            .map_err(|e| CallError::Retry(format!("capsule archive: {e}")))?;
        let Some(cap) = cap else { return Ok(None) };
        let journal = cap.journal().map_err(|e| failed(format!("the capsule's journal cannot be read: {e}")))?;
        let memory = cap.files.get(WORKING_MEMORY).map(|b| String::from_utf8_lossy(b).into_owned());
        Ok(Some((journal, memory)))
    }

    /// The agent's capsule journal (if it has a capsule), for a turn's context.
    pub async fn journal_of(&self, agent: &str) -> Result<Option<Journal>, CallError> {
        Ok(self.capsule_journal(agent).await?.map(|(j, _)| j))
    }

    async fn memory(&self, agent: &str) -> Result<Value, CallError> {
        match self.capsule_journal(agent).await? {
            None => Err(failed("this agent has no capsule, so no working memory")),
            Some((_, None)) => Ok(json!({"working_memory": ""})),
            Some((_, Some(m))) => Ok(json!({"working_memory": m})),
        }
    }

    async fn search(&self, agent: &str, query: &str, limit: usize) -> Result<Value, CallError> {
        let capsule = self.capsule_journal(agent).await?.map(|(j, _)| j);
        let stored = crate::context::stored_lines(&self.pool, agent, "", self.config.agent.journal_read_bytes)
            .await
            .map_err(|e| CallError::Retry(e.to_string()))?;
        let journal = crate::context::merged(capsule.as_ref(), &stored)
            .map_err(|e| failed(format!("the agent's journal cannot be read: {e}")))?;
        let needle = query.to_lowercase();
        let mut hits: Vec<Value> = Vec::new();
        let events: Vec<_> = journal.events().collect();
        for e in events.into_iter().rev() {
            let text = match e.kind {
                EventKind::Message => e.data.get("text").and_then(Value::as_str).map(str::to_string),
                EventKind::ToolCall => Some(format!(
                    "{} {}",
                    e.data.get("name").and_then(Value::as_str).unwrap_or_default(),
                    e.data.get("arguments").cloned().unwrap_or_default()
                )),
                EventKind::ToolResult => e.data.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            };
            let Some(text) = text.filter(|t| t.to_lowercase().contains(&needle)) else { continue };
            let excerpt: String = text.chars().take(500).collect();
            hits.push(json!({"at": e.at, "kind": e.kind, "role": e.data.get("role"), "text": excerpt}));
            if hits.len() == limit {
                break;
            }
        }
        Ok(json!({"query": query, "matches": hits}))
    }
}
