//! What the scripted agent (`airlock-scripted-agent`) does, for the suites that kill it at
//! every boundary: its operations in order, each with a `before:` and an `after:` boundary.

/// Every operation of the script, in order.
pub const OPS: &[&str] = &[
    "claim",
    "read_log",
    "record:plan",
    "begin:charge",
    "write:charge",
    "outcome:charge",
    "record:observe",
    "begin:notify",
    "write:notify",
    "outcome:notify",
    "submit:report",
    "record:final",
    "complete",
];

/// Every boundary: `before:<op>` and `after:<op>` of each operation.
pub fn boundaries() -> Vec<String> {
    OPS.iter().flat_map(|op| [format!("before:{op}"), format!("after:{op}")]).collect()
}
