//! The durable-run routes, each answer and error code of the contract: fencing on the
//! holder epoch after a claim, recorded steps returned as recorded, divergence, the
//! effect's answers, budgets exhausted by steps, tokens and cost with nothing recorded,
//! ceilings, cancellation, waiting and a human's settlement, deliveries in the run's log,
//! and agent isolation.
#![allow(clippy::unwrap_used)]

use airlock_tests::app::TestApp;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

/// A run client of one agent token.
struct Runs<'a> {
    app: &'a TestApp,
    token: String,
}

impl<'a> Runs<'a> {
    fn of(app: &'a TestApp) -> Self {
        Self { app, token: app.agent.clone() }
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.app.call("POST", &format!("{}{path}", self.app.api), Some(&self.token), Some(body)).await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.app.call("GET", &format!("{}{path}", self.app.api), Some(&self.token), None).await
    }

    async fn create(&self, budget: Value) -> Value {
        let (s, v) = self.post("/v1/runs", json!({"budget": budget, "inputs": {"task": "t"}})).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v
    }

    async fn step(
        &self,
        run: &str,
        epoch: i64,
        step_id: &str,
        kind: &str,
        data: Value,
        usage: Value,
    ) -> (StatusCode, Value) {
        self.post(
            &format!("/v1/runs/{run}/steps"),
            json!({"epoch": epoch, "step_id": step_id, "kind": kind, "data": data, "usage": usage}),
        )
        .await
    }

    async fn effect(&self, run: &str, epoch: i64, step_id: &str, class: &str) -> (StatusCode, Value) {
        self.post(
            &format!("/v1/runs/{run}/effects"),
            json!({"epoch": epoch, "step_id": step_id, "effect_class": class, "target": "https://pay.example/charge",
                   "description": "charge 42"}),
        )
        .await
    }

    async fn outcome(&self, run: &str, epoch: i64, step_id: &str, attempt: i64, outcome: &str) -> (StatusCode, Value) {
        self.post(
            &format!("/v1/runs/{run}/effects/{step_id}/outcome"),
            json!({"epoch": epoch, "attempt": attempt, "outcome": outcome, "result": {"id": "ch_1"}}),
        )
        .await
    }

    async fn run(&self, run: &str) -> Value {
        let (s, v) = self.get(&format!("/v1/runs/{run}")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

async fn counts(pool: &PgPool, run: &str) -> (i64, i64) {
    let id = uuid::Uuid::parse_str(run).unwrap();
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM run_steps WHERE run_id = $1), (SELECT count(*) FROM run_effects WHERE run_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn ceilings_bound_what_an_agent_asks_for(pool: PgPool) {
    let app = TestApp::start(
        pool,
        &[("AIRLOCK__RUNS__MAX_STEPS", "100"), ("AIRLOCK__RUNS__AGENTS__AGENT-1__MAX_TOKENS", "5000")],
    )
    .await;
    let runs = Runs::of(&app);
    let r = runs.create(json!({})).await;
    assert_eq!(r["state"], "active");
    assert_eq!(r["epoch"], 1);
    assert_eq!(
        r["budget"]["limit"],
        json!({"max_steps": 100, "max_tokens": 5000, "max_cost_micros": 0}),
        "0: the ceilings"
    );
    let r = runs.create(json!({"max_steps": 7, "max_cost_micros": 9})).await;
    assert_eq!(r["budget"]["limit"], json!({"max_steps": 7, "max_tokens": 5000, "max_cost_micros": 9}));
    for (field, value, named) in
        [("max_steps", 101, "runs.max_steps"), ("max_tokens", 5001, "runs.max_tokens"), ("max_steps", -1, "max_steps")]
    {
        let (s, v) = runs.post("/v1/runs", json!({"budget": {field: value}})).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(code(&v), "VALIDATION");
        assert!(v["error"]["message"].as_str().unwrap().contains(named), "{v}");
    }
    // Another agent keeps the default ceilings.
    let other = Runs { app: &app, token: app.other_agent.clone() };
    let r = other.create(json!({})).await;
    assert_eq!(r["budget"]["limit"]["max_tokens"], 0);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM runs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(n, 3, "refused runs wrote nothing");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn steps_replay_as_recorded_diverge_loudly_and_are_fenced_on_the_epoch(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();

    let (s, first) =
        runs.step(&run, 1, "m1", "model_output", json!({"answer": "branch-a"}), json!({"tokens": 10})).await;
    assert_eq!(s, StatusCode::CREATED, "{first}");
    assert_eq!((first["seq"].clone(), first["replayed"].clone()), (json!(1), json!(false)));
    // The same step again, with other data: the recorded value, not the new one.
    let (s, again) =
        runs.step(&run, 1, "m1", "model_output", json!({"answer": "branch-b"}), json!({"tokens": 10})).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(again["data"]["answer"], "branch-a", "deterministic replay: the original value");
    assert_eq!(again["replayed"], true);
    assert_eq!(again["seq"], 1);
    let (s, v) = runs.step(&run, 1, "m1", "tool_result", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "REPLAY_DIVERGED"), "{v}");
    assert_eq!(
        runs.run(&run).await["budget"]["used"],
        json!({"steps": 1, "tokens": 10, "cost_micros": 0}),
        "a replay spends nothing"
    );

    // A resumed process takes the run over; the old holder's writes change nothing.
    let (s, claimed) = runs.post(&format!("/v1/runs/{run}/claim"), json!({})).await;
    assert_eq!(s, StatusCode::OK, "{claimed}");
    assert_eq!(claimed["epoch"], 2);
    let (s, v) = runs.step(&run, 1, "m2", "note", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "STALE_EPOCH"), "{v}");
    let (s, v) = runs.effect(&run, 1, "e1", "idempotent").await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "STALE_EPOCH"), "{v}");
    let (s, v) = runs.post(&format!("/v1/runs/{run}/complete"), json!({"epoch": 1, "result": {}})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "STALE_EPOCH"), "{v}");
    assert_eq!(counts(&app.pool, &run).await, (1, 0), "the stale holder recorded nothing");
    let (s, v) = runs.step(&run, 2, "m2", "note", json!({"n": 2}), json!({})).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["seq"], 2);

    // The log in order, paged through its cursor.
    for i in 3..=5 {
        runs.step(&run, 2, &format!("s{i}"), "clock", json!({"t": i}), json!({})).await;
    }
    let (s, page) = runs.get(&format!("/v1/runs/{run}/steps?limit=3")).await;
    assert_eq!(s, StatusCode::OK);
    let seqs: Vec<i64> = page["items"].as_array().unwrap().iter().map(|s| s["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    let cursor = page["next"].as_str().unwrap();
    let (_, rest) = runs.get(&format!("/v1/runs/{run}/steps?limit=3&cursor={cursor}")).await;
    let seqs: Vec<i64> = rest["items"].as_array().unwrap().iter().map(|s| s["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, vec![4, 5]);
    assert!(rest["next"].is_null());

    // Bad input is refused with nothing written.
    for body in [
        json!({"epoch": 2, "step_id": "x", "kind": "effect"}),
        json!({"epoch": 2, "step_id": "", "kind": "note"}),
        json!({"epoch": 2, "step_id": "x", "kind": "note", "usage": {"tokens": -1}}),
        json!({"epoch": 2, "step_id": "x", "kind": "note", "extra": 1}),
        json!({"step_id": "x", "kind": "note"}),
    ] {
        let (s, v) = runs.post(&format!("/v1/runs/{run}/steps"), body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
    }
    assert_eq!(counts(&app.pool, &run).await.0, 5);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn budgets_run_out_by_steps_tokens_and_cost_with_nothing_recorded(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    for (budget, steps, overflow) in [
        (json!({"max_steps": 2}), vec![json!({}), json!({})], json!({})),
        (json!({"max_tokens": 100}), vec![json!({"tokens": 60}), json!({"tokens": 40})], json!({"tokens": 1})),
        (json!({"max_cost_micros": 1000}), vec![json!({"cost_micros": 999})], json!({"cost_micros": 2})),
    ] {
        let run = runs.create(budget.clone()).await["id"].as_str().unwrap().to_string();
        for (i, usage) in steps.iter().enumerate() {
            let (s, v) = runs.step(&run, 1, &format!("s{i}"), "note", json!({}), usage.clone()).await;
            assert_eq!(s, StatusCode::CREATED, "{budget}: {v}");
        }
        let before = runs.run(&run).await["budget"]["used"].clone();
        let (s, v) = runs.step(&run, 1, "over", "note", json!({}), overflow.clone()).await;
        assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "BUDGET_EXHAUSTED"), "{budget}: {v}");
        let after = runs.run(&run).await;
        assert_eq!(after["state"], "budget_exhausted", "{budget}");
        assert_eq!(after["budget"]["used"], before, "{budget}: nothing spent by the refused step");
        assert_eq!(counts(&app.pool, &run).await.0, steps.len() as i64, "{budget}: nothing recorded");
        // A terminal run refuses every later write; its recorded steps still replay.
        let (s, v) = runs.effect(&run, 1, "e", "idempotent").await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        let (s, v) = runs.step(&run, 1, "s0", "note", json!({}), json!({})).await;
        assert_eq!((s, v["replayed"].clone()), (StatusCode::OK, json!(true)));
    }
    // Effects spend too, before the write.
    let run = runs.create(json!({"max_steps": 1})).await["id"].as_str().unwrap().to_string();
    let (s, _) = runs.effect(&run, 1, "e1", "idempotent").await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, v) = runs.effect(&run, 1, "e2", "idempotent").await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "BUDGET_EXHAUSTED"), "{v}");
    assert_eq!(counts(&app.pool, &run).await, (1, 1));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn effects_answer_what_a_resumed_process_must_do(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();

    // Idempotent: started, started again with the same key, then the recorded outcome.
    let (s, first) = runs.effect(&run, 1, "charge", "idempotent").await;
    assert_eq!(s, StatusCode::CREATED, "{first}");
    assert_eq!((first["state"].clone(), first["attempt"].clone()), (json!("started"), json!(1)));
    let key = first["idempotency_key"].as_str().unwrap().to_string();
    let (s, again) = runs.effect(&run, 1, "charge", "idempotent").await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!((again["state"].clone(), again["attempt"].clone()), (json!("started"), json!(2)));
    assert_eq!(again["idempotency_key"], key, "the same key on every attempt");
    let (s, v) = runs.outcome(&run, 1, "charge", 1, "succeeded").await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "only the latest attempt: {v}");
    let (s, done) = runs.outcome(&run, 1, "charge", 2, "succeeded").await;
    assert_eq!(s, StatusCode::OK, "{done}");
    assert_eq!(done["state"], "succeeded");
    let (s, again) = runs.outcome(&run, 1, "charge", 2, "succeeded").await;
    assert_eq!((s, again["replayed"].clone()), (StatusCode::OK, json!(true)), "the same outcome again");
    let (s, v) = runs.outcome(&run, 1, "charge", 2, "failed").await;
    assert_eq!(s, StatusCode::CONFLICT, "another outcome: {v}");
    let (s, replay) = runs.effect(&run, 1, "charge", "idempotent").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!((replay["state"].clone(), replay["replayed"].clone()), (json!("succeeded"), json!(true)), "skip it");
    assert_eq!(replay["result"], json!({"id": "ch_1"}));
    let (s, v) = runs.effect(&run, 1, "charge", "non_repeatable").await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "REPLAY_DIVERGED"), "another class: {v}");
    let (s, v) = runs.step(&run, 1, "charge", "note", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "REPLAY_DIVERGED"), "the effect's step is an effect: {v}");

    // Non-repeatable, begun again without an outcome: a human decides; the run waits.
    let (s, _) = runs.effect(&run, 1, "notify", "non_repeatable").await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, waiting) = runs.effect(&run, 1, "notify", "non_repeatable").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{waiting}");
    assert_eq!(waiting["state"], "awaiting_human");
    let r = runs.run(&run).await;
    assert_eq!((r["state"].clone(), r["waiting_on"].clone()), (json!("waiting"), json!("effect:notify")));
    let (s, v) = runs.step(&run, 1, "later", "note", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "nothing goes on while it waits: {v}");
    let (s, again) = runs.effect(&run, 1, "notify", "non_repeatable").await;
    assert_eq!((s, again["state"].clone()), (StatusCode::ACCEPTED, json!("awaiting_human")));

    // The waiting run is listed for reviewers with the attempt's details.
    let (s, list) =
        app.call("GET", &format!("{}/admin/v1/runs?state=waiting", app.admin), Some(&app.reviewer), None).await;
    assert_eq!(s, StatusCode::OK, "{list}");
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["pending"][0]["effect"]["step_id"], "notify");
    assert_eq!(items[0]["pending"][0]["attempts"][0]["target"], "https://pay.example/charge");
    let resolve = |resolution: &str, note: Option<&str>| {
        let body = json!({"resolution": resolution, "note": note, "result": {"checked": "the relay log"}});
        let url = format!("{}/admin/v1/runs/{run}/effects/notify/resolve", app.admin);
        let app = &app;
        async move { app.call("POST", &url, Some(&app.reviewer), Some(body)).await }
    };
    let (s, v) = resolve("confirmed_done", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a note is required: {v}");
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/runs/{run}/effects/notify/resolve", app.admin),
            Some(&app.agent),
            Some(json!({"resolution": "retry", "note": "x"})),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "an agent cannot settle its own effect: {v}");
    let (s, v) = resolve("confirmed_done", Some("found it in the relay log")).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["run"]["state"], "active");
    assert_eq!(v["effect"]["state"], "succeeded");
    assert_eq!(v["effect"]["attested_by"], "rita");
    assert_eq!(runs.run(&run).await["state"], "active", "settled: the run goes on");
    let (s, v) = resolve("retry", Some("again")).await;
    assert_eq!(s, StatusCode::CONFLICT, "settled already: {v}");
    let (s, replay) = runs.effect(&run, 1, "notify", "non_repeatable").await;
    assert_eq!((s, replay["state"].clone()), (StatusCode::OK, json!("succeeded")), "the attested outcome: {replay}");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_log WHERE action = 'run.effect.resolve' AND reason = 'found it in the relay log'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1, "the settlement is audited with its note");

    assert_eq!(runs.run(&run).await["state"], "active", "settled: the run goes on");
    // `retry` authorises exactly one more attempt; `abandon` records it failed.
    for (step, resolution, end) in [("n2", "retry", "started"), ("n3", "abandon", "failed")] {
        let (s, v) = runs.effect(&run, 1, step, "non_repeatable").await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, v) = runs.effect(&run, 1, step, "non_repeatable").await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        let body = json!({"resolution": resolution, "note": "decided"});
        let (s, v) = app
            .call(
                "POST",
                &format!("{}/admin/v1/runs/{run}/effects/{step}/resolve", app.admin),
                Some(&app.reviewer),
                Some(body),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let (s, v) = runs.effect(&run, 1, step, "non_repeatable").await;
        assert_eq!(v["state"], end, "{resolution}: {v}");
        if resolution == "retry" {
            assert_eq!((s, v["attempt"].clone()), (StatusCode::OK, json!(2)));
            let (s, v) = runs.outcome(&run, 1, step, 2, "succeeded").await;
            assert_eq!((s, v["state"].clone()), (StatusCode::OK, json!("succeeded")), "{v}");
        }
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn ending_and_cancelling_refuse_every_later_write(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();
    runs.step(&run, 1, "s1", "input", json!({"q": 1}), json!({})).await;
    let (s, done) = runs.post(&format!("/v1/runs/{run}/complete"), json!({"epoch": 1, "result": {"ok": true}})).await;
    assert_eq!(s, StatusCode::OK, "{done}");
    assert_eq!((done["state"].clone(), done["result"].clone()), (json!("completed"), json!({"ok": true})));
    for (s, v) in [
        runs.step(&run, 1, "s2", "note", json!({}), json!({})).await,
        runs.effect(&run, 1, "e", "idempotent").await,
        runs.post(&format!("/v1/runs/{run}/claim"), json!({})).await,
        runs.post(&format!("/v1/runs/{run}/fail"), json!({"epoch": 1, "error": {}})).await,
        runs.post(&format!("/v1/runs/{run}/cancel"), json!({"reason": "x"})).await,
    ] {
        assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "{v}");
    }

    // Cancelled (by the agent, no epoch), then nothing more.
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();
    let (s, v) = runs.post(&format!("/v1/runs/{run}/cancel"), json!({})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a reason is required: {v}");
    let (s, v) = runs.post(&format!("/v1/runs/{run}/cancel"), json!({"reason": "not needed"})).await;
    assert_eq!((s, v["state"].clone()), (StatusCode::OK, json!("cancelled")));
    let (s, v) = runs.step(&run, 1, "s", "note", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "{v}");
    let (s, v) = app
        .call("POST", &format!("{}/v1/deliveries", app.api), Some(&app.agent), Some(TestApp::email(&run, "d", "Hi")))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "no delivery from a cancelled run: {v}");

    // An operator cancels a run of any agent (audited); a reviewer may not.
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();
    let url = format!("{}/admin/v1/runs/{run}/cancel", app.admin);
    let (s, _) = app.call("POST", &url, Some(&app.reviewer), Some(json!({"reason": "stop"}))).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, v) = app.call("POST", &url, Some(&app.operator), Some(json!({"reason": "runaway"}))).await;
    assert_eq!((s, v["state"].clone()), (StatusCode::OK, json!("cancelled")), "{v}");
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_log WHERE action = 'run.cancel' AND reason = 'runaway'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(audited, 1);
    let (s, v) = runs.effect(&run, 1, "e", "non_repeatable").await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "INVALID_TRANSITION"), "{v}");
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn deliveries_are_steps_of_their_run(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    let run = runs.create(json!({"max_steps": 3})).await["id"].as_str().unwrap().to_string();
    runs.step(&run, 1, "plan", "model_output", json!({}), json!({})).await;
    let id = app.submit(TestApp::email(&run, "mail-1", "Report")).await;
    let (_, log) = runs.get(&format!("/v1/runs/{run}/steps")).await;
    let items = log["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!((items[1]["kind"].clone(), items[1]["step_id"].clone()), (json!("delivery"), json!("mail-1")));
    assert_eq!(items[1]["data"]["delivery_id"], id);
    // A step id is one thing: a delivery under a recorded step's id diverges.
    let (s, v) = app
        .call("POST", &format!("{}/v1/deliveries", app.api), Some(&app.agent), Some(TestApp::email(&run, "plan", "X")))
        .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "REPLAY_DIVERGED"), "{v}");
    let (s, v) = runs.step(&run, 1, "mail-1", "note", json!({}), json!({})).await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "REPLAY_DIVERGED"), "{v}");
    // The budget counts deliveries like any step.
    let _ = app.submit(TestApp::email(&run, "mail-2", "Report 2")).await;
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/v1/deliveries", app.api),
            Some(&app.agent),
            Some(TestApp::email(&run, "mail-3", "X")),
        )
        .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "BUDGET_EXHAUSTED"), "{v}");
    assert_eq!(runs.run(&run).await["state"], "budget_exhausted");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&app.pool).await.unwrap();
    assert_eq!(n, 2);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn another_agent_finds_none_of_it(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let runs = Runs::of(&app);
    let run = runs.create(json!({})).await["id"].as_str().unwrap().to_string();
    runs.step(&run, 1, "s1", "note", json!({"secret": "x"}), json!({})).await;
    runs.effect(&run, 1, "e1", "idempotent").await;
    let other = Runs { app: &app, token: app.other_agent.clone() };
    for (s, v) in [
        other.get(&format!("/v1/runs/{run}")).await,
        other.get(&format!("/v1/runs/{run}/steps")).await,
        other.post(&format!("/v1/runs/{run}/claim"), json!({})).await,
        other.step(&run, 1, "s2", "note", json!({}), json!({})).await,
        other.effect(&run, 1, "e1", "idempotent").await,
        other.outcome(&run, 1, "e1", 1, "succeeded").await,
        other.post(&format!("/v1/runs/{run}/complete"), json!({"epoch": 1})).await,
        other.post(&format!("/v1/runs/{run}/fail"), json!({"epoch": 1})).await,
        other.post(&format!("/v1/runs/{run}/cancel"), json!({"reason": "x"})).await,
    ] {
        assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "NOT_FOUND"), "{v}");
    }
    assert_eq!(runs.run(&run).await["epoch"], 1, "untouched");
    assert_eq!(counts(&app.pool, &run).await, (2, 1));
}
