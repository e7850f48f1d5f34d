//! The tool list's input schemas: each is a valid JSON Schema, closed at every level whose
//! members are known, takes a minimal call made from its own `required` lists, and refuses
//! that call with one unknown argument added anywhere.

use airlock_mcp::server::{check_arguments, listed_tools};
use serde_json::{Map, Value, json};

/// The smallest instance a schema takes: the required members only, the first of an enum.
fn minimal(schema: &Value) -> Value {
    if let Some(first) = schema["enum"].as_array().and_then(|e| e.first()) {
        return first.clone();
    }
    let ty = match &schema["type"] {
        Value::String(t) => t.as_str(),
        Value::Array(types) => types[0].as_str().unwrap(),
        _ => return json!({}),
    };
    match ty {
        "object" => {
            let mut out = Map::new();
            for name in schema["required"].as_array().into_iter().flatten() {
                let name = name.as_str().unwrap();
                out.insert(name.to_string(), minimal(&schema["properties"][name]));
            }
            Value::Object(out)
        }
        "array" if schema["minItems"].as_u64().unwrap_or(0) > 0 => json!([minimal(&schema["items"])]),
        "array" => json!([]),
        "string" => json!("x"),
        "integer" => json!(1),
        other => panic!("a schema type this test does not know: {other}"),
    }
}

/// Every path (of member names) to a closed object inside `instance`, the root included.
fn closed_objects(schema: &Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
    if schema["type"] == "object" && schema["properties"].is_object() {
        assert_eq!(schema["additionalProperties"], false, "open object at {at:?}");
        out.push(at.clone());
        for (name, sub) in schema["properties"].as_object().unwrap() {
            let mut next = at.clone();
            next.push(name.clone());
            closed_objects(sub, next, out);
        }
    }
}

#[test]
fn every_input_schema_is_valid_closed_and_refuses_unknown_arguments() {
    let tools = listed_tools();
    assert_eq!(tools.len(), 11);
    for tool in tools {
        let schema = Value::Object((*tool.input_schema).clone());
        let name = tool.name.as_ref();
        jsonschema::meta::validate(&schema).unwrap_or_else(|e| panic!("{name}: not a valid JSON Schema: {e}"));
        assert_eq!(schema["type"], "object", "{name}");
        let desc = tool.description.as_deref().unwrap_or("");
        assert!(desc.len() > 100, "{name}: a description a model can act on");

        let call = minimal(&schema);
        check_arguments(name, &call).unwrap_or_else(|e| panic!("{name}: its minimal call {call} is refused: {e}"));
        let mut closed = Vec::new();
        closed_objects(&schema, Vec::new(), &mut closed);
        for path in closed {
            // Make the path exist (as the object's minimal form), then add an unknown member.
            let mut bad = call.clone();
            let mut node = &mut bad;
            let mut sub = &schema;
            for seg in &path {
                sub = &sub["properties"][seg];
                let child = minimal(sub);
                node = node.as_object_mut().unwrap().entry(seg.clone()).or_insert(child);
            }
            node.as_object_mut().unwrap().insert("unexpected".into(), json!(true));
            assert!(check_arguments(name, &bad).is_err(), "{name}: takes an unknown member at {path:?}: {bad}");
            // Over MCP it is the route's VALIDATION: the check is what every call runs.
        }
        // A required member left out is refused too.
        for required in schema["required"].as_array().into_iter().flatten() {
            let mut bad = call.clone();
            bad.as_object_mut().unwrap().remove(required.as_str().unwrap());
            assert!(check_arguments(name, &bad).is_err(), "{name}: takes a call without {required}");
        }
    }
}

#[test]
fn no_tool_can_approve_grant_resolve_or_switch() {
    for tool in listed_tools() {
        for word in ["approve", "grant", "resolve", "switch", "reject", "choose"] {
            assert!(!tool.name.contains(word), "{}", tool.name);
        }
    }
    assert!(airlock_mcp::TOOLS.iter().all(|t| t.route_call(&Map::new()).map_or(true, |c| c.path.starts_with("/v1/"))));
}
