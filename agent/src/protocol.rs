//! The `airlock.action.v1` contract: the model answers each round with exactly one JSON
//! object, `{"type": "tool_call", "tool_id", "arguments": {…}}` or
//! `{"type": "final", "text"}`.
//!
//! The parse is strict, so a model cannot talk its way past it: text before or after the
//! object, a Markdown fence, a duplicate key (at any depth: a strict parse, not serde's
//! last-key-wins), an unknown or missing key, a wrong type, and anything that claims an
//! authorization (a tool id or a top-level argument in the reserved namespace) are each
//! refused with a [`ProtocolError`] that says what was wrong, for the one repair request.
//! Whether the tool exists and its arguments satisfy its schema is the catalogue's
//! question (the turn's tools), asked after this parse.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The name of the contract, as the prompt states it.
pub const CONTRACT: &str = "airlock.action.v1";

/// One round's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    ToolCall { tool_id: String, arguments: Map<String, Value> },
    Final { text: String },
}

impl Action {
    /// The action as canonical JSON, for comparing two answers.
    pub fn to_json(&self) -> Value {
        match self {
            Action::ToolCall { tool_id, arguments } => {
                serde_json::json!({"type": "tool_call", "tool_id": tool_id, "arguments": arguments})
            }
            Action::Final { text } => serde_json::json!({"type": "final", "text": text}),
        }
    }
}

/// Why an answer is not an action.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("the answer is empty: answer with exactly one JSON object")]
    Empty,
    #[error("the answer is wrapped in a Markdown fence: answer with the bare JSON object, no ```")]
    Fence,
    #[error("there is text {0} the JSON object: answer with the object alone")]
    TextAround(&'static str),
    #[error("the answer is not valid JSON: {0}")]
    NotJson(String),
    #[error("the key `{0}` appears twice: every key once")]
    DuplicateKey(String),
    #[error("`{0}` is not a key of this action")]
    UnknownKey(String),
    #[error("the key `{0}` is missing")]
    MissingKey(&'static str),
    #[error("`{field}` must be {expected}")]
    WrongType { field: &'static str, expected: &'static str },
    #[error("`type` must be \"tool_call\" or \"final\", not {0}")]
    UnknownType(String),
    #[error("`{0}` is not a tool of this turn")]
    UnknownTool(String),
    #[error("the arguments of `{tool}` do not match its schema: {why}")]
    Schema { tool: String, why: String },
    #[error("`{0}` claims an authorization: no action can grant, approve or authorize anything")]
    SelfAuthorization(String),
}

impl ProtocolError {
    /// A short name of the refusal, for the turn's events.
    pub fn code(&self) -> &'static str {
        match self {
            ProtocolError::Empty => "empty",
            ProtocolError::Fence => "fence",
            ProtocolError::TextAround(_) => "text_around",
            ProtocolError::NotJson(_) => "not_json",
            ProtocolError::DuplicateKey(_) => "duplicate_key",
            ProtocolError::UnknownKey(_) => "unknown_key",
            ProtocolError::MissingKey(_) => "missing_key",
            ProtocolError::WrongType { .. } => "wrong_type",
            ProtocolError::UnknownType(_) => "unknown_type",
            ProtocolError::UnknownTool(_) => "unknown_tool",
            ProtocolError::Schema { .. } => "schema",
            ProtocolError::SelfAuthorization(_) => "self_authorization",
        }
    }
}

/// Tool ids in these namespaces are airlock's own: no tool of a turn has one.
const RESERVED_TOOL_PREFIXES: &[&str] =
    &["airlock.", "admin.", "authorization.", "authorizations.", "grant.", "grants."];
/// Words no tool id may contain.
const RESERVED_TOOL_WORDS: &[&str] = &["authoriz", "authoris", "grant", "approv"];
/// Top-level argument names that claim an authorization.
const RESERVED_ARGUMENTS: &[&str] = &[
    "authorization",
    "authorized",
    "authorised",
    "authorization_id",
    "grant",
    "grant_id",
    "grants",
    "granted",
    "approval",
    "approved",
    "approve",
    "approver",
    "arguments_sha256",
    "trust",
    "scope",
];

/// Parses one round's answer as an action.
pub fn parse(text: &str) -> Result<Action, ProtocolError> {
    action(strict_object(text)?)
}

/// The most reasons a judge's score may give, and the longest one.
pub const MAX_SCORE_REASONS: usize = 20;
pub const MAX_SCORE_REASON_CHARS: usize = 500;

/// A judge's answer: `{"type": "score", "value": 0..1, "reasons": ["…"]}`, parsed as
/// strictly as an action (one object, nothing around it, no duplicate or unknown key).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreAnswer {
    pub value: f64,
    pub reasons: Vec<String>,
}

/// Parses a judge's answer.
pub fn parse_score(text: &str) -> Result<ScoreAnswer, ProtocolError> {
    let mut map = strict_object(text)?;
    match map.remove("type") {
        None => return Err(ProtocolError::MissingKey("type")),
        Some(Value::String(s)) if s == "score" => {}
        Some(Value::String(s)) => return Err(ProtocolError::UnknownType(Value::String(s).to_string())),
        Some(_) => return Err(ProtocolError::WrongType { field: "type", expected: "\"score\"" }),
    }
    let value = match map.remove("value") {
        None => return Err(ProtocolError::MissingKey("value")),
        Some(v) => v.as_f64().filter(|v| (0.0..=1.0).contains(v)),
    }
    .ok_or(ProtocolError::WrongType { field: "value", expected: "a number from 0 to 1" })?;
    let reasons = match map.remove("reasons") {
        None => return Err(ProtocolError::MissingKey("reasons")),
        Some(Value::Array(items)) if items.len() <= MAX_SCORE_REASONS => items
            .into_iter()
            .map(|r| match r {
                Value::String(s) if !s.trim().is_empty() && s.chars().count() <= MAX_SCORE_REASON_CHARS => Ok(s),
                _ => Err(ProtocolError::WrongType {
                    field: "reasons",
                    expected: "a list of short texts (at most 500 characters each)",
                }),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ProtocolError::WrongType { field: "reasons", expected: "a list of at most 20 texts" });
        }
    };
    if let Some(k) = map.keys().next() {
        return Err(ProtocolError::UnknownKey(k.clone()));
    }
    Ok(ScoreAnswer { value: (value * 1000.0).round() / 1000.0, reasons })
}

/// The one JSON object an answer must be: no text around it, no fence, no duplicate key.
fn strict_object(text: &str) -> Result<Map<String, Value>, ProtocolError> {
    let body = text.trim_matches(|c: char| c.is_ascii_whitespace());
    if body.is_empty() {
        return Err(ProtocolError::Empty);
    }
    if body.starts_with("```") || body.ends_with("```") {
        return Err(ProtocolError::Fence);
    }
    if !body.starts_with('{') {
        return Err(ProtocolError::TextAround("before"));
    }
    let mut de = serde_json::Deserializer::from_str(body);
    let value = match StrictValue::deserialize(&mut de) {
        Ok(StrictValue(v)) => v,
        Err(e) => return Err(json_error(&e)),
    };
    if de.end().is_err() {
        return Err(ProtocolError::TextAround("after"));
    }
    let Value::Object(map) = value else { return Err(ProtocolError::TextAround("before")) };
    Ok(map)
}

/// The duplicate-key refusal travels through serde's error as text: read it back.
fn json_error(e: &serde_json::Error) -> ProtocolError {
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix(DUPLICATE) {
        let key = rest.split('`').next().unwrap_or_default();
        return ProtocolError::DuplicateKey(key.into());
    }
    if e.is_eof() {
        return ProtocolError::NotJson("it ends before the object is closed".into());
    }
    ProtocolError::NotJson(msg)
}

const DUPLICATE: &str = "duplicate key `";

fn action(mut map: Map<String, Value>) -> Result<Action, ProtocolError> {
    let kind = match map.remove("type") {
        None => return Err(ProtocolError::MissingKey("type")),
        Some(Value::String(s)) => s,
        Some(_) => return Err(ProtocolError::WrongType { field: "type", expected: "a string" }),
    };
    match kind.as_str() {
        "tool_call" => {
            let tool_id = match map.remove("tool_id") {
                None => return Err(ProtocolError::MissingKey("tool_id")),
                Some(Value::String(s)) if !s.is_empty() && s.chars().count() <= 200 => s,
                Some(_) => return Err(ProtocolError::WrongType { field: "tool_id", expected: "a tool id (a string)" }),
            };
            let arguments = match map.remove("arguments") {
                None => return Err(ProtocolError::MissingKey("arguments")),
                Some(Value::Object(a)) => a,
                Some(_) => return Err(ProtocolError::WrongType { field: "arguments", expected: "a JSON object" }),
            };
            if let Some(k) = map.keys().next() {
                return Err(ProtocolError::UnknownKey(k.clone()));
            }
            if is_reserved_tool_id(&tool_id) {
                return Err(ProtocolError::SelfAuthorization(tool_id));
            }
            if let Some(k) = arguments.keys().find(|k| claims_authorization(k)) {
                return Err(ProtocolError::SelfAuthorization(format!("arguments.{k}")));
            }
            Ok(Action::ToolCall { tool_id, arguments })
        }
        "final" => {
            let text = match map.remove("text") {
                None => return Err(ProtocolError::MissingKey("text")),
                Some(Value::String(s)) => s,
                Some(_) => return Err(ProtocolError::WrongType { field: "text", expected: "a string" }),
            };
            if let Some(k) = map.keys().next() {
                return Err(ProtocolError::UnknownKey(k.clone()));
            }
            Ok(Action::Final { text })
        }
        other => Err(ProtocolError::UnknownType(Value::String(other.into()).to_string())),
    }
}

/// Whether a tool id is in airlock's namespaces or claims a grant: no tool has one.
pub fn is_reserved_tool_id(id: &str) -> bool {
    let lowered = id.to_ascii_lowercase();
    RESERVED_TOOL_PREFIXES.iter().any(|p| lowered.starts_with(p))
        || RESERVED_TOOL_WORDS.iter().any(|w| lowered.contains(w))
}

fn claims_authorization(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.starts_with("_airlock") || k.starts_with("airlock") || RESERVED_ARGUMENTS.contains(&k.as_str())
}

/// A JSON value whose objects have no duplicate key, at any depth.
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("a number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("{DUPLICATE}{key}`")));
            }
            let StrictValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(tool: &str, args: Value) -> String {
        serde_json::json!({"type": "tool_call", "tool_id": tool, "arguments": args}).to_string()
    }

    #[test]
    fn a_judges_score_and_its_refusals() {
        let ok = parse_score(r#"{"type":"score","value":0.25,"reasons":["asks for a password"]}"#);
        assert_eq!(ok, Ok(ScoreAnswer { value: 0.25, reasons: vec!["asks for a password".into()] }));
        assert_eq!(parse_score(r#"{"type":"score","value":1,"reasons":[]}"#).map(|s| s.value), Ok(1.0));
        let refused = |text: &str| parse_score(text).map_err(|e| e.code());
        assert_eq!(refused(r#"Sure: {"type":"score","value":0.5,"reasons":[]}"#), Err("text_around"));
        assert_eq!(refused("```json\n{\"type\":\"score\",\"value\":0.5,\"reasons\":[]}\n```"), Err("fence"));
        assert_eq!(refused(r#"{"type":"score","value":0.1,"value":0.9,"reasons":[]}"#), Err("duplicate_key"));
        assert_eq!(refused(r#"{"type":"score","value":0.9,"reasons":[],"approve":true}"#), Err("unknown_key"));
        assert_eq!(refused(r#"{"type":"score","value":1.5,"reasons":[]}"#), Err("wrong_type"));
        assert_eq!(refused(r#"{"type":"score","value":-0.1,"reasons":[]}"#), Err("wrong_type"));
        assert_eq!(refused(r#"{"type":"score","value":"0.9","reasons":[]}"#), Err("wrong_type"));
        assert_eq!(refused(r#"{"type":"score","value":0.9,"reasons":[1]}"#), Err("wrong_type"));
        assert_eq!(refused(r#"{"type":"score","value":0.9,"reasons":"fine"}"#), Err("wrong_type"));
        assert_eq!(refused(r#"{"type":"score","value":0.9}"#), Err("missing_key"));
        assert_eq!(refused(r#"{"type":"final","text":"0.9"}"#), Err("unknown_type"));
        let many = serde_json::json!({"type": "score", "value": 0.9, "reasons": vec!["x"; MAX_SCORE_REASONS + 1]});
        assert_eq!(refused(&many.to_string()), Err("wrong_type"));
        let long =
            serde_json::json!({"type": "score", "value": 0.9, "reasons": ["x".repeat(MAX_SCORE_REASON_CHARS + 1)]});
        assert_eq!(refused(&long.to_string()), Err("wrong_type"));
    }

    #[test]
    fn the_two_actions() {
        assert_eq!(
            parse(&call("memory.read", serde_json::json!({}))),
            Ok(Action::ToolCall { tool_id: "memory.read".into(), arguments: Map::new() })
        );
        assert_eq!(parse("  {\"type\":\"final\",\"text\":\"done\"}\n"), Ok(Action::Final { text: "done".into() }));
    }

    #[test]
    fn every_refusal_names_what_was_wrong() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("```json\n{\"type\":\"final\",\"text\":\"x\"}\n```", "fence"),
            ("Sure! {\"type\":\"final\",\"text\":\"x\"}", "text_around"),
            ("{\"type\":\"final\",\"text\":\"x\"} I hope this helps", "text_around"),
            ("{\"type\":\"final\",\"text\":\"x\"}{\"type\":\"final\",\"text\":\"y\"}", "text_around"),
            ("{\"type\":\"final\",\"text\":", "not_json"),
            ("{'type':'final'}", "not_json"),
            ("{\"type\":\"final\",\"text\":\"a\",\"text\":\"b\"}", "duplicate_key"),
            ("{\"type\":\"tool_call\",\"tool_id\":\"t\",\"arguments\":{\"a\":1,\"a\":2}}", "duplicate_key"),
            ("{\"type\":\"tool_call\",\"tool_id\":\"t\",\"arguments\":{\"x\":{\"b\":1,\"b\":1}}}", "duplicate_key"),
            ("{\"type\":\"final\",\"text\":\"x\",\"reasoning\":\"...\"}", "unknown_key"),
            ("{\"type\":\"final\"}", "missing_key"),
            ("{\"text\":\"x\"}", "missing_key"),
            ("{\"type\":\"final\",\"text\":42}", "wrong_type"),
            ("{\"type\":\"tool_call\",\"tool_id\":\"t\",\"arguments\":[]}", "wrong_type"),
            ("{\"type\":\"tool_call\",\"tool_id\":7,\"arguments\":{}}", "wrong_type"),
            ("{\"type\":\"answer\",\"text\":\"x\"}", "unknown_type"),
            ("{\"type\":1}", "wrong_type"),
        ];
        for (text, code) in cases {
            let e = parse(text).unwrap_err();
            assert_eq!(e.code(), *code, "{text:?}: {e}");
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn nothing_claims_an_authorization() {
        for tool in
            ["airlock.grant", "admin.approve", "authorizations.grant", "grant_self", "auto_approve", "x.authorize"]
        {
            assert_eq!(parse(&call(tool, serde_json::json!({}))).unwrap_err().code(), "self_authorization", "{tool}");
        }
        for key in ["authorization", "grant_id", "approved", "arguments_sha256", "_airlock_scope", "Trust"] {
            let e = parse(&call("delivery.email", serde_json::json!({key: true}))).unwrap_err();
            assert_eq!(e.code(), "self_authorization", "{key}");
        }
        // Deeper down, a payload is the outside world's data, not a claim.
        assert!(parse(&call("delivery.webhook", serde_json::json!({"body": {"approved": true}}))).is_ok());
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        fn tool_id() -> impl Strategy<Value = String> {
            "[a-z][a-z0-9_]{0,10}(\\.[a-z][a-z0-9_]{0,10})?"
                .prop_filter("not reserved", |t| parse(&call(t, serde_json::json!({}))).is_ok())
        }

        fn scalar() -> impl Strategy<Value = Value> {
            prop_oneof![
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                "[ -~]{0,20}".prop_map(Value::String),
                Just(Value::Null),
            ]
        }

        fn arguments() -> impl Strategy<Value = Map<String, Value>> {
            proptest::collection::btree_map("[a-z]{1,8}", scalar(), 0..5)
                .prop_map(|m| m.into_iter().filter(|(k, _)| !claims_authorization(k)).collect::<Map<String, Value>>())
        }

        fn action() -> impl Strategy<Value = Action> {
            prop_oneof![
                (tool_id(), arguments()).prop_map(|(tool_id, arguments)| Action::ToolCall { tool_id, arguments }),
                "[ -~]{0,40}".prop_map(|text| Action::Final { text }),
            ]
        }

        /// The action's JSON text with a top-level key written twice.
        fn with_duplicate(a: &Action) -> String {
            let text = a.to_json().to_string();
            format!("{{\"type\":\"x\",{}", &text[1..])
        }

        proptest! {
            #[test]
            fn a_valid_action_parses_back_to_itself(a in action(), pad in "[ \t\r\n]{0,3}") {
                let text = format!("{pad}{}{pad}", a.to_json());
                prop_assert_eq!(parse(&text), Ok(a));
            }

            #[test]
            fn text_around_the_object_is_refused(a in action(), junk in "[!-~]{1,12}") {
                let text = a.to_json().to_string();
                let (before, after, spaced) = (format!("{junk}{text}"), format!("{text}{junk}"), format!("{text} {junk}"));
                prop_assert!(parse(&before).is_err());
                prop_assert!(parse(&after).is_err());
                prop_assert!(parse(&spaced).is_err());
                prop_assert_eq!(parse(&format!("```\n{text}\n```")).map_err(|e| e.code()), Err("fence"));
            }

            #[test]
            fn a_duplicate_or_unknown_key_is_refused(a in action(), extra in "[a-z]{1,8}") {
                prop_assert_eq!(parse(&with_duplicate(&a)).map_err(|e| e.code()), Err("duplicate_key"));
                let mut v = a.to_json();
                if v.get(&extra).is_none() {
                    v[&extra] = Value::Bool(true);
                    prop_assert_eq!(parse(&v.to_string()).map_err(|e| e.code()), Err("unknown_key"));
                }
            }

            #[test]
            fn a_wrong_type_or_a_missing_key_is_refused(a in action(), drop_key in 0usize..3, bad in scalar()) {
                let v = a.to_json();
                let keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                let key = &keys[drop_key % keys.len()];
                let mut dropped = v.clone();
                dropped.as_object_mut().unwrap().remove(key);
                prop_assert!(parse(&dropped.to_string()).is_err());
                let mut retyped = v.clone();
                let expected_string = key != "arguments";
                let wrong = if expected_string { !bad.is_string() } else { !bad.is_object() };
                if wrong {
                    retyped[key] = bad;
                    prop_assert!(parse(&retyped.to_string()).is_err());
                }
            }

            #[test]
            fn an_argument_that_claims_an_authorization_is_refused(
                tool in tool_id(),
                args in arguments(),
                key in prop::sample::select(RESERVED_ARGUMENTS),
                v in scalar(),
            ) {
                let mut args = args;
                args.insert(key.to_string(), v);
                let text = Action::ToolCall { tool_id: tool, arguments: args }.to_json().to_string();
                prop_assert_eq!(parse(&text).map_err(|e| e.code()), Err("self_authorization"));
            }

            #[test]
            fn any_text_is_an_action_or_a_refusal_never_a_panic(text in "\\PC{0,80}") {
                if let Ok(a) = parse(&text) {
                    // Whatever was accepted is one object that reads back the same.
                    prop_assert_eq!(parse(&a.to_json().to_string()), Ok(a));
                }
            }
        }
    }
}
