//! The journal: `memory/timeline_events.jsonl`, one immutable event a line.
//!
//! Each event names the machine that wrote it, its sequence number on that machine, a
//! Lamport clock, and `prev`: the hex sha256 of the exact bytes of the previous line
//! written by the same machine (null for its first). So each machine's events form a hash
//! chain, and all events have one total order: `(lamport, machine, seq)`.
//!
//! Merging two copies is a set union of lines: it verifies both chains, is commutative,
//! associative and idempotent, and never has a conflict to resolve. Two *different*
//! events with the same `(machine, seq)` are a fork, which only a forged or corrupted
//! copy can hold; merge refuses it.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::sha256_hex;

/// The path of the journal inside a capsule.
pub const PATH: &str = "memory/timeline_events.jsonl";

/// What an event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// `{"role": "system"|"user"|"assistant", "text"}`
    Message,
    /// `{"call_id", "name", "arguments": {…}}`
    ToolCall,
    /// `{"call_id", "content", "is_error"?}`
    ToolResult,
    /// A provider's private reasoning: `{"provider", "text", "signature"?}`
    Reasoning,
    /// The agent's own note, never shown to a model: `{"text"}`
    Note,
    /// The model provider changed: `{"from", "to"}`
    ProviderSwitch,
}

/// One line of the journal. Field order is the serialized order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub machine: String,
    pub seq: u64,
    pub lamport: u64,
    pub prev: Option<String>,
    /// RFC 3339 UTC.
    pub at: String,
    pub kind: EventKind,
    pub data: serde_json::Value,
}

/// An event with the exact bytes it was read from or written as, and their hash.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    raw: String,
    hash: String,
    event: Event,
}

impl Line {
    pub fn event(&self) -> &Event {
        &self.event
    }
    pub fn raw(&self) -> &str {
        &self.raw
    }
    pub fn hash(&self) -> &str {
        &self.hash
    }
    fn order_key(&self) -> (u64, &str, u64) {
        (self.event.lamport, self.event.machine.as_str(), self.event.seq)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    #[error("bad-chain: machine {machine} at seq {seq}")]
    BadChain { machine: String, seq: u64 },
    #[error("journal line {line}: {message}")]
    Malformed { line: usize, message: String },
}

/// A journal: lines in total order, without duplicates, every chain verified.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Journal {
    lines: Vec<Line>,
}

impl Journal {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses a journal file and verifies every machine's chain.
    pub fn parse(bytes: &[u8]) -> Result<Self, JournalError> {
        let lines = parse_lines(bytes)?;
        let j = Self::from_lines(lines);
        j.check()?;
        Ok(j)
    }

    fn from_lines(lines: Vec<Line>) -> Self {
        let mut seen = HashSet::new();
        let mut lines: Vec<Line> = lines.into_iter().filter(|l| seen.insert(l.hash.clone())).collect();
        lines.sort_by(|a, b| a.order_key().cmp(&b.order_key()).then_with(|| a.hash.cmp(&b.hash)));
        Self { lines }
    }

    /// The first break of each machine's chain (empty when every chain holds).
    pub fn chain_breaks(&self) -> Vec<(String, u64)> {
        chain_breaks(&self.lines)
    }

    fn check(&self) -> Result<(), JournalError> {
        match self.chain_breaks().into_iter().next() {
            None => Ok(()),
            Some((machine, seq)) => Err(JournalError::BadChain { machine, seq }),
        }
    }

    /// The bytes of the file: one line per event in total order, each ending in `\n`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for l in &self.lines {
            out.extend_from_slice(l.raw.as_bytes());
            out.push(b'\n');
        }
        out
    }

    /// Events in total order.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.lines.iter().map(|l| &l.event)
    }

    pub fn lines(&self) -> &[Line] {
        &self.lines
    }

    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The highest Lamport clock seen.
    pub fn lamport(&self) -> u64 {
        self.lines.iter().map(|l| l.event.lamport).max().unwrap_or(0)
    }

    /// Appends an event written by `machine`: next sequence number on that machine,
    /// chained to its previous line, with a clock above every event seen.
    pub fn append(&mut self, machine: &str, kind: EventKind, data: serde_json::Value, at: &str) -> &Event {
        let last = self.lines.iter().filter(|l| l.event.machine == machine).max_by_key(|l| l.event.seq);
        let event = Event {
            machine: machine.to_string(),
            seq: last.map_or(1, |l| l.event.seq + 1),
            lamport: self.lamport() + 1,
            prev: last.map(|l| l.hash.clone()),
            at: at.to_string(),
            kind,
            data,
        };
        let raw = serde_json::to_string(&event).unwrap_or_default();
        let hash = sha256_hex(raw.as_bytes());
        // The new clock is above every other, so the line goes last in the total order.
        self.lines.push(Line { raw, hash, event });
        let n = self.lines.len() - 1;
        &self.lines[n].event
    }
}

/// The union of two copies of a journal. Verifies both chains and the union's (a fork,
/// i.e. two different events with one `(machine, seq)`, is refused).
pub fn merge(a: &Journal, b: &Journal) -> Result<Journal, JournalError> {
    a.check()?;
    b.check()?;
    let union = Journal::from_lines(a.lines.iter().chain(b.lines.iter()).cloned().collect());
    union.check()?;
    Ok(union)
}

fn parse_lines(bytes: &[u8]) -> Result<Vec<Line>, JournalError> {
    let text =
        std::str::from_utf8(bytes).map_err(|_| JournalError::Malformed { line: 1, message: "not UTF-8".into() })?;
    let mut lines = Vec::new();
    let body = text.strip_suffix('\n').unwrap_or(text);
    if body.is_empty() {
        return Ok(lines);
    }
    for (i, raw) in body.split('\n').enumerate() {
        let event: Event =
            serde_json::from_str(raw).map_err(|e| JournalError::Malformed { line: i + 1, message: e.to_string() })?;
        lines.push(Line { raw: raw.to_string(), hash: sha256_hex(raw.as_bytes()), event });
    }
    Ok(lines)
}

fn chain_breaks(lines: &[Line]) -> Vec<(String, u64)> {
    let mut by_machine: BTreeMap<&str, Vec<&Line>> = BTreeMap::new();
    for l in lines {
        by_machine.entry(l.event.machine.as_str()).or_default().push(l);
    }
    let mut breaks = Vec::new();
    for (machine, mut chain) in by_machine {
        chain.sort_by_key(|l| l.event.seq);
        let mut prev: Option<&Line> = None;
        for l in chain {
            let ok = match prev {
                None => l.event.seq == 1 && l.event.prev.is_none(),
                Some(p) => {
                    l.event.seq == p.event.seq + 1
                        && l.event.prev.as_deref() == Some(p.hash.as_str())
                        && l.event.lamport > p.event.lamport
                }
            };
            if !ok {
                breaks.push((machine.to_string(), l.event.seq));
                break;
            }
            prev = Some(l);
        }
    }
    breaks
}

/// Checks the journal file's bytes for the verifier: every machine's first chain break,
/// or the first malformed line.
pub fn check_bytes(bytes: &[u8]) -> Result<Vec<(String, u64)>, JournalError> {
    let lines = parse_lines(bytes)?;
    // Duplicated lines are harmless; the chain check sees each once.
    let mut seen = HashMap::new();
    let unique: Vec<Line> = lines.into_iter().filter(|l| seen.insert(l.hash.clone(), ()).is_none()).collect();
    Ok(chain_breaks(&unique))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(j: &mut Journal, m: &str, t: &str) {
        j.append(m, EventKind::Message, json!({"role": "user", "text": t}), "2026-01-01T00:00:00Z");
    }

    #[test]
    fn chains_and_order() {
        let mut a = Journal::new();
        text(&mut a, "m1", "one");
        text(&mut a, "m1", "two");
        let mut b = a.clone();
        text(&mut a, "m1", "three");
        text(&mut b, "m2", "elsewhere");
        let m = merge(&a, &b).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m, merge(&b, &a).unwrap());
        let parsed = Journal::parse(&m.to_bytes()).unwrap();
        assert_eq!(parsed, m);
        // Total order: (lamport, machine, seq); m1#3 and m2#1 both have lamport 3.
        let order: Vec<(String, u64)> = m.events().map(|e| (e.machine.clone(), e.seq)).collect();
        assert_eq!(order[2], ("m1".into(), 3));
        assert_eq!(order[3], ("m2".into(), 1));
        let mut c = m.clone();
        text(&mut c, "m2", "after merge");
        assert_eq!(c.events().last().unwrap().lamport, 4);
    }

    #[test]
    fn tampering_breaks_the_chain() {
        let mut a = Journal::new();
        for t in ["a", "b", "c"] {
            text(&mut a, "m1", t);
        }
        let bytes = String::from_utf8(a.to_bytes()).unwrap().replacen("\"b\"", "\"B\"", 1);
        assert_eq!(
            Journal::parse(bytes.as_bytes()).unwrap_err(),
            JournalError::BadChain { machine: "m1".into(), seq: 3 }
        );
        let dropped: Vec<&str> = String::from_utf8(a.to_bytes()).unwrap().leak().lines().collect();
        let without_first = format!("{}\n{}\n", dropped[1], dropped[2]);
        assert_eq!(check_bytes(without_first.as_bytes()).unwrap(), vec![("m1".to_string(), 2)]);
    }

    #[test]
    fn forks_are_refused() {
        let mut a = Journal::new();
        text(&mut a, "m1", "base");
        let mut b = a.clone();
        text(&mut a, "m1", "left");
        text(&mut b, "m1", "right");
        assert!(matches!(merge(&a, &b), Err(JournalError::BadChain { .. })));
    }
}
