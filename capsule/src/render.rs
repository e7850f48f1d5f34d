//! Rendering the journal for a model provider: pure functions of the journal.
//!
//! The journal records what happened (a message, a tool call, its result), not how a
//! provider spells it, so an agent can switch providers mid-conversation and back without
//! loss. Three rules:
//! - Private reasoning is provider-specific: reasoning recorded from one provider is never
//!   shown to another (it is dropped when the provider changes).
//! - A tool call without a result (the machine died mid-call) gets an explicit error result;
//!   every provider refuses a dangling call. Results are placed right after their calls.
//! - [`fit`] keeps the newest events that fit a context window, never separates a call from
//!   its result, and puts a short digest of what was cut at the head.
//!
//! Event data shapes are documented on [`EventKind`](super::journal::EventKind).

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::journal::{Event, EventKind};

/// A model provider's message format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// OpenAI chat completions (`messages` with `tool_calls` and `tool` messages).
    OpenAi,
    /// Anthropic messages (`system`, and `tool_use`/`tool_result` content blocks).
    Anthropic,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}

/// The result given to a call that never got one.
pub const MISSING_RESULT: &str = "error: no result was recorded for this tool call (the machine running it stopped); it may or may not have taken effect";

/// One step of the conversation, provider-neutral.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    System(String),
    User(String),
    Assistant(String),
    Reasoning { text: String, signature: Option<String> },
    Call { id: String, name: String, arguments: Value },
    Result { id: String, content: String, is_error: bool },
}

fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn call_id(e: &Event) -> Option<&str> {
    e.data.get("call_id").and_then(Value::as_str)
}

/// Emits the results of a run of calls, in call order: the recorded one, or an error.
fn flush<'a>(
    group: &mut Vec<&'a str>,
    items: &mut Vec<Item>,
    placed: &mut HashSet<&'a str>,
    results: &HashMap<&'a str, &'a Event>,
) {
    for id in group.drain(..) {
        if !placed.insert(id) {
            continue;
        }
        items.push(match results.get(id) {
            Some(r) => Item::Result {
                id: id.to_string(),
                content: text_of(r.data.get("content").unwrap_or(&Value::Null)),
                is_error: r.data.get("is_error").and_then(Value::as_bool).unwrap_or(false),
            },
            None => Item::Result { id: id.to_string(), content: MISSING_RESULT.into(), is_error: true },
        });
    }
}

/// The conversation as `target` may see it: notes and switches left out, other providers'
/// reasoning dropped, results moved right after their calls, missing results filled in.
fn conversation(events: &[Event], target: Provider) -> Vec<Item> {
    let mut results: HashMap<&str, &Event> = HashMap::new();
    for e in events.iter().filter(|e| e.kind == EventKind::ToolResult) {
        if let Some(id) = call_id(e) {
            results.entry(id).or_insert(e);
        }
    }
    let calls: HashSet<&str> = events.iter().filter(|e| e.kind == EventKind::ToolCall).filter_map(call_id).collect();
    let mut items = Vec::new();
    let mut group: Vec<&str> = Vec::new();
    let mut placed: HashSet<&str> = HashSet::new();
    for e in events {
        if e.kind == EventKind::ToolCall {
            if let Some(id) = call_id(e)
                && !placed.contains(id)
                && !group.contains(&id)
            {
                items.push(Item::Call {
                    id: id.to_string(),
                    name: e.data.get("name").and_then(Value::as_str).unwrap_or("unknown").to_string(),
                    arguments: e.data.get("arguments").cloned().unwrap_or_else(|| json!({})),
                });
                group.push(id);
            }
            continue;
        }
        flush(&mut group, &mut items, &mut placed, &results);
        match e.kind {
            EventKind::Message => {
                let text = text_of(e.data.get("text").unwrap_or(&Value::Null));
                match e.data.get("role").and_then(Value::as_str) {
                    Some("system") => items.push(Item::System(text)),
                    Some("assistant") => items.push(Item::Assistant(text)),
                    _ => items.push(Item::User(text)),
                }
            }
            EventKind::Reasoning => {
                let from = e.data.get("provider").and_then(Value::as_str);
                if from == Some(target.as_str()) {
                    items.push(Item::Reasoning {
                        text: text_of(e.data.get("text").unwrap_or(&Value::Null)),
                        signature: e.data.get("signature").and_then(Value::as_str).map(str::to_string),
                    });
                }
            }
            // A result is placed after its call; one without a call is dropped.
            EventKind::ToolResult => {
                if call_id(e).is_none_or(|id| !calls.contains(id)) {
                    continue;
                }
            }
            EventKind::Note | EventKind::ProviderSwitch | EventKind::ToolCall => {}
        }
    }
    flush(&mut group, &mut items, &mut placed, &results);
    items
}

/// OpenAI chat-completions `messages` for the journal, with an optional digest at the head.
pub fn render_openai(events: &[Event], digest: Option<&str>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    if let Some(d) = digest {
        out.push(json!({"role": "system", "content": d}));
    }
    let mut reasoning: Vec<String> = Vec::new();
    // Whether the last message is an assistant message that tool calls may join.
    let mut open_assistant = false;
    for item in conversation(events, Provider::OpenAi) {
        match item {
            Item::System(t) => {
                out.push(json!({"role": "system", "content": t}));
                open_assistant = false;
            }
            Item::User(t) => {
                out.push(json!({"role": "user", "content": t}));
                open_assistant = false;
            }
            Item::Assistant(t) => {
                let mut m = json!({"role": "assistant", "content": t});
                if !reasoning.is_empty() {
                    m["reasoning_content"] = Value::String(reasoning.join("\n\n"));
                    reasoning.clear();
                }
                out.push(m);
                open_assistant = true;
            }
            Item::Reasoning { text, .. } => reasoning.push(text),
            Item::Call { id, name, arguments } => {
                let call = json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": arguments.to_string()}});
                if !open_assistant {
                    let mut m = json!({"role": "assistant", "content": null, "tool_calls": []});
                    if !reasoning.is_empty() {
                        m["reasoning_content"] = Value::String(reasoning.join("\n\n"));
                        reasoning.clear();
                    }
                    out.push(m);
                    open_assistant = true;
                }
                if let Some(last) = out.last_mut() {
                    match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                }
            }
            Item::Result { id, content, .. } => {
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                open_assistant = false;
            }
        }
    }
    out
}

/// An Anthropic messages request body's `system` and `messages` for the journal, with an
/// optional digest at the head of `system`. Consecutive blocks of one role share a message.
pub fn render_anthropic(events: &[Event], digest: Option<&str>) -> Value {
    let mut system: Vec<String> = digest.map(str::to_string).into_iter().collect();
    let mut messages: Vec<(String, Vec<Value>)> = Vec::new();
    let mut push = |role: &str, block: Value| match messages.last_mut() {
        Some((r, blocks)) if r == role => blocks.push(block),
        _ => messages.push((role.to_string(), vec![block])),
    };
    for item in conversation(events, Provider::Anthropic) {
        match item {
            Item::System(t) => system.push(t),
            Item::User(t) => push("user", json!({"type": "text", "text": t})),
            Item::Assistant(t) => push("assistant", json!({"type": "text", "text": t})),
            // Thinking can only be replayed with the provider's signature.
            Item::Reasoning { text, signature: Some(sig) } => {
                push("assistant", json!({"type": "thinking", "thinking": text, "signature": sig}))
            }
            Item::Reasoning { signature: None, .. } => {}
            Item::Call { id, name, arguments } => {
                push("assistant", json!({"type": "tool_use", "id": id, "name": name, "input": arguments}))
            }
            Item::Result { id, content, is_error } => {
                let mut b = json!({"type": "tool_result", "tool_use_id": id, "content": content});
                if is_error {
                    b["is_error"] = Value::Bool(true);
                }
                push("user", b)
            }
        }
    }
    let messages: Vec<Value> =
        messages.into_iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    let mut body = json!({"messages": messages});
    if !system.is_empty() {
        body["system"] = Value::String(system.join("\n\n"));
    }
    body
}

/// Renders for `provider`.
pub fn render(events: &[Event], provider: Provider, digest: Option<&str>) -> Value {
    match provider {
        Provider::OpenAi => json!({"messages": render_openai(events, digest)}),
        Provider::Anthropic => render_anthropic(events, digest),
    }
}

/// A rough token count of one event (4 bytes a token, plus framing).
pub fn estimate_tokens(e: &Event) -> usize {
    (e.data.to_string().len() + 16).div_ceil(4)
}

/// Tokens set aside for the digest when something is cut.
pub const DIGEST_TOKENS: usize = 80;
const DIGEST_MAX_CHARS: usize = 300;

/// What [`fit`] keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    /// A short account of what was cut, for the head of the rendering.
    pub digest: Option<String>,
    /// System messages (always kept) and the newest events that fit, in journal order.
    pub events: Vec<Event>,
    /// How many events were cut.
    pub cut: usize,
}

/// Keeps the newest events that fit `window` tokens. A tool call and its result are one
/// unit (with everything between them): both in or both out. System messages are always
/// kept. When anything is cut, `DIGEST_TOKENS` of the window go to a digest.
pub fn fit(events: &[Event], window: usize) -> Fitted {
    let total: usize = events.iter().map(estimate_tokens).sum();
    if total <= window {
        return Fitted { digest: None, events: events.to_vec(), cut: 0 };
    }
    let pinned =
        |e: &Event| e.kind == EventKind::Message && e.data.get("role").and_then(Value::as_str) == Some("system");
    let pinned_cost: usize = events.iter().filter(|e| pinned(e)).map(estimate_tokens).sum();
    let mut budget = window.saturating_sub(pinned_cost).saturating_sub(DIGEST_TOKENS);

    // Units: contiguous ranges that contain every call together with its result.
    let mut result_at: HashMap<&str, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate().rev() {
        if e.kind == EventKind::ToolResult
            && let Some(id) = call_id(e)
        {
            result_at.insert(id, i);
        }
    }
    let mut reach: Vec<usize> = (0..events.len()).collect();
    for (i, e) in events.iter().enumerate() {
        if e.kind == EventKind::ToolCall
            && let Some(&j) = call_id(e).and_then(|id| result_at.get(id))
            && j > i
        {
            reach[i] = j;
        }
    }
    let mut units: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < events.len() {
        let (start, mut end, mut k) = (i, reach[i], i);
        while k <= end {
            end = end.max(reach[k]);
            k += 1;
        }
        units.push((start, end));
        i = end + 1;
    }

    let mut keep_from = events.len();
    for &(start, end) in units.iter().rev() {
        let cost: usize = events[start..=end].iter().filter(|e| !pinned(e)).map(estimate_tokens).sum();
        if cost > budget {
            break;
        }
        budget -= cost;
        keep_from = start;
    }
    let kept: Vec<Event> =
        events.iter().enumerate().filter(|(i, e)| *i >= keep_from || pinned(e)).map(|(_, e)| e.clone()).collect();
    let cut: Vec<&Event> = events[..keep_from].iter().filter(|e| !pinned(e)).collect();
    let digest = (!cut.is_empty()).then(|| digest(&cut));
    Fitted { digest, events: kept, cut: cut.len() }
}

fn digest(cut: &[&Event]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tools: Vec<&str> = Vec::new();
    for e in cut {
        let label = match (e.kind, e.data.get("role").and_then(Value::as_str)) {
            (EventKind::Message, Some("assistant")) => "assistant messages",
            (EventKind::Message, _) => "user messages",
            (EventKind::ToolCall, _) => {
                if let Some(n) = e.data.get("name").and_then(Value::as_str)
                    && !tools.contains(&n)
                {
                    tools.push(n);
                }
                "tool calls"
            }
            (EventKind::ToolResult, _) => "tool results",
            (EventKind::Reasoning, _) => "reasoning",
            (EventKind::Note, _) => "notes",
            (EventKind::ProviderSwitch, _) => "provider switches",
        };
        *counts.entry(label).or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
    let mut s = format!(
        "[Earlier history condensed: {} events cut ({}), from {} to {}",
        cut.len(),
        parts.join(", "),
        cut.first().map_or("", |e| e.at.as_str()),
        cut.last().map_or("", |e| e.at.as_str()),
    );
    if !tools.is_empty() {
        s.push_str(&format!("; tools used: {}", tools.join(", ")));
    }
    if s.chars().count() > DIGEST_MAX_CHARS - 2 {
        s = s.chars().take(DIGEST_MAX_CHARS - 3).collect::<String>() + "…";
    }
    s.push_str(".]");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::Journal;

    fn journal() -> Vec<Event> {
        let mut j = Journal::new();
        let at = "2026-01-01T00:00:00Z";
        j.append("m", EventKind::Message, json!({"role": "system", "text": "be brief"}), at);
        j.append("m", EventKind::Message, json!({"role": "user", "text": "list files"}), at);
        j.append("m", EventKind::Reasoning, json!({"provider": "openai", "text": "secret thoughts"}), at);
        j.append("m", EventKind::ToolCall, json!({"call_id": "c1", "name": "ls", "arguments": {"dir": "."}}), at);
        j.append("m", EventKind::ToolCall, json!({"call_id": "c2", "name": "cat", "arguments": {"f": "x"}}), at);
        j.append("m", EventKind::ToolResult, json!({"call_id": "c1", "content": "a b"}), at);
        j.events().cloned().collect()
    }

    #[test]
    fn dangling_call_gets_an_error_and_reasoning_stays_with_its_provider() {
        let ev = journal();
        let oa = render_openai(&ev, None);
        assert_eq!(oa[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(oa[2]["reasoning_content"], "secret thoughts");
        assert_eq!(oa[4]["tool_call_id"], "c2");
        assert_eq!(oa[4]["content"], MISSING_RESULT);
        let an = render_anthropic(&ev, None);
        assert!(!an.to_string().contains("secret thoughts"));
        assert_eq!(an["messages"][2]["content"][1]["is_error"], true);
    }

    #[test]
    fn fit_keeps_pairs_and_digests_the_rest() {
        let ev = journal();
        let all: usize = ev.iter().map(estimate_tokens).sum();
        assert_eq!(fit(&ev, all).cut, 0);
        let f = fit(&ev, all - 1);
        assert_eq!(f.events.len(), 1, "only the system message fits beside the digest");
        assert!(f.digest.as_deref().unwrap().starts_with("[Earlier history condensed"));
        assert_eq!(f.events[0].data["text"], "be brief");
        let has = |id: &str, k: EventKind| f.events.iter().any(|e| e.kind == k && call_id(e) == Some(id));
        assert_eq!(has("c1", EventKind::ToolCall), has("c1", EventKind::ToolResult));
    }
}
