//! The turn engine: one execution of an `agent.turn` job drives a turn as far as it can go
//! (its end, a human's authorization, or a human's settling of an effect).
//!
//! Record or replay: every round's model answer, every tool result, and every effect is a
//! step of the run, named under the turn's step (`<step>/r<N>/model`, `/repair`, `/call`,
//! `/result`, and `<step>/deliver`). A driver that takes over after another died replays
//! what is recorded and asks the model only for the rounds it has no answer for; idempotent
//! calls are issued again with the same key; a non-repeatable call that began without an
//! outcome is left to a human (the run's effect resolution).
//!
//! Each execution claims the run (its holder is `turn:<id>`), and every write names the
//! epoch it holds: a driver that lost its job changes nothing. Before every effect and after
//! every model reply the driver checks that the turn is still its own and not cancelled.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use airlock_capsule::archive::Archive;
use airlock_capsule::journal::Journal;
use airlock_core::config::Config;
use airlock_core::config::agent::ToolEffect;
use airlock_core::config::models::StructuredOutput;
use airlock_core::fault;
use airlock_core::ids::{DeliveryId, TurnId};
use airlock_delivery::artifact::canonical_sha256;
use airlock_queue::{Lease, Waker};
use airlock_runs::budget::Usage;
use airlock_runs::effects::{self, BeginEffect, Begun, Outcome};
use airlock_runs::steps::{self, NewStep, Recorded, Step, StepKind};
use airlock_runs::{RunError, RunState};
use serde_json::{Map, Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::authorization::{self, AuthorizationState};
use crate::catalogue::{Catalogue, Tool, ToolKind};
use crate::context::{self, Transcript};
use crate::protocol::{self, Action, ProtocolError};
use crate::provider::Provider;
use crate::tools::{CallError, Caller, ToolBox, Transport};
use crate::turn::{self, Ending, Turn, TurnState};

/// How an execution left the turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drove {
    /// The turn ended (now or before).
    Ended(TurnState),
    /// A non-repeatable call waits for a human; the job was completed with the pause.
    Paused,
    /// The run waits for a human to settle an effect; the job was completed with the wait.
    Waiting,
    /// Another driver holds the turn, or nothing is left to do here.
    NotMine,
    /// Another turn of the same run is being driven (turns of one run take it one at a
    /// time): the job runs again shortly and resumes this turn from its log.
    Busy,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Infrastructure failed: run the job again later.
    #[error("{0}")]
    Retry(String),
    /// The worker is stopping: the job runs again elsewhere.
    #[error("the worker is stopping")]
    Stopped,
}

fn retry(e: impl std::fmt::Display) -> EngineError {
    EngineError::Retry(e.to_string())
}

impl From<sqlx::Error> for EngineError {
    fn from(e: sqlx::Error) -> Self {
        retry(e)
    }
}

/// Either go on with a value, or stop the execution with how it left the turn.
enum Flow<T> {
    Go(T),
    Stop(Drove),
}

macro_rules! go {
    ($e:expr) => {
        match $e {
            Flow::Go(v) => v,
            Flow::Stop(d) => return Ok(Flow::Stop(d)),
        }
    };
}

/// One model answer, as recorded.
struct Answer {
    text: String,
    reasoning: Option<String>,
    at: String,
}

/// A driver's state during one execution.
struct Driver {
    turn: Turn,
    epoch: i64,
    lease: Lease,
    steps: HashMap<String, Step>,
    transcript: Transcript,
    journal: Journal,
    rounds: i32,
    tool_calls: i32,
    prompt: String,
}

impl Driver {
    fn step_id(&self, round: i32, what: &str) -> String {
        format!("{}/r{round}/{what}", self.turn.step_id)
    }
}

/// Drives turns.
pub struct Engine {
    pub pool: PgPool,
    pub config: Arc<Config>,
    pub catalogue: Arc<Catalogue>,
    pub tools: ToolBox,
    providers: BTreeMap<String, Provider>,
}

impl Engine {
    /// The engine of a process: the catalogue and a client for each configured model.
    /// A configuration it cannot serve is refused, naming the key.
    pub fn new(
        pool: PgPool,
        config: Arc<Config>,
        waker: Waker,
        archive: Arc<dyn Archive>,
        transport: Option<Arc<dyn Transport>>,
    ) -> Result<Self, String> {
        let catalogue = Arc::new(Catalogue::from_config(&config)?);
        let mut providers = BTreeMap::new();
        for (name, m) in &config.models {
            providers.insert(name.clone(), Provider::new(m).map_err(|e| format!("models.{name}: {e}"))?);
        }
        let tools = ToolBox { pool: pool.clone(), config: config.clone(), waker, archive, transport };
        Ok(Self { pool, config, catalogue, tools, providers })
    }

    /// Drives turn `id` under the job `lease`, as far as it goes. `stop` fires when the
    /// worker stops or loses the lease.
    pub async fn drive(&self, id: TurnId, lease: Lease, stop: &CancellationToken) -> Result<Drove, EngineError> {
        let Some(t) = turn::get(&self.pool, id, None).await? else { return Ok(Drove::NotMine) };
        if t.state.is_terminal() {
            return Ok(Drove::Ended(t.state));
        }
        if t.state == TurnState::AuthorizationRequired {
            return Ok(Drove::NotMine);
        }
        if self.another_turn_drives(&t).await? {
            return Ok(Drove::Busy);
        }
        let run = match airlock_runs::run::claim(&self.pool, t.run_id, &t.agent, &format!("turn:{id}")).await {
            Ok(r) => r,
            Err(RunError::InvalidTransition(_) | RunError::NotFound(_)) => return self.end_with_run(&t).await,
            Err(e) => return Err(retry(e)),
        };
        let Some(t) = turn::start(&self.pool, id, run.epoch).await? else { return Ok(Drove::NotMine) };
        if run.state == RunState::Waiting {
            let on = run.waiting_on.clone().unwrap_or_default();
            turn::event(&self.pool, id, &format!("waiting:{on}:{}", run.epoch), "waiting", &json!({"on": on})).await?;
            return self.wait(id, t.run_id, lease).await;
        }
        let Some(model) = self.config.models.get(&t.model) else {
            return self
                .end_now(
                    &t,
                    run.epoch,
                    Ending::failed(
                        TurnState::Failed,
                        "MODEL_NOT_CONFIGURED",
                        format!("models.{} is not configured in this worker", t.model),
                    ),
                    0,
                    0,
                )
                .await;
        };
        let _ = model;
        let steps: HashMap<String, Step> = steps::list_under(&self.pool, t.run_id, &format!("{}/", t.step_id))
            .await?
            .into_iter()
            .map(|s| (s.step_id.clone(), s))
            .collect();
        let capsule = self.tools.journal_of(&t.agent).await.map_err(retry)?;
        // Without a capsule the context is the turn's own chain; with one, the capsule's
        // journal and the agent's newest turns within `agent.journal_read_bytes`.
        let budget = if capsule.is_some() { self.config.agent.journal_read_bytes } else { 0 };
        let stored = context::stored_lines(&self.pool, &t.agent, &context::machine(id), budget).await?;
        let journal =
            context::merged(capsule.as_ref(), &stored).map_err(|e| retry(format!("the agent's journal: {e}")))?;
        let prompt = self.catalogue.prompt(&t.instructions, &t.tools);
        let mut transcript = Transcript::default();
        transcript.user(&t.input, &rfc3339(t.created_at));
        let mut d =
            Driver { epoch: run.epoch, lease, steps, transcript, journal, rounds: 0, tool_calls: 0, prompt, turn: t };
        match self.rounds(&mut d, stop).await? {
            Flow::Stop(drove) => Ok(drove),
            Flow::Go(()) => Ok(Drove::NotMine),
        }
    }

    async fn rounds(&self, d: &mut Driver, stop: &CancellationToken) -> Result<Flow<()>, EngineError> {
        let limits = d.turn.limits.0;
        let mut last_failure: Option<(String, String)> = None;
        for n in 1.. {
            if n > limits.max_rounds as i32 {
                let e = Ending::failed(
                    TurnState::Failed,
                    "ROUND_LIMIT",
                    format!("the turn used its {} rounds without a final answer", limits.max_rounds),
                );
                return self.end(d, e).await.map(Flow::Stop);
            }
            d.rounds = n;
            let first = go!(self.answer(d, n, "model", stop).await?);
            let action = match self.check(&d.turn, &first.text) {
                Ok(a) => {
                    d.transcript.assistant(&d.turn.model, &first.text, first.reasoning.as_deref(), &first.at);
                    a
                }
                Err(why) => {
                    d.transcript.assistant(&d.turn.model, &first.text, first.reasoning.as_deref(), &first.at);
                    d.transcript.user(&repair_request(&why), &first.at);
                    let key = format!("refused:r{n}/model");
                    turn::event(
                        &self.pool,
                        d.turn.id,
                        &key,
                        "protocol_refused",
                        &json!({"round": n, "code": why.code(), "message": why.to_string()}),
                    )
                    .await?;
                    let second = go!(self.answer(d, n, "repair", stop).await?);
                    match self.check(&d.turn, &second.text) {
                        Ok(a) => {
                            d.transcript.assistant(
                                &d.turn.model,
                                &second.text,
                                second.reasoning.as_deref(),
                                &second.at,
                            );
                            a
                        }
                        Err(again) => {
                            let e = Ending::failed(
                                TurnState::ModelProtocolError,
                                "MODEL_PROTOCOL_ERROR",
                                format!("round {n}: {why}; after the repair request: {again}"),
                            );
                            return self.end(d, e).await.map(Flow::Stop);
                        }
                    }
                }
            };
            match action {
                Action::Final { text } => return self.finish(d, text).await.map(Flow::Stop),
                Action::ToolCall { tool_id, arguments } => {
                    if d.tool_calls >= limits.max_tool_calls as i32 {
                        let e = Ending::failed(
                            TurnState::Failed,
                            "TOOL_CALL_LIMIT",
                            format!("the model asked for more than the turn's {} tool calls", limits.max_tool_calls),
                        );
                        return self.end(d, e).await.map(Flow::Stop);
                    }
                    let args = Value::Object(arguments.clone());
                    let this = (tool_id.clone(), canonical_sha256(&args));
                    if last_failure.as_ref() == Some(&this) {
                        let e = Ending::failed(
                            TurnState::Failed,
                            "REPEATED_FAILURE",
                            format!(
                                "the model repeated the call of `{tool_id}` that had just failed, with the same arguments"
                            ),
                        );
                        return self.end(d, e).await.map(Flow::Stop);
                    }
                    d.tool_calls += 1;
                    let call_step = d.step_id(n, "call");
                    let at = d.transcript.items.last().map(|i| i.at.clone()).unwrap_or_default();
                    d.transcript.call(&call_step, &tool_id, &args, &at);
                    let (ok, result, at) = go!(self.tool_result(d, n, &tool_id, &arguments, stop).await?);
                    d.transcript.result(&call_step, &tool_id, &result, !ok, &at);
                    last_failure = (!ok).then_some(this);
                    if !turn::progress(&self.pool, d.turn.id, d.epoch, d.rounds, d.tool_calls).await? {
                        return Ok(Flow::Stop(self.stopped(d).await?));
                    }
                }
            }
        }
        Ok(Flow::Go(()))
    }

    /// The strict parse, then the catalogue's check (the turn's tools, their schemas).
    fn check(&self, t: &Turn, text: &str) -> Result<Action, ProtocolError> {
        let action = protocol::parse(text)?;
        self.catalogue.check(&t.tools, &action)?;
        Ok(action)
    }

    /// Round `n`'s answer (`which`: `model`, or `repair`): recorded, or asked now.
    async fn answer(
        &self,
        d: &mut Driver,
        n: i32,
        which: &str,
        stop: &CancellationToken,
    ) -> Result<Flow<Answer>, EngineError> {
        let step_id = d.step_id(n, which);
        if let Some(s) = d.steps.get(&step_id) {
            return Ok(Flow::Go(recorded_answer(s)));
        }
        if !turn::still_driven(&self.pool, d.turn.id, d.epoch).await? {
            return Ok(Flow::Stop(self.stopped(d).await?));
        }
        let (Some(provider), Some(model)) = (self.providers.get(&d.turn.model), self.config.models.get(&d.turn.model))
        else {
            return Ok(Flow::Stop(
                self.end(
                    d,
                    Ending::failed(TurnState::Failed, "MODEL_NOT_CONFIGURED", "the turn's model is not configured"),
                )
                .await?,
            ));
        };
        self.sync_journal(d).await?;
        let limits = d.turn.limits.0;
        let window = ((model.context_tokens as usize) * 3 / 4).min(limits.max_context_bytes / 4);
        let rendered = context::render_for(&d.journal, &d.turn.model, &d.prompt, window, &context::machine(d.turn.id));
        let schema =
            (model.structured_output != StructuredOutput::None).then(|| self.catalogue.action_schema(&d.turn.tools));
        let body = provider.request(&rendered.messages, schema.as_ref());
        let context_bytes = serde_json::to_vec(&body["messages"]).map(|b| b.len()).unwrap_or(usize::MAX);
        if context_bytes > limits.max_context_bytes {
            let e = Ending::failed(
                TurnState::Failed,
                "CONTEXT_LIMIT",
                format!(
                    "the smallest context of round {n} is {context_bytes} bytes, above the turn's {} (limits.max_context_bytes)",
                    limits.max_context_bytes
                ),
            );
            return Ok(Flow::Stop(self.end(d, e).await?));
        }
        let reply = tokio::select! {
            r = provider.complete(&body) => r,
            _ = stop.cancelled() => return Err(EngineError::Stopped),
        };
        fault::hit("turn.model.replied").await.map_err(retry)?;
        let completion = match reply {
            Ok(c) => c,
            Err(e) => {
                metrics::counter!(airlock_core::metrics::TURN_MODEL_CALLS, "model" => d.turn.model.clone(), "outcome" => "unavailable").increment(1);
                return Ok(Flow::Stop(
                    self.end(d, Ending::failed(TurnState::ModelUnavailable, "MODEL_UNAVAILABLE", e.to_string()))
                        .await?,
                ));
            }
        };
        // A reply that arrives after the turn was cancelled is ignored.
        if !turn::still_driven(&self.pool, d.turn.id, d.epoch).await? {
            metrics::counter!(airlock_core::metrics::TURN_MODEL_CALLS, "model" => d.turn.model.clone(), "outcome" => "ignored").increment(1);
            return Ok(Flow::Stop(self.stopped(d).await?));
        }
        metrics::counter!(airlock_core::metrics::TURN_MODEL_CALLS, "model" => d.turn.model.clone(), "outcome" => "ok")
            .increment(1);
        let tokens = completion.usage.total_tokens;
        let usage = Usage { tokens, cost_micros: cost_micros(tokens, model.cost_micros_per_1k_tokens) };
        let reasoning = completion.raw["choices"][0]["message"]["reasoning_content"].as_str().map(str::to_string);
        let data = json!({
            "round": n, "attempt": which, "model": d.turn.model, "request": body, "response": completion.raw,
            "content": completion.content, "reasoning": reasoning, "usage": completion.usage, "context_cut": rendered.cut,
        });
        let new = NewStep { step_id: &step_id, kind: StepKind::ModelOutput, data: &data, usage };
        let step = match steps::record(&self.pool, d.turn.run_id, &d.turn.agent, d.epoch, &new).await {
            Ok(Recorded::New(s) | Recorded::Replayed(s)) => s,
            Err(e) => return self.run_refused(d, e).await.map(Flow::Stop),
        };
        fault::hit("turn.model.recorded").await.map_err(retry)?;
        let answer = recorded_answer(&step);
        d.steps.insert(step_id, step);
        Ok(Flow::Go(answer))
    }

    /// The result of round `n`'s call: recorded, or the call made now as its effect class
    /// requires. `(ok, result, at)`.
    async fn tool_result(
        &self,
        d: &mut Driver,
        n: i32,
        tool_id: &str,
        arguments: &Map<String, Value>,
        stop: &CancellationToken,
    ) -> Result<Flow<(bool, Value, String)>, EngineError> {
        let result_step = d.step_id(n, "result");
        if let Some(s) = d.steps.get(&result_step) {
            let ok = s.data["ok"].as_bool().unwrap_or(false);
            return Ok(Flow::Go((ok, s.data["result"].clone(), rfc3339(s.recorded_at))));
        }
        let Some(tool) = self.catalogue.get(tool_id).cloned() else {
            return Ok(Flow::Stop(
                self.end(
                    d,
                    Ending::failed(
                        TurnState::Failed,
                        "TOOL_NOT_CONFIGURED",
                        format!("`{tool_id}` is not configured in this worker"),
                    ),
                )
                .await?,
            ));
        };
        if !turn::still_driven(&self.pool, d.turn.id, d.epoch).await? {
            return Ok(Flow::Stop(self.stopped(d).await?));
        }
        let (ok, result) = go!(self.call(d, n, &tool, arguments, stop).await?);
        let result = bounded(result, d.turn.limits.0.max_result_bytes);
        metrics::counter!(airlock_core::metrics::TURN_TOOL_CALLS, "tool" => tool.id.clone(), "outcome" => if ok { "ok" } else { "failed" }).increment(1);
        let data = json!({"round": n, "tool_id": tool_id, "arguments": arguments, "ok": ok, "result": result});
        let new = NewStep { step_id: &result_step, kind: StepKind::ToolResult, data: &data, usage: Usage::default() };
        let step = match steps::record(&self.pool, d.turn.run_id, &d.turn.agent, d.epoch, &new).await {
            Ok(Recorded::New(s) | Recorded::Replayed(s)) => s,
            Err(e) => return self.run_refused(d, e).await.map(Flow::Stop),
        };
        fault::hit("turn.tool.result").await.map_err(retry)?;
        turn::event(
            &self.pool,
            d.turn.id,
            &format!("result:r{n}"),
            "tool_result",
            &json!({"round": n, "tool_id": tool_id, "ok": ok}),
        )
        .await?;
        let ok = step.data["ok"].as_bool().unwrap_or(false);
        let out = (ok, step.data["result"].clone(), rfc3339(step.recorded_at));
        d.steps.insert(result_step, step);
        Ok(Flow::Go(out))
    }

    /// Makes round `n`'s call of `tool`. `(ok, result)`.
    async fn call(
        &self,
        d: &mut Driver,
        n: i32,
        tool: &Tool,
        arguments: &Map<String, Value>,
        stop: &CancellationToken,
    ) -> Result<Flow<(bool, Value)>, EngineError> {
        let call_step = d.step_id(n, "call");
        let key = effects::idempotency_key(d.turn.run_id, &call_step);
        let who = Caller {
            agent: &d.turn.agent,
            principal_id: d.turn.principal_id,
            run_id: d.turn.run_id,
            call_step: &call_step,
            idempotency_key: &key,
        };
        turn::event(
            &self.pool,
            d.turn.id,
            &format!("call:r{n}"),
            "tool_call",
            &json!({"round": n, "tool_id": tool.id, "arguments": arguments}),
        )
        .await?;
        // A delivery is its own step of the run: the same call again is the same delivery.
        if matches!(tool.kind, ToolKind::Email | ToolKind::Webhook) || tool.effect == ToolEffect::Pure {
            fault::hit("turn.tool.begun").await.map_err(retry)?;
            let r = self.invoke(tool, arguments, who, stop).await?;
            fault::hit("turn.tool.called").await.map_err(retry)?;
            return self.settled(d, r).await;
        }
        if tool.effect == ToolEffect::NonRepeatable {
            match authorization::of_call(&self.pool, d.turn.id, &call_step).await? {
                None => return self.pause(d, &call_step, tool, arguments).await.map(Flow::Stop),
                Some(a) if a.state == AuthorizationState::Pending => return Ok(Flow::Stop(Drove::NotMine)),
                Some(a) if a.state == AuthorizationState::Denied => {
                    metrics::counter!(airlock_core::metrics::TURN_TOOL_CALLS, "tool" => tool.id.clone(), "outcome" => "denied").increment(1);
                    return Ok(Flow::Go((
                        false,
                        json!({"denied": true, "error": "a human denied this call: it did not run", "note": a.note}),
                    )));
                }
                Some(a) => {
                    if a.arguments_sha256 != canonical_sha256(&Value::Object(arguments.clone())) {
                        let e = Ending::failed(
                            TurnState::Failed,
                            "STALE_ARGUMENTS",
                            "the granted arguments are not the call's",
                        );
                        return Ok(Flow::Stop(self.end(d, e).await?));
                    }
                }
            }
        }
        let class = match tool.effect {
            ToolEffect::NonRepeatable => airlock_queue::EffectClass::NonRepeatable,
            _ => airlock_queue::EffectClass::Idempotent,
        };
        let target = match &tool.kind {
            ToolKind::Http { url } => url.clone(),
            _ => tool.id.clone(),
        };
        let description = format!("{} called by turn {}", tool.id, d.turn.id);
        let begin = BeginEffect {
            step_id: &call_step,
            effect_class: class,
            target: &target,
            description: &description,
            usage: Usage::default(),
        };
        let holder = format!("turn:{}", d.turn.id);
        let begun = match effects::begin(&self.pool, d.turn.run_id, &d.turn.agent, &holder, d.epoch, &begin).await {
            Ok(b) => b,
            Err(e) => return self.run_refused(d, e).await.map(Flow::Stop),
        };
        let (attempt, r) = match begun {
            Begun::Recorded(effect) => {
                let r = effect.result.unwrap_or(Value::Null);
                let ok = r["ok"].as_bool().unwrap_or(effect.state == effects::EffectState::Succeeded);
                let result = if r.get("result").is_some() { r["result"].clone() } else { r };
                return Ok(Flow::Go((ok, result)));
            }
            Begun::AwaitingHuman(_) => {
                turn::event(
                    &self.pool,
                    d.turn.id,
                    &format!("awaiting:r{n}"),
                    "awaiting_human",
                    &json!({"round": n, "step_id": call_step}),
                )
                .await?;
                return self.wait(d.turn.id, d.turn.run_id, d.lease).await.map(Flow::Stop);
            }
            Begun::Started { effect, .. } => {
                fault::hit("turn.tool.begun").await.map_err(retry)?;
                (effect.attempt, self.invoke(tool, arguments, who, stop).await?)
            }
        };
        fault::hit("turn.tool.called").await.map_err(retry)?;
        let (outcome, value) = match &r {
            Ok(v) => (Outcome::Succeeded, json!({"ok": true, "result": v})),
            Err(CallError::Failed(v)) => (Outcome::Failed, json!({"ok": false, "result": v})),
            Err(_) => return self.settled(d, r).await,
        };
        if let Err(e) = effects::record_outcome(
            &self.pool,
            d.turn.run_id,
            &d.turn.agent,
            &holder,
            d.epoch,
            &call_step,
            attempt,
            outcome,
            &value,
        )
        .await
        {
            return self.run_refused(d, e).await.map(Flow::Stop);
        }
        self.settled(d, r).await
    }

    async fn invoke(
        &self,
        tool: &Tool,
        arguments: &Map<String, Value>,
        who: Caller<'_>,
        stop: &CancellationToken,
    ) -> Result<Result<Value, CallError>, EngineError> {
        tokio::select! {
            r = self.tools.call(tool, arguments, who) => Ok(r),
            _ = stop.cancelled() => Err(EngineError::Stopped),
        }
    }

    /// A call's answer as the turn goes on with it.
    async fn settled(&self, d: &mut Driver, r: Result<Value, CallError>) -> Result<Flow<(bool, Value)>, EngineError> {
        match r {
            Ok(v) => Ok(Flow::Go((true, v))),
            Err(CallError::Failed(v)) => Ok(Flow::Go((false, v))),
            Err(CallError::BudgetExhausted) => Ok(Flow::Stop(
                self.end(
                    d,
                    Ending::failed(TurnState::BudgetExhausted, "BUDGET_EXHAUSTED", "the run's budget is spent"),
                )
                .await?,
            )),
            Err(CallError::RunGone(_)) => Ok(Flow::Stop(self.stopped_or_run_ended(d).await?)),
            Err(CallError::Retry(m)) => Err(EngineError::Retry(m)),
        }
    }

    /// Pauses the turn for a human's authorization of this call, completing the job in
    /// the same transaction (a decision then queues the turn again).
    async fn pause(
        &self,
        d: &mut Driver,
        call_step: &str,
        tool: &Tool,
        arguments: &Map<String, Value>,
    ) -> Result<Drove, EngineError> {
        let mut tx = self.pool.begin().await?;
        let args = Value::Object(arguments.clone());
        let asked =
            authorization::request(&mut tx, d.turn.id, d.turn.run_id, d.epoch, call_step, &tool.id, &args).await?;
        if asked.is_none() {
            drop(tx);
            return self.stopped(d).await;
        }
        sqlx::query("UPDATE agent_turns SET rounds = $2, tool_calls = $3 WHERE id = $1")
            .bind(d.turn.id)
            .bind(d.rounds)
            .bind(d.tool_calls)
            .execute(&mut *tx)
            .await?;
        airlock_queue::lease::complete(&mut *tx, d.lease).await.map_err(retry)?;
        tx.commit().await?;
        metrics::counter!(airlock_core::metrics::TURN_TOOL_CALLS, "tool" => tool.id.clone(), "outcome" => "awaiting")
            .increment(1);
        tracing::info!(turn.id = %d.turn.id, tool = %tool.id, "turn waits for a human's authorization");
        Ok(Drove::Paused)
    }

    /// The run waits for a human: the job is completed, and queued again at once if the
    /// human settled it meanwhile (so no decision is missed).
    async fn wait(&self, id: TurnId, run_id: airlock_core::ids::RunId, lease: Lease) -> Result<Drove, EngineError> {
        let mut tx = self.pool.begin().await?;
        let run = airlock_runs::run::lock(&mut tx, run_id, None).await?;
        airlock_queue::lease::complete(&mut *tx, lease).await.map_err(retry)?;
        if run.is_some_and(|r| r.state == RunState::Active) {
            turn::enqueue(&mut tx, id).await.map_err(retry)?;
        }
        tx.commit().await?;
        Ok(Drove::Waiting)
    }

    /// The final answer: delivered when the turn says so, then the turn completes.
    async fn finish(&self, d: &mut Driver, text: String) -> Result<Drove, EngineError> {
        let mut delivery_id: Option<DeliveryId> = None;
        if let Some(email) = d.turn.deliver.as_ref().and_then(|v| v.get("email")).cloned() {
            if !turn::still_driven(&self.pool, d.turn.id, d.epoch).await? {
                return self.stopped(d).await;
            }
            let artifact = match turn::final_artifact(&email, &text, &self.config) {
                Ok(a) => a,
                Err(e) => {
                    return self
                        .end(
                            d,
                            Ending::failed(
                                TurnState::Failed,
                                "DELIVERY_INVALID",
                                format!("the final text cannot be delivered: {e}"),
                            ),
                        )
                        .await;
                }
            };
            let step = format!("{}/deliver", d.turn.step_id);
            let key = effects::idempotency_key(d.turn.run_id, &step);
            let who = Caller {
                agent: &d.turn.agent,
                principal_id: d.turn.principal_id,
                run_id: d.turn.run_id,
                call_step: &step,
                idempotency_key: &key,
            };
            match self.tools.submit(artifact, who).await {
                Ok(v) => delivery_id = v["delivery_id"].as_str().and_then(|s| s.parse().ok()),
                Err(CallError::Failed(v)) => {
                    let e = Ending::failed(
                        TurnState::Failed,
                        "DELIVERY_REFUSED",
                        format!("the final text's delivery was refused: {}", v["error"].as_str().unwrap_or_default()),
                    );
                    return self.end(d, e).await;
                }
                Err(CallError::BudgetExhausted) => {
                    return self
                        .end(
                            d,
                            Ending::failed(TurnState::BudgetExhausted, "BUDGET_EXHAUSTED", "the run's budget is spent"),
                        )
                        .await;
                }
                Err(CallError::RunGone(_)) => return self.stopped_or_run_ended(d).await,
                Err(CallError::Retry(m)) => return Err(EngineError::Retry(m)),
            }
            fault::hit("turn.deliver.submitted").await.map_err(retry)?;
        }
        let ending = Ending { state: TurnState::Completed, final_text: Some(text), delivery_id, error: None };
        self.end(d, ending).await
    }

    async fn end(&self, d: &mut Driver, ending: Ending) -> Result<Drove, EngineError> {
        // What the turn went through is the agent's journal, to its last answer.
        self.sync_journal(d).await?;
        self.end_now(&d.turn, d.epoch, ending, d.rounds, d.tool_calls).await
    }

    /// Appends to the agent's journal what the transcript holds that it does not.
    async fn sync_journal(&self, d: &mut Driver) -> Result<(), EngineError> {
        let new_lines = context::append(&mut d.journal, d.turn.id, &d.transcript);
        let stored = context::store(&self.pool, &d.turn.agent, d.turn.id, &new_lines).await?;
        if stored != new_lines.len() as u64 {
            return Err(EngineError::Retry("the turn's journal was written by another driver meanwhile".into()));
        }
        Ok(())
    }

    async fn end_now(
        &self,
        t: &Turn,
        epoch: i64,
        ending: Ending,
        rounds: i32,
        tool_calls: i32,
    ) -> Result<Drove, EngineError> {
        let mut tx = self.pool.begin().await?;
        let ended = turn::end(&mut tx, t.id, epoch, &ending, rounds, tool_calls).await?;
        tx.commit().await?;
        if ended {
            tracing::info!(turn.id = %t.id, state = ending.state.as_str(), rounds, tool_calls, "turn ended");
            return Ok(Drove::Ended(ending.state));
        }
        self.now(t.id).await
    }

    /// Where the turn is, for a driver that no longer holds it.
    async fn now(&self, id: TurnId) -> Result<Drove, EngineError> {
        match turn::get(&self.pool, id, None).await? {
            Some(t) if t.state.is_terminal() => Ok(Drove::Ended(t.state)),
            _ => Ok(Drove::NotMine),
        }
    }

    /// The driver's epoch was refused. When the turn is still this driver's, another holder
    /// took the run (another turn of it, two having claimed at once): this turn is not
    /// over, so it is driven again once the run is free. Otherwise another driver has it.
    async fn stopped(&self, d: &Driver) -> Result<Drove, EngineError> {
        match turn::get(&self.pool, d.turn.id, None).await? {
            Some(t) if t.state.is_terminal() => Ok(Drove::Ended(t.state)),
            Some(t) if t.state == TurnState::Running && t.epoch == d.epoch => Ok(Drove::Busy),
            _ => Ok(Drove::NotMine),
        }
    }

    /// Whether another turn of `t`'s run holds the run and is being driven.
    async fn another_turn_drives(&self, t: &Turn) -> Result<bool, EngineError> {
        let Some(run) = airlock_runs::run::get_any(&self.pool, t.run_id).await? else { return Ok(false) };
        let Some(other) = run.holder.strip_prefix("turn:").and_then(|s| s.parse::<TurnId>().ok()) else {
            return Ok(false);
        };
        if other == t.id {
            return Ok(false);
        }
        Ok(turn::get(&self.pool, other, None).await?.is_some_and(|o| o.state == TurnState::Running))
    }

    /// The run refused a write: ended, taken by another holder, or over its budget.
    async fn run_refused(&self, d: &mut Driver, e: RunError) -> Result<Drove, EngineError> {
        match e {
            RunError::BudgetExhausted { limit } => {
                self.end(
                    d,
                    Ending::failed(
                        TurnState::BudgetExhausted,
                        "BUDGET_EXHAUSTED",
                        format!("the run's budget is spent: {limit}"),
                    ),
                )
                .await
            }
            RunError::StaleEpoch { .. } => self.stopped(d).await,
            RunError::InvalidTransition(_) => self.stopped_or_run_ended(d).await,
            RunError::Diverged { step_id, recorded, given } => {
                let e = Ending::failed(
                    TurnState::Failed,
                    "REPLAY_DIVERGED",
                    format!("step `{step_id}` was recorded as {recorded}, not {given}"),
                );
                self.end(d, e).await
            }
            e => Err(retry(e)),
        }
    }

    async fn stopped_or_run_ended(&self, d: &Driver) -> Result<Drove, EngineError> {
        let run = airlock_runs::run::get_any(&self.pool, d.turn.run_id).await?;
        match run {
            Some(r) if r.state.is_terminal() => self.end_with_run(&d.turn).await,
            Some(r) if r.state == RunState::Waiting => self.wait(d.turn.id, d.turn.run_id, d.lease).await,
            _ => self.stopped(d).await,
        }
    }

    /// The run ended under the turn: the turn ends with it.
    async fn end_with_run(&self, t: &Turn) -> Result<Drove, EngineError> {
        let run = airlock_runs::run::get_any(&self.pool, t.run_id).await?;
        let state = run.as_ref().map(|r| r.state);
        let ending = match state {
            Some(RunState::Cancelled) => Ending::failed(TurnState::Cancelled, "RUN_CANCELLED", "the run was cancelled"),
            Some(RunState::BudgetExhausted) => {
                Ending::failed(TurnState::BudgetExhausted, "BUDGET_EXHAUSTED", "the run's budget is spent")
            }
            Some(s) if s.is_terminal() => {
                Ending::failed(TurnState::Failed, "RUN_ENDED", format!("the run ended ({})", s.as_str()))
            }
            _ => return self.now(t.id).await,
        };
        let mut tx = self.pool.begin().await?;
        let ended = turn::end_any(&mut tx, t.id, &ending).await?;
        tx.commit().await?;
        if ended {
            return Ok(Drove::Ended(ending.state));
        }
        self.now(t.id).await
    }

    /// Ends a turn whose job failed for good, so no turn stays `running` behind a dead job.
    pub async fn give_up(&self, id: TurnId, message: &str) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        turn::end_any(&mut tx, id, &Ending::failed(TurnState::Failed, "INTERNAL", message)).await?;
        tx.commit().await
    }
}

fn recorded_answer(s: &Step) -> Answer {
    Answer {
        text: s.data["content"].as_str().unwrap_or_default().to_string(),
        reasoning: s.data["reasoning"].as_str().map(str::to_string),
        at: rfc3339(s.recorded_at),
    }
}

fn rfc3339(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The one repair request: what was wrong, and the contract again.
pub fn repair_request(why: &ProtocolError) -> String {
    format!(
        "Your answer was refused: {why}. Answer again with exactly one JSON object of the {} protocol and nothing \
         else: {{\"type\": \"tool_call\", \"tool_id\": ..., \"arguments\": {{...}}}} or {{\"type\": \"final\", \"text\": ...}}.",
        protocol::CONTRACT
    )
}

/// What `tokens` cost at `per_1k` millionths a thousand, rounded up.
pub fn cost_micros(tokens: i64, per_1k: i64) -> i64 {
    (tokens.max(0).saturating_mul(per_1k.max(0)) + 999) / 1000
}

/// A result as the model receives it: at most `max` bytes of JSON; beyond, its head as
/// text, and said so.
pub fn bounded(result: Value, max: usize) -> Value {
    let text = result.to_string();
    if text.len() <= max {
        return result;
    }
    let keep = max.saturating_sub(120);
    let mut cut = keep.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    json!({"truncated": true, "bytes": text.len(), "head": &text[..cut]})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_over_its_bound_is_cut_and_says_so() {
        let small = json!({"a": 1});
        assert_eq!(bounded(small.clone(), 1000), small);
        let big = json!({"text": "é".repeat(5000)});
        let b = bounded(big, 1000);
        assert_eq!(b["truncated"], true);
        assert!(b.to_string().len() <= 1000 + 64, "{}", b.to_string().len());
    }

    #[test]
    fn cost_is_rounded_up() {
        assert_eq!(cost_micros(0, 500), 0);
        assert_eq!(cost_micros(1, 500), 1);
        assert_eq!(cost_micros(2000, 500), 1000);
        assert_eq!(cost_micros(15, 0), 0);
    }
}
