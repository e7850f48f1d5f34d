//! Both services' live `/openapi.json` pass an independent validator
//! (`openapi-spec-validator`, PyPI), and say what tools need: every response described,
//! every error response with the error body's schema, every request body with a schema.

use airlock_tests::app::TestApp;
use airlock_tests::harness;
use serde_json::Value;
use sqlx::PgPool;

/// Runs `openapi_spec_validator` on `doc`; `Err` with its report when it refuses.
fn validate_with_library(doc: &Value) -> Result<(), String> {
    let script = r#"
import json, sys
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError
try:
    validate(json.load(sys.stdin))
except OpenAPIValidationError as e:
    print(str(e)[:4000])
    sys.exit(3)
"#;
    let out = harness::run_python(script, doc.to_string().as_bytes());
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) => Err(String::from_utf8_lossy(&out.stdout).into_owned()),
        other => panic!("the validator script failed ({other:?})"),
    }
}

/// The schema a media type names, following one `$ref` into the components.
fn schema_of<'a>(doc: &'a Value, media: &'a Value) -> Option<&'a Value> {
    let schema = media.get("schema")?;
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => doc.pointer(r.strip_prefix('#')?),
        None => Some(schema),
    }
}

/// What the document lacks: responses without a description, error responses without
/// the error body, request bodies without a schema.
fn gaps(doc: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let methods = ["get", "put", "post", "delete", "patch"];
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        for (method, op) in item.as_object().into_iter().flatten().filter(|(m, _)| methods.contains(&m.as_str())) {
            let at = format!("{} {path}", method.to_uppercase());
            if let Some(body) = op.get("requestBody") {
                let described =
                    body["content"].as_object().is_some_and(|c| c.values().any(|m| schema_of(doc, m).is_some()));
                if !described {
                    out.push(format!("{at}: request body without a schema"));
                }
            }
            let responses = op["responses"].as_object();
            if responses.is_none_or(|r| r.is_empty()) {
                out.push(format!("{at}: no responses"));
            }
            for (status, resp) in responses.into_iter().flatten() {
                if resp.get("description").and_then(Value::as_str).is_none_or(str::is_empty) {
                    out.push(format!("{at} {status}: no description"));
                }
                let error = status.starts_with('4') || status.starts_with('5');
                // A readiness probe's 503 is its own small body, not an error.
                if error && !(path == "/readyz" && status == "503") {
                    let schema = schema_of(doc, &resp["content"]["application/json"]);
                    let is_error_body = schema.is_some_and(|s| s["properties"]["error"].is_object());
                    if !is_error_body {
                        out.push(format!("{at} {status}: error response without the error body schema"));
                    }
                }
            }
        }
    }
    out
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn both_documents_are_valid_openapi_and_complete(pool: PgPool) {
    let app = TestApp::start(pool, &[]).await;
    for (service, base) in [("api", &app.api), ("admin", &app.admin)] {
        let (status, doc) = app.call("GET", &format!("{base}/openapi.json"), None, None).await;
        assert_eq!(status, 200, "{service}");
        assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "{service}: {}", doc["openapi"]);
        assert!(doc["paths"].as_object().is_some_and(|p| p.len() > 5), "{service}: a document with its routes");
        let gaps = gaps(&doc);
        assert!(gaps.is_empty(), "{service}: {} gaps:\n{}", gaps.len(), gaps.join("\n"));
        if let Err(report) = validate_with_library(&doc) {
            panic!("{service}: openapi-spec-validator refuses the document:\n{report}");
        }
    }
}

/// The checks above catch what they should: a document with a response lacking its
/// description, or an error without the error body, is refused by both.
#[test]
fn a_broken_document_is_refused() {
    let doc: Value = serde_json::json!({
        "openapi": "3.1.0", "info": {"title": "t", "version": "1"},
        "paths": {"/x": {"post": {
            "requestBody": {"content": {"application/json": {}}},
            "responses": {"200": {}, "404": {"description": "gone"}}}}}
    });
    let found = gaps(&doc);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(validate_with_library(&doc).is_err());
}
