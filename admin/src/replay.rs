//! `airlock-admin replay-eval`: a run's replay log as an evaluation fixture. Every recorded
//! model decision that carries the request it answered is asked again of another model,
//! with that request (the recorded trajectory as its context); both answers are parsed as
//! actions (`airlock.action.v1`; free text is compared as text) and reported per step,
//! `same` or `diverged`. No tool is called, no effect happens, and the run is not changed:
//! this reads the log and talks to the model, nothing else.

use airlock_agent::protocol;
use airlock_agent::provider::Provider;
use airlock_core::config::models::{Endpoint, StructuredOutput};
use airlock_core::ids::RunId;
use airlock_runs::steps::{self, StepKind};
use serde_json::{Value, json};

/// One compared decision.
pub struct Compared {
    pub seq: i64,
    pub step_id: String,
    pub same: bool,
    pub recorded: Value,
    pub candidate: Value,
}

/// The recorded assistant text of a `model_output` step's `data.response`: the completion
/// as the server sent it, or its text.
fn recorded_text(response: &Value) -> Option<String> {
    match response {
        Value::String(s) => Some(s.clone()),
        v => v["choices"][0]["message"]["content"].as_str().or_else(|| v["content"].as_str()).map(str::to_string),
    }
}

/// An answer as compared: the action, or the text when it is not one.
fn as_compared(text: &str) -> Value {
    match protocol::parse(text) {
        Ok(action) => action.to_json(),
        Err(_) => json!({"text": text.trim()}),
    }
}

/// Asks `model` at `endpoint` every recorded decision of `run`.
pub async fn evaluate(
    pool: &sqlx::PgPool,
    run: RunId,
    endpoint: &str,
    model: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<Vec<Compared>> {
    let endpoint = Endpoint::parse(endpoint).map_err(|why| anyhow::anyhow!("--endpoint: {why}"))?;
    airlock_runs::run::get_any(pool, run).await?.ok_or_else(|| anyhow::anyhow!("no run {run}"))?;
    let provider = Provider::with(endpoint, model, timeout, StructuredOutput::None)?;
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = steps::list(pool, run, after, 500).await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        for step in page.iter().filter(|s| s.kind == StepKind::ModelOutput) {
            let (Some(request), Some(recorded)) = (
                step.data.get("request").filter(|r| r["messages"].is_array()),
                step.data.get("response").and_then(recorded_text),
            ) else {
                continue;
            };
            let mut body = request.clone();
            body["model"] = json!(model);
            let answer = provider.complete(&body).await?;
            let (recorded, candidate) = (as_compared(&recorded), as_compared(&answer.content));
            out.push(Compared {
                seq: step.seq,
                step_id: step.step_id.clone(),
                same: recorded == candidate,
                recorded,
                candidate,
            });
        }
    }
    Ok(out)
}

/// Prints the report: a line per decision, or one JSON document.
pub fn print(run: RunId, model: &str, compared: &[Compared], as_json: bool) {
    let diverged = compared.iter().filter(|c| !c.same).count();
    if as_json {
        let steps: Vec<Value> = compared
            .iter()
            .map(|c| {
                json!({"seq": c.seq, "step_id": c.step_id, "verdict": if c.same { "same" } else { "diverged" },
                       "recorded": c.recorded, "candidate": c.candidate})
            })
            .collect();
        let doc = json!({"run_id": run, "model": model, "decisions": compared.len(), "same": compared.len() - diverged,
                         "diverged": diverged, "steps": steps});
        println!("{doc}");
        return;
    }
    for c in compared {
        if c.same {
            println!("step {} (seq {}): same", c.step_id, c.seq);
        } else {
            println!(
                "step {} (seq {}): diverged\n  recorded:  {}\n  candidate: {}",
                c.step_id, c.seq, c.recorded, c.candidate
            );
        }
    }
    println!("{} decisions: {} same, {} diverged", compared.len(), compared.len() - diverged, diverged);
}
