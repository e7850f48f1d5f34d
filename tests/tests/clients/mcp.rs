//! The official Python MCP SDK against the real system, over streamable HTTP (`/mcp`) and
//! over stdio (`airlock-mcp` calling the agent API): initialize, list the tools, start a
//! run, submit an email, read its delivery; the answers are the routes' own JSON; an
//! unknown argument, another agent's delivery and a tool that does not exist are refused
//! with the route's codes; no token is refused. Then hostile input at `/mcp` itself.

use std::path::PathBuf;
use std::time::Duration;

use airlock_tests::app::TestApp;
use airlock_tests::harness;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

/// The tools API.md lists, in the order they are listed.
const TOOLS: [&str; 11] = [
    "submit_email",
    "submit_webhook",
    "get_delivery",
    "start_run",
    "get_run",
    "claim_run",
    "record_step",
    "begin_effect",
    "record_outcome",
    "start_task",
    "get_task",
];

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python").join("mcp_session.py")
}

/// Runs the Python session script; its JSON report.
async fn python_session(args: &[&str]) -> Value {
    let mut cmd = tokio::process::Command::new(harness::python());
    cmd.arg(script()).args(args).stdin(std::process::Stdio::null()).kill_on_drop(true);
    // Where the session's exchanges go, for the documentation's transcript.
    if let Ok(path) = std::env::var("AIRLOCK_MCP_TRANSCRIPT") {
        let kind = args[0];
        cmd.arg("--transcript").arg(format!("{path}.{kind}.json"));
    }
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output()).await.expect("the session ends").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the session script failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not a report ({e}): {stdout}"))
}

/// A delivery of the other agent, made over HTTP.
async fn foreign_delivery(app: &TestApp) -> String {
    let (s, run) =
        app.call("POST", &format!("{}/v1/runs", app.api), Some(&app.other_agent), Some(json!({"budget": {}}))).await;
    assert_eq!(s, StatusCode::CREATED, "{run}");
    let body = TestApp::email(run["id"].as_str().unwrap(), "theirs", "Not yours");
    let (s, d) = app.call("POST", &format!("{}/v1/deliveries", app.api), Some(&app.other_agent), Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{d}");
    d["id"].as_str().unwrap().to_string()
}

fn code(answer: &Value) -> &str {
    assert_eq!(answer["is_error"], true, "expected a tool error: {answer}");
    answer["structured"]["error"]["code"].as_str().unwrap_or_else(|| panic!("no error code: {answer}"))
}

/// What every transport must show of one session.
async fn check_session(app: &TestApp, report: &Value, foreign: &str) {
    assert_eq!(report["server"]["name"], "airlock", "{report}");
    let names: Vec<&str> = report["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, TOOLS);
    for tool in report["tools"].as_array().unwrap() {
        assert_eq!(tool["input_schema"]["additionalProperties"], false, "{} is open", tool["name"]);
        let d = tool["description"].as_str().unwrap();
        assert!(d.contains("VALIDATION") && d.contains("RATE_LIMITED"), "{}: says what to do on errors", tool["name"]);
    }
    for sending in ["submit_email", "submit_webhook"] {
        let d = report["tools"].as_array().unwrap().iter().find(|t| t["name"] == sending).unwrap()["description"]
            .as_str()
            .unwrap();
        assert!(
            d.contains("approve") && d.contains("send switch") && d.contains("awaiting_approval"),
            "{sending}: {d}"
        );
    }

    let run = &report["run"];
    assert_eq!(run["is_error"], false, "{run}");
    assert_eq!(run["structured"]["state"], "active");
    assert_eq!(run["structured"]["epoch"], 1);
    assert_eq!(run["structured"]["budget"]["limit"]["max_steps"], 10);
    // The text content is the same JSON, for clients that read only text.
    let text: Value = serde_json::from_str(run["text"][0].as_str().unwrap()).unwrap();
    assert_eq!(text, run["structured"]);

    let submitted = &report["submitted"];
    assert_eq!(submitted["is_error"], false, "{submitted}");
    assert_eq!(submitted["structured"]["state"], "persisted");
    let id = submitted["structured"]["id"].as_str().unwrap();
    assert_eq!(report["again"]["structured"]["id"], id, "the same step is the same delivery");

    // The delivery as the route answers it, byte for byte the same JSON (no worker runs, so
    // nothing moved in between).
    let (s, over_http) = app.call("GET", &format!("{}/v1/deliveries/{id}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(report["delivery"]["is_error"], false);
    assert_eq!(report["delivery"]["structured"], over_http);

    assert_eq!(code(&report["unknown_argument"]), "VALIDATION");
    assert_eq!(code(&report["missing_argument"]), "VALIDATION");
    // Another agent's delivery is not found, as the route says it.
    assert_eq!(code(&report["foreign_delivery"]), "NOT_FOUND");
    let (s, refused) = app.call("GET", &format!("{}/v1/deliveries/{foreign}", app.api), Some(&app.agent), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(report["foreign_delivery"]["structured"], refused);
    assert!(report["unknown_tool"]["protocol_error"]["code"].is_i64(), "{}", report["unknown_tool"]);

    // Exactly what the session made, nothing more: one run and one delivery of this agent.
    let (runs, deliveries): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM runs WHERE agent = 'agent-1'), (SELECT count(*) FROM deliveries WHERE agent = 'agent-1')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((runs, deliveries), (1, 1));
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn python_client_over_streamable_http(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let foreign = foreign_delivery(&app).await;
    let url = format!("{}/mcp", app.api);
    let report = python_session(&["http", &url, "--token", &app.agent, "--foreign-delivery", &foreign]).await;
    check_session(&app, &report, &foreign).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn python_client_over_stdio(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let foreign = foreign_delivery(&app).await;
    let bin = harness::bin_path("airlock-mcp");
    let report = python_session(&[
        "stdio",
        bin.to_str().unwrap(),
        "--api-url",
        &app.api,
        "--token",
        &app.agent,
        "--foreign-delivery",
        &foreign,
    ])
    .await;
    check_session(&app, &report, &foreign).await;
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn no_token_is_refused(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let url = format!("{}/mcp", app.api);
    // The Python client cannot even initialize.
    let report = python_session(&["http", &url]).await;
    assert!(report["failed"].is_array(), "a session without a token: {report}");
    assert_eq!(report["http_statuses"], json!([401]), "{report}");
    // As a bare request: 401 with the error body; a reviewer's token is not an agent's.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    for (token, want) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some("not-a-token"), StatusCode::UNAUTHORIZED),
        (Some(app.reviewer.as_str()), StatusCode::FORBIDDEN),
    ] {
        let (status, body) = mcp_post(&app, token, &init).await;
        assert_eq!(status, want, "{body}");
        let expected = if want == StatusCode::UNAUTHORIZED { "UNAUTHENTICATED" } else { "FORBIDDEN" };
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], expected);
    }
    // Over stdio, a wrong token gets the route's refusal as a tool error.
    let bin = harness::bin_path("airlock-mcp");
    let report =
        python_session(&["stdio", bin.to_str().unwrap(), "--api-url", &app.api, "--token", "not-a-token"]).await;
    assert_eq!(code(&report["run"]), "UNAUTHENTICATED");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM runs").fetch_one(&app.pool).await.unwrap();
    assert_eq!(runs, 0);
}

#[tokio::test]
async fn stdio_server_refuses_plain_http_to_another_host_and_a_missing_token() {
    let bin = harness::bin_path("airlock-mcp");
    for (url, token, says) in [
        ("http://airlock.example.com:7070", Some("t"), "plain http:// is refused"),
        ("http://10.1.2.3", Some("t"), "plain http:// is refused"),
        ("https://airlock.example.com", None, "AIRLOCK_TOKEN"),
    ] {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.env_clear().env("AIRLOCK_API_URL", url).stdin(std::process::Stdio::null());
        if let Some(t) = token {
            cmd.env("AIRLOCK_TOKEN", t);
        }
        let out = tokio::time::timeout(Duration::from_secs(30), cmd.output()).await.unwrap().unwrap();
        assert!(!out.status.success(), "{url}: started");
        assert!(out.stdout.is_empty(), "{url}: nothing on the protocol stream");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{url}: {stderr}");
    }
}

/// A POST to `/mcp` as a streamable-HTTP client makes it; the status and the body text.
async fn mcp_post(app: &TestApp, token: Option<&str>, body: &Value) -> (StatusCode, String) {
    mcp_post_raw(app, token, serde_json::to_vec(body).unwrap()).await
}

async fn mcp_post_raw(app: &TestApp, token: Option<&str>, body: Vec<u8>) -> (StatusCode, String) {
    let mut req = app
        .http
        .post(format!("{}/mcp", app.api))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status();
    (status, resp.text().await.unwrap())
}

fn call(id: u64, name: &str, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": name, "arguments": arguments}})
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn hostile_input_at_mcp_is_refused_and_writes_nothing(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let token = Some(app.agent.as_str());
    let run_id = app.create_run(10).await;

    // Not JSON, not JSON-RPC, nested past any parser's depth, a batch: refused, never a 5xx.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    for body in [
        b"{not json".to_vec(),
        b"".to_vec(),
        br#"{"hello": "world"}"#.to_vec(),
        br#"{"jsonrpc": "1.0", "id": 1, "method": "tools/list"}"#.to_vec(),
        br#"[{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}]"#.to_vec(),
        br#"{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": "submit_email"}"#.to_vec(),
        deep.into_bytes(),
    ] {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).to_string();
        let (status, text) = mcp_post_raw(&app, token, body).await;
        assert!(!status.is_server_error(), "{shown}: {status} {text}");
        let refused =
            status.is_client_error() || serde_json::from_str::<Value>(&text).is_ok_and(|v| v["error"].is_object());
        assert!(refused, "{shown}: {status} {text}");
    }

    // A client that accepts only JSON, or sends text: refused by the transport.
    let resp = app
        .http
        .post(format!("{}/mcp", app.api))
        .bearer_auth(&app.agent)
        .header("content-type", "text/plain")
        .header("accept", "application/json, text/event-stream")
        .body(call(1, "get_run", json!({"run_id": run_id})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);

    // No standing event stream and no session to end: every answer is the POST's.
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let resp = app.http.request(method.clone(), format!("{}/mcp", app.api)).bearer_auth(&app.agent).send().await;
        let resp = resp.unwrap();
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED, "{method}");
        assert_eq!(resp.headers()["allow"], "POST");
    }

    // A tool that does not exist is a protocol error (invalid params), its name not run.
    let (status, text) = mcp_post(&app, token, &call(2, "resolve_effect", json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], -32602, "{v}");

    // Arguments the schema does not take, or of the wrong type: the route's VALIDATION.
    for args in [
        json!({"run_id": run_id, "epoch": 1}),
        json!({"run_id": 7}),
        json!({"run_id": [run_id]}),
        json!({"run_id": run_id, "__proto__": {"admin": true}}),
    ] {
        let (status, text) = mcp_post(&app, token, &call(3, "get_run", args.clone())).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["result"]["isError"], true, "{args}: {v}");
        assert_eq!(v["result"]["structuredContent"]["error"]["code"], "VALIDATION", "{args}: {v}");
    }
    // A path id that tries to leave its route stays a (refused) id of that route.
    for bad in ["../../admin/v1/switch", "..", "%2e%2e", "x?y=1", "a/b"] {
        let (_, text) = mcp_post(&app, token, &call(4, "get_delivery", json!({"delivery_id": bad}))).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["result"]["isError"], true, "{bad}: {v}");
        assert_eq!(v["result"]["structuredContent"]["error"]["code"], "VALIDATION", "{bad}: {v}");
    }

    // Arguments larger than any route takes: 413 before anything is parsed.
    let huge = "x".repeat(app.config.delivery.max_artifact_bytes + 128 * 1024);
    let email = json!({"from": "agent@example.com", "to": ["a@example.org"], "subject": "big", "text": huge});
    let (status, _) =
        mcp_post(&app, token, &call(5, "submit_email", json!({"run_id": run_id, "step_id": "big", "email": email})))
            .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    // Larger than an artifact may be but within the message limit: the route's own answer.
    let over = "x".repeat(app.config.delivery.max_artifact_bytes + 1);
    let email = json!({"from": "agent@example.com", "to": ["a@example.org"], "subject": "big", "text": over});
    let (status, text) =
        mcp_post(&app, token, &call(6, "submit_email", json!({"run_id": run_id, "step_id": "big", "email": email})))
            .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["result"]["isError"], true, "{v}");
    let code = v["result"]["structuredContent"]["error"]["code"].as_str().unwrap().to_string();
    assert!(code == "PAYLOAD_TOO_LARGE" || code == "VALIDATION", "{v}");

    // None of it wrote anything.
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries").fetch_one(&app.pool).await.unwrap();
    assert_eq!(deliveries, 0);
    let steps: i64 = sqlx::query_scalar("SELECT count(*) FROM run_steps").fetch_one(&app.pool).await.unwrap();
    assert_eq!(steps, 0);

    // And the service still answers a well-formed call.
    let (status, text) = mcp_post(&app, token, &call(7, "get_run", json!({"run_id": run_id}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["result"]["structuredContent"]["id"], run_id.as_str(), "{v}");
}
