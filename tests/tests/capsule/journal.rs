//! The journal's merge is a set union: commutative, associative, idempotent, and it keeps
//! every machine's hash chain intact. Copies are built the way machines build them (each
//! appends as itself, and copies sync by merging), then merged in every order.
#![allow(clippy::unwrap_used)]

use airlock_capsule::journal::{EventKind, Journal, JournalError, merge};
use proptest::prelude::*;
use serde_json::json;

/// One step of a simulated fleet: copy `i` appends as machine `m{i}`, or copy `i` merges
/// copy `j` in.
#[derive(Debug, Clone)]
enum Op {
    Append(usize),
    Sync(usize, usize),
}

fn op(copies: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..copies).prop_map(Op::Append),
        1 => (0..copies, 0..copies).prop_map(|(i, j)| Op::Sync(i, j)),
    ]
}

fn run(ops: &[Op], copies: usize) -> Vec<Journal> {
    let mut js = vec![Journal::new(); copies];
    for (n, o) in ops.iter().enumerate() {
        match *o {
            Op::Append(i) => {
                js[i].append(
                    &format!("m{i}"),
                    EventKind::Message,
                    json!({"role": "user", "text": n}),
                    "2026-11-29T00:00:00Z",
                );
            }
            Op::Sync(i, j) => js[i] = merge(&js[i], &js[j]).unwrap(),
        }
    }
    js
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn merge_is_a_lawful_union(ops in proptest::collection::vec(op(3), 0..40)) {
        let js = run(&ops, 3);
        let (a, b, c) = (&js[0], &js[1], &js[2]);
        let ab = merge(a, b).unwrap();
        prop_assert_eq!(ab.to_bytes(), merge(b, a).unwrap().to_bytes());
        prop_assert_eq!(merge(&ab, c).unwrap().to_bytes(), merge(a, &merge(b, c).unwrap()).unwrap().to_bytes());
        prop_assert_eq!(merge(a, a).unwrap().to_bytes(), a.to_bytes());
        // Every event of both is in the union, once; every chain still verifies.
        prop_assert!(ab.len() <= a.len() + b.len());
        for l in a.lines().iter().chain(b.lines()) {
            prop_assert!(ab.lines().iter().any(|m| m.hash() == l.hash()));
        }
        prop_assert!(ab.chain_breaks().is_empty());
        let reparsed = Journal::parse(&ab.to_bytes()).unwrap();
        prop_assert_eq!(reparsed.to_bytes(), ab.to_bytes());
        // The total order is (lamport, machine, seq), strictly.
        let keys: Vec<(u64, String, u64)> = ab.events().map(|e| (e.lamport, e.machine.clone(), e.seq)).collect();
        prop_assert!(keys.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_tampered_line_is_refused_by_merge(ops in proptest::collection::vec(op(2), 2..30), pick in any::<proptest::sample::Index>()) {
        let js = run(&ops, 2);
        let a = &js[0];
        prop_assume!(a.len() >= 2);
        let text = String::from_utf8(a.to_bytes()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        // Change one line that another line of the same machine chains to.
        let i = pick.index(lines.len());
        let e = a.lines()[i].event();
        let has_successor = a.events().any(|o| o.machine == e.machine && o.seq == e.seq + 1);
        prop_assume!(has_successor);
        let mut forged: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
        forged[i] = forged[i].replacen("\"text\":", "\"text\":\"x\",\"was\":", 1);
        let bytes = forged.join("\n") + "\n";
        let refused = Journal::parse(bytes.as_bytes());
        let is_bad_chain = matches!(refused, Err(JournalError::BadChain { .. }));
        prop_assert!(is_bad_chain);
    }
}
