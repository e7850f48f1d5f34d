//! Rendering the journal for OpenAI chat completions and Anthropic messages: golden files
//! for a journal that switches providers and leaves a call without a result, and property
//! tests for `fit` (a call and its result are always both in or both out).
//!
//! Set `UPDATE_GOLDEN=1` to rewrite the golden files after an intended change.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use airlock_capsule::journal::{Event, EventKind, Journal};
use airlock_capsule::render::{self, DIGEST_TOKENS, MISSING_RESULT, Provider, estimate_tokens, fit};
use proptest::prelude::*;
use serde_json::{Value, json};

fn golden(name: &str, value: &Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/capsule/golden").join(name);
    let text = serde_json::to_string_pretty(value).unwrap() + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want =
        std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("{} is missing (UPDATE_GOLDEN=1)", path.display()));
    assert_eq!(text, want, "{} differs from the rendering", path.display());
}

/// A conversation on openai with a tool call and private reasoning, a switch to
/// anthropic (with its own signed thinking), and a call the machine died during.
fn conversation() -> Vec<Event> {
    let mut j = Journal::new();
    let at = "2026-11-29T10:00:00Z";
    let mut add = |k: EventKind, d: Value| {
        j.append("node_a", k, d, at);
    };
    add(EventKind::Message, json!({"role": "system", "text": "You are a release assistant."}));
    add(EventKind::Message, json!({"role": "user", "text": "Is the build green?"}));
    add(EventKind::Reasoning, json!({"provider": "openai", "text": "Check CI before answering."}));
    add(EventKind::ToolCall, json!({"call_id": "call_1", "name": "ci_status", "arguments": {"branch": "main"}}));
    add(EventKind::ToolResult, json!({"call_id": "call_1", "content": {"state": "green"}}));
    add(EventKind::Message, json!({"role": "assistant", "text": "Yes, main is green."}));
    add(EventKind::Note, json!({"text": "user cares about main only"}));
    add(EventKind::ProviderSwitch, json!({"from": "openai", "to": "anthropic"}));
    add(EventKind::Message, json!({"role": "user", "text": "Then tag the release."}));
    add(
        EventKind::Reasoning,
        json!({"provider": "anthropic", "text": "Tagging is irreversible; confirm the version.", "signature": "sig-abc"}),
    );
    add(EventKind::ToolCall, json!({"call_id": "toolu_2", "name": "git_tag", "arguments": {"tag": "v1.4.0"}}));
    add(EventKind::ToolCall, json!({"call_id": "toolu_3", "name": "notify", "arguments": {"channel": "#releases"}}));
    add(EventKind::ToolResult, json!({"call_id": "toolu_3", "content": "sent"}));
    j.events().cloned().collect()
}

#[test]
fn openai_golden() {
    let out = render::render(&conversation(), Provider::OpenAi, None);
    assert!(!out.to_string().contains("irreversible"), "anthropic's thinking is not shown to openai");
    assert!(!out.to_string().contains("user cares"), "notes are never shown");
    golden("openai.json", &out);
}

#[test]
fn anthropic_golden() {
    let out = render::render(&conversation(), Provider::Anthropic, None);
    assert!(!out.to_string().contains("Check CI"), "openai's reasoning is dropped after the switch");
    let dangling = &out["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["content"].as_array().unwrap().clone())
        .find(|b| b["tool_use_id"] == "toolu_2")
        .unwrap();
    assert_eq!((dangling["content"].as_str(), dangling["is_error"].as_bool()), (Some(MISSING_RESULT), Some(true)));
    golden("anthropic.json", &out);
}

#[test]
fn fitted_golden() {
    let events = conversation();
    let total: usize = events.iter().map(estimate_tokens).sum();
    let f = fit(&events, total / 2 + DIGEST_TOKENS / 2);
    assert!(f.cut > 0);
    golden("openai_fitted.json", &render::render(&f.events, Provider::OpenAi, f.digest.as_deref()));
    golden("anthropic_fitted.json", &render::render(&f.events, Provider::Anthropic, f.digest.as_deref()));
}

/// Random journals: messages, calls with or without results (results after some delay,
/// possibly after other events), reasoning, notes.
fn journal() -> impl Strategy<Value = Vec<Event>> {
    proptest::collection::vec((0u8..6, 0usize..4, 1usize..200), 0..40).prop_map(|steps| {
        let mut j = Journal::new();
        let mut open: Vec<String> = Vec::new();
        for (n, (kind, delay, size)) in steps.into_iter().enumerate() {
            let at = "2026-11-29T10:00:00Z";
            let text = "x".repeat(size);
            match kind {
                0 | 1 => {
                    j.append(
                        "m",
                        EventKind::Message,
                        json!({"role": if kind == 0 { "user" } else { "assistant" }, "text": text}),
                        at,
                    );
                }
                2 => {
                    let id = format!("c{n}");
                    j.append(
                        "m",
                        EventKind::ToolCall,
                        json!({"call_id": id, "name": "t", "arguments": {"a": text}}),
                        at,
                    );
                    open.push(id);
                }
                3 if !open.is_empty() => {
                    let id = open.remove(delay % open.len());
                    j.append("m", EventKind::ToolResult, json!({"call_id": id, "content": text}), at);
                }
                4 => {
                    j.append("m", EventKind::Reasoning, json!({"provider": "openai", "text": text}), at);
                }
                _ => {
                    j.append("m", EventKind::Note, json!({"text": text}), at);
                }
            }
        }
        j.events().cloned().collect()
    })
}

fn call_id(e: &Event) -> Option<&str> {
    e.data.get("call_id").and_then(Value::as_str)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn fit_never_separates_a_call_from_its_result(events in journal(), window in 0usize..3000) {
        let f = fit(&events, window);
        let kept = |k: EventKind, id: &str| f.events.iter().any(|e| e.kind == k && call_id(e) == Some(id));
        for e in events.iter().filter(|e| e.kind == EventKind::ToolCall) {
            let id = call_id(e).unwrap();
            let has_result = events.iter().any(|r| r.kind == EventKind::ToolResult && call_id(r) == Some(id));
            if has_result {
                prop_assert_eq!(kept(EventKind::ToolCall, id), kept(EventKind::ToolResult, id), "call {}", id);
            }
        }
        // It keeps a suffix of the journal (the newest), and fits the window when it cuts.
        prop_assert_eq!(f.events.len() + f.cut, events.len());
        prop_assert_eq!(&f.events[..], &events[events.len() - f.events.len()..]);
        let used: usize = f.events.iter().map(estimate_tokens).sum();
        if f.cut > 0 {
            prop_assert!(used + DIGEST_TOKENS <= window.max(DIGEST_TOKENS));
            prop_assert!(f.digest.is_some());
        } else {
            prop_assert!(f.digest.is_none());
        }
        // Every rendering pairs each call with exactly one result.
        for p in [Provider::OpenAi, Provider::Anthropic] {
            let out = render::render(&f.events, p, f.digest.as_deref()).to_string();
            for e in f.events.iter().filter(|e| e.kind == EventKind::ToolCall) {
                let id = call_id(e).unwrap();
                let results = match p {
                    Provider::OpenAi => out.matches(&format!("\"tool_call_id\":\"{id}\"")).count(),
                    Provider::Anthropic => out.matches(&format!("\"tool_use_id\":\"{id}\"")).count(),
                };
                prop_assert_eq!(results, 1, "{} in {:?}", id, p);
            }
        }
    }
}
