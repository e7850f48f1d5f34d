//! The HTTP surface of both services: every route × every kind of caller against the
//! authorization tables, the OpenAPI documents against the routes, hardening headers, and
//! malformed bodies fuzzed against the agent API.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use airlock_core::principals::Role;
use airlock_http::{Access, RouteRule};
use airlock_tests::app::TestApp;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

/// (method, path) pairs an OpenAPI document declares.
fn documented(doc: &utoipa::openapi::OpenApi) -> BTreeSet<(String, String)> {
    let v = serde_json::to_value(doc).unwrap();
    let mut out = BTreeSet::new();
    for (path, item) in v["paths"].as_object().unwrap() {
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                out.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    out
}

fn table(rules: &[RouteRule]) -> BTreeSet<(String, String)> {
    rules.iter().map(|r| (r.method.to_string(), r.path.to_string())).collect()
}

#[test]
fn every_route_is_documented_and_in_the_authorization_table() {
    for (name, doc, rules) in [
        ("api", airlock_api::openapi(), airlock_api::ROUTES),
        ("admin", airlock_admin::server::openapi(), airlock_admin::server::ROUTES),
    ] {
        let documented = documented(&doc);
        let table = table(rules);
        assert_eq!(documented, table, "{name}: the OpenAPI document and the authorization table differ");
        assert_eq!(table.len(), rules.len(), "{name}: a route is listed twice");
        let v = serde_json::to_value(&doc).unwrap();
        assert!(v["openapi"].as_str().unwrap().starts_with("3."));
    }
}

/// What each kind of caller gets on one route.
#[derive(Debug, Clone, Copy)]
enum Caller {
    NoToken,
    Malformed,
    Revoked,
    Role(Role),
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn route_by_role_matrix(pool: PgPool) {
    let app = TestApp::start(pool.clone(), &[]).await;
    let (_, revoked) = airlock_core::principals::create(&pool, "gone", Role::Operator, None).await.unwrap();
    airlock_core::principals::revoke(&pool, "gone", "test").await.unwrap();
    let revoked = revoked.expose().to_string();
    let callers = [
        Caller::NoToken,
        Caller::Malformed,
        Caller::Revoked,
        Caller::Role(Role::Agent),
        Caller::Role(Role::Reviewer),
        Caller::Role(Role::Operator),
        Caller::Role(Role::Admin),
    ];
    let mut checked = 0;
    let mut lines = Vec::new();
    for (base, rules) in [(&app.api, airlock_api::ROUTES), (&app.admin, airlock_admin::server::ROUTES)] {
        for rule in rules {
            let path = rule.path.replace("{id}", &uuid::Uuid::new_v4().to_string());
            let url = format!("{base}{path}");
            let mut row = format!("{:<7}{:<44}", rule.method, rule.path);
            for caller in callers {
                let method = reqwest::Method::from_bytes(rule.method.as_bytes()).unwrap();
                let mut req = app.http.request(method, &url);
                req = match caller {
                    Caller::NoToken => req,
                    Caller::Malformed => req.header("authorization", "Bearer"),
                    Caller::Revoked => req.bearer_auth(&revoked),
                    Caller::Role(Role::Agent) => req.bearer_auth(&app.agent),
                    Caller::Role(Role::Reviewer) => req.bearer_auth(&app.reviewer),
                    Caller::Role(Role::Operator) => req.bearer_auth(&app.operator),
                    Caller::Role(Role::Admin) => req.bearer_auth(&app.admin_token),
                };
                if matches!(rule.method, "POST" | "PUT") {
                    req = req.json(&json!({}));
                }
                let status = req.send().await.unwrap().status();
                let expected_denial = match (rule.access, caller) {
                    (Access::Public, _) => None,
                    (_, Caller::NoToken | Caller::Malformed | Caller::Revoked) => Some(StatusCode::UNAUTHORIZED),
                    (access, Caller::Role(role)) if access.allows(role) => None,
                    (_, Caller::Role(_)) => Some(StatusCode::FORBIDDEN),
                };
                match expected_denial {
                    Some(want) => assert_eq!(status, want, "{} {} as {caller:?}", rule.method, rule.path),
                    None => assert!(
                        status != StatusCode::UNAUTHORIZED
                            && status != StatusCode::FORBIDDEN
                            && !status.is_server_error(),
                        "{} {} as {caller:?}: {status}",
                        rule.method,
                        rule.path
                    ),
                }
                row.push_str(&format!(" {:>3}", status.as_u16()));
                checked += 1;
            }
            lines.push(row);
        }
    }
    eprintln!("{:<51} none bad  rev agt rev ops adm\n{}", "route", lines.join("\n"));
    assert!(checked >= 7 * 25);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn hardening_headers_no_cors_and_limits(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let page = app.http.get(format!("{}/", app.admin)).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let h = page.headers();
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert!(h["content-security-policy"].to_str().unwrap().contains("frame-ancestors 'none'"));
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(page.text().await.unwrap().contains("/app.js"));

    // A cross-origin preflight gets no CORS grant.
    for base in [&app.api, &app.admin] {
        let resp = app
            .http
            .request(reqwest::Method::OPTIONS, format!("{base}/admin/v1/deliveries"))
            .header("origin", "https://evil.example")
            .header("access-control-request-method", "GET")
            .send()
            .await
            .unwrap();
        assert!(resp.headers().get("access-control-allow-origin").is_none());
    }
    // Both services publish their document.
    for base in [&app.api, &app.admin] {
        let (s, v) = app.call("GET", &format!("{base}/openapi.json"), None, None).await;
        assert_eq!(s, StatusCode::OK);
        assert!(v["paths"].as_object().unwrap().len() >= 5);
    }
    // Deeply nested JSON is refused, not a crash; errors carry no internals.
    let deep = format!("{}1{}", "[".repeat(5000), "]".repeat(5000));
    let resp = app
        .http
        .post(format!("{}/v1/runs", app.api))
        .bearer_auth(&app.agent)
        .header("content-type", "application/json")
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body = resp.text().await.unwrap();
    assert!(body.contains("VALIDATION") && !body.to_lowercase().contains("sqlx"));
}

/// A body that can never be a valid delivery request for `run`.
fn malformed(run: String) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        ".{0,40}".prop_map(Value::String),
    ];
    let arbitrary = leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    let valid = TestApp::email(&run, "fuzz", "Subject");
    let keys = ["run_id", "step_id", "channel", "email"];
    let inner_keys = ["from", "to", "subject", "text"];
    prop_oneof![
        // Anything at all (it never names the real run, so it cannot create a row).
        arbitrary.clone(),
        // The valid body with one required member removed.
        (0..keys.len()).prop_map({
            let valid = valid.clone();
            move |i| {
                let mut b = valid.clone();
                b.as_object_mut().unwrap().remove(keys[i]);
                b
            }
        }),
        // The valid body with one member replaced by a value of another type.
        (0..inner_keys.len(), arbitrary.clone()).prop_map({
            let valid = valid.clone();
            move |(i, v)| {
                let mut b = valid.clone();
                let bad = if v.is_string() { json!([v]) } else { v };
                b["email"][inner_keys[i]] = bad;
                b
            }
        }),
        // The valid body with an unknown member.
        ("[a-z]{1,8}", arbitrary).prop_map(move |(k, v)| {
            let mut b = valid.clone();
            b["email"][format!("x_{k}")] = v;
            b
        }),
    ]
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn malformed_bodies_are_always_4xx_and_write_nothing(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    let run = app.create_run(0).await;
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 300, ..ProptestConfig::default() });
    let strategy = malformed(run.clone());
    let mut bodies = Vec::new();
    for _ in 0..300 {
        bodies.push(strategy.new_tree(&mut runner).unwrap().current());
    }
    let raw: Vec<&str> = vec!["", "{", "null", "[]", "\"x\"", "{\"run_id\": }", "\u{0}", "{}{}"];
    for body in &bodies {
        for path in ["/v1/deliveries", "/v1/runs"] {
            if path == "/v1/runs" && body.as_object().is_some_and(|o| o.is_empty()) {
                continue; // `{}` is a valid run request.
            }
            let resp =
                app.http.post(format!("{}{path}", app.api)).bearer_auth(&app.agent).json(body).send().await.unwrap();
            let s = resp.status();
            assert!(s.is_client_error(), "{path} {body} -> {s}");
        }
    }
    for body in raw {
        let resp = app
            .http
            .post(format!("{}/v1/deliveries", app.api))
            .bearer_auth(&app.agent)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_client_error(), "{body:?} -> {}", resp.status());
    }
    let (deliveries, runs, jobs): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM deliveries), (SELECT count(*) FROM runs), (SELECT count(*) FROM jobs)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((deliveries, runs, jobs), (0, 1, 0), "no row written by any refused body");
}
