//! A scripted agent process that drives one durable run over the agent API, as any
//! resumable client would (docs/runs.md): claim the run, read its log, then do every step
//! of a fixed script, each of which is a replay when it was done before. Used by the
//! crash-convergence suites, which kill it at every step boundary and start it again.
//!
//! The script: record `plan`; effect `charge` (idempotent: `POST <receiver>/charge`);
//! record `observe` (what the charge answered); effect `notify` (non-repeatable:
//! `POST <receiver>/notify`); submit the webhook delivery `report`; record `final`;
//! complete the run.
//!
//! Usage: `airlock-scripted-agent --api URL --token TOKEN --run ID --receiver URL`.
//! `AIRLOCK_AGENT_CRASH_AT=<boundary>` aborts the process at that boundary (as abruptly as
//! a SIGKILL): `before:<op>` or `after:<op>`, where `<op>` is one of
//! [`airlock_tests::scripted::OPS`].
//! Exit status: 0 completed, 3 the run waits for a human, 4 the run ended otherwise,
//! 1 on an unexpected answer.

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

struct Agent {
    http: reqwest::Client,
    api: String,
    token: String,
    run: String,
    receiver: String,
    crash_at: Option<String>,
    epoch: i64,
}

impl Agent {
    /// Aborts the process when `AIRLOCK_AGENT_CRASH_AT` names this boundary.
    fn boundary(&self, when: &str, op: &str) {
        if self.crash_at.as_deref() == Some(&format!("{when}:{op}")) {
            eprintln!("scripted agent: crashing at {when}:{op}");
            std::process::abort();
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
        let mut req = self.http.request(method, format!("{}{path}", self.api)).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.with_context(|| format!("calling {path}"))?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    async fn op<T>(&self, op: &str, f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
        self.boundary("before", op);
        let out = f.await?;
        self.boundary("after", op);
        Ok(out)
    }

    async fn record(&self, step_id: &str, kind: &str, data: Value) -> anyhow::Result<Value> {
        let body = json!({"epoch": self.epoch, "step_id": step_id, "kind": kind, "data": data});
        let (s, v) = self.call(reqwest::Method::POST, &format!("/v1/runs/{}/steps", self.run), Some(body)).await?;
        match s {
            201 | 200 => Ok(v["data"].clone()),
            _ => bail!("recording {step_id}: {s} {v}"),
        }
    }

    /// Does effect `step_id` once: begins it, performs the write unless its outcome is on
    /// record, records the outcome. `None`: the run waits for a human.
    async fn effect(&self, step_id: &str, class: &str, path: &str) -> anyhow::Result<Option<Value>> {
        let begin = json!({"epoch": self.epoch, "step_id": step_id, "effect_class": class,
                           "target": format!("{}{path}", self.receiver), "description": format!("POST {path}")});
        let (s, e) = self
            .op(
                &format!("begin:{step_id}"),
                self.call(reqwest::Method::POST, &format!("/v1/runs/{}/effects", self.run), Some(begin)),
            )
            .await?;
        match (s, e["state"].as_str()) {
            (200, Some("succeeded" | "failed")) => return Ok(Some(e["result"].clone())),
            (202, Some("awaiting_human")) => return Ok(None),
            (201 | 200, Some("started")) => {}
            _ => bail!("beginning {step_id}: {s} {e}"),
        }
        let key = e["idempotency_key"].as_str().context("idempotency_key")?.to_string();
        let attempt = e["attempt"].as_i64().context("attempt")?;
        let status = self
            .op(&format!("write:{step_id}"), async {
                let r = self
                    .http
                    .post(format!("{}{path}", self.receiver))
                    .header("Idempotency-Key", &key)
                    .json(&json!({"step": step_id}))
                    .send()
                    .await?;
                Ok(r.status().as_u16())
            })
            .await?;
        let outcome = if (200..300).contains(&status) { "succeeded" } else { "failed" };
        let result = json!({"status": status, "key": key});
        let body = json!({"epoch": self.epoch, "attempt": attempt, "outcome": outcome, "result": result});
        let (s, v) = self
            .op(
                &format!("outcome:{step_id}"),
                self.call(
                    reqwest::Method::POST,
                    &format!("/v1/runs/{}/effects/{step_id}/outcome", self.run),
                    Some(body),
                ),
            )
            .await?;
        if s != 200 {
            bail!("recording the outcome of {step_id}: {s} {v}");
        }
        Ok(Some(v["result"].clone()))
    }

    async fn script(&mut self) -> anyhow::Result<i32> {
        let (s, run) =
            self.op("claim", self.call(reqwest::Method::POST, &format!("/v1/runs/{}/claim", self.run), None)).await?;
        match (s, run["state"].as_str()) {
            (200, Some("active")) => {}
            (200, Some("waiting")) => {}
            (409, _) | (200, _) => {
                let (_, r) = self.call(reqwest::Method::GET, &format!("/v1/runs/{}", self.run), None).await?;
                return Ok(if r["state"] == "completed" { 0 } else { 4 });
            }
            _ => bail!("claim: {s} {run}"),
        }
        self.epoch = run["epoch"].as_i64().context("epoch")?;
        let (s, log) = self
            .op("read_log", self.call(reqwest::Method::GET, &format!("/v1/runs/{}/steps?limit=1000", self.run), None))
            .await?;
        if s != 200 {
            bail!("reading the log: {s} {log}");
        }
        let done = log["items"].as_array().map_or(0, Vec::len);
        eprintln!("scripted agent: epoch {}, {done} steps recorded before", self.epoch);

        let plan = self
            .op("record:plan", self.record("plan", "model_output", json!({"plan": ["charge", "notify", "report"]})))
            .await?;
        if plan["plan"][0] != "charge" {
            bail!("the recorded plan is not this script's: {plan}");
        }
        let Some(charged) = self.effect("charge", "idempotent", "/charge").await? else { return Ok(3) };
        self.op("record:observe", self.record("observe", "tool_result", json!({"charged": charged}))).await?;
        let Some(notified) = self.effect("notify", "non_repeatable", "/notify").await? else { return Ok(3) };
        let report = json!({"run_id": self.run, "step_id": "report", "channel": "webhook",
                            "webhook": {"url": format!("{}/report", self.receiver), "body": {"charged": charged}, "headers": {}}});
        let (s, v) = self.op("submit:report", self.call(reqwest::Method::POST, "/v1/deliveries", Some(report))).await?;
        if s != 201 && s != 200 {
            bail!("submitting the report: {s} {v}");
        }
        self.op("record:final", self.record("final", "note", json!({"notified": notified}))).await?;
        let result = json!({"charged": charged, "notified": notified});
        let (s, v) = self
            .op(
                "complete",
                self.call(
                    reqwest::Method::POST,
                    &format!("/v1/runs/{}/complete", self.run),
                    Some(json!({"epoch": self.epoch, "result": result})),
                ),
            )
            .await?;
        if s != 200 {
            bail!("completing: {s} {v}");
        }
        Ok(0)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (mut api, mut token, mut run, mut receiver) = (None, None, None, None);
    while let Some(a) = args.next() {
        let v = args.next();
        match a.as_str() {
            "--api" => api = v,
            "--token" => token = v,
            "--run" => run = v,
            "--receiver" => receiver = v,
            _ => {
                eprintln!("usage: airlock-scripted-agent --api URL --token TOKEN --run ID --receiver URL");
                std::process::exit(2);
            }
        }
    }
    let (Some(api), Some(token), Some(run), Some(receiver)) = (api, token, run, receiver) else {
        eprintln!("usage: airlock-scripted-agent --api URL --token TOKEN --run ID --receiver URL");
        std::process::exit(2);
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let crash_at = std::env::var("AIRLOCK_AGENT_CRASH_AT").ok().filter(|c| !c.is_empty());
    let http = reqwest::Client::builder().no_proxy().build().expect("HTTP client");
    let mut agent = Agent { http, api, token, run, receiver, crash_at, epoch: 0 };
    let code = match agent.script().await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("scripted agent: {e:#}");
            1
        }
    };
    std::process::exit(code);
}
