//! Completions that name the held job's partition.
//!
//! A statement over `jobs_live` runs over all its partitions (the ring's slots and
//! `jobs_long`): Postgres prunes their scans when the plan starts, but a DELETE still sets up
//! every partition it might write. Completing one job costs several times what it did on one
//! table. A held job's [`Lease`] remembers the partition it was claimed in, so completing
//! one job deletes it from that partition by name, one primary-key lookup.
//!
//! The partition is a hint: the ring may have moved the job to `jobs_long` since (it does so
//! under the slot's lock, see `airlock_job_ring_recycle`). When the named partition no longer
//! holds the job at that epoch, the same statement falls back to `airlock_jobs_complete` over
//! every live partition, in a query of its own with a snapshot taken after the move; a lease
//! that was lost is found nowhere, as before.

use std::sync::LazyLock;

use crate::lease::Lease;

/// The live partitions a slot names (`0028_job_ring`): the ring's four and `jobs_long`.
const LEAVES: [(i16, &str); 5] =
    [(-1, "jobs_long"), (0, "jobs_ring_0"), (1, "jobs_ring_1"), (2, "jobs_ring_2"), (3, "jobs_ring_3")];

/// The common table expressions `gone` and `done` completing the job held under the lease
/// `$id`, `$attempt` in `leaf`; `done` yields its `(id, attempt)` when it was held.
fn done_ctes(leaf: &str, keep: bool, id: u8, attempt: u8) -> String {
    let held = format!("id = ${id} AND attempt = ${attempt} AND state = 'running'");
    let fallback = format!(
        "SELECT id, attempt FROM airlock_jobs_complete(ARRAY[${id}::uuid], ARRAY[${attempt}::integer], {keep}) \
         WHERE NOT EXISTS (SELECT 1 FROM gone)"
    );
    if keep {
        format!(
            "gone AS (DELETE FROM {leaf} WHERE {held} RETURNING *), \
             moved AS (INSERT INTO jobs_done (id, kind, queue, payload, state, priority, run_at, attempt, \
                 max_attempts, effect_class, effect_started_at, lease_owner, lease_expires_at, heartbeat_at, \
                 attempted_at, last_error, unique_key, created_at, finished_at, slot) \
               SELECT id, kind, queue, payload, 'completed', priority, run_at, attempt, max_attempts, effect_class, \
                 NULL, NULL, NULL, heartbeat_at, attempted_at, last_error, unique_key, created_at, now(), slot \
               FROM gone RETURNING id, attempt), \
             done AS (SELECT id, attempt FROM moved UNION ALL {fallback})"
        )
    } else {
        format!(
            "gone AS (DELETE FROM {leaf} WHERE {held} RETURNING id, attempt), \
             done AS (SELECT id, attempt FROM gone UNION ALL {fallback})"
        )
    }
}

/// The statements of one slot's partition.
struct Statements {
    slot: i16,
    keep: bool,
    /// Completes `$1` id, `$2` attempt; yields `(id, attempt)` when it was held.
    complete: String,
    /// The claim's `$1`–`$9` (see [`crate::CLAIM_SQL`]), completing `$10` id, `$11`
    /// attempt, shaped as [`crate::COMPLETE_AND_CLAIM_SQL`].
    complete_and_claim: String,
}

static STATEMENTS: LazyLock<Vec<Statements>> = LazyLock::new(|| {
    let mut all = Vec::new();
    for (slot, leaf) in LEAVES {
        for keep in [true, false] {
            all.push(Statements {
                slot,
                keep,
                complete: format!("WITH {} SELECT id, attempt FROM done", done_ctes(leaf, keep, 1, 2)),
                complete_and_claim: format!(
                    concat!("WITH {}, ", crate::claim::claim_after_done!()),
                    done_ctes(leaf, keep, 10, 11)
                ),
            });
        }
    }
    all
});

fn statements(leases: &[Lease], keep: bool) -> Option<&'static Statements> {
    let [lease] = leases else { return None };
    let slot = lease.slot?;
    STATEMENTS.iter().find(|s| s.slot == slot && s.keep == keep)
}

/// The statement completing the one lease of `leases` in its partition (binds: its id, its
/// attempt), when there is one lease and its partition is known.
pub fn complete_sql(leases: &[Lease], keep: bool) -> Option<&'static str> {
    statements(leases, keep).map(|s| s.complete.as_str())
}

/// The statement completing the one lease of `leases` in its partition and claiming (binds:
/// the claim's nine, then its id and its attempt), when there is one lease and its
/// partition is known.
pub fn complete_and_claim_sql(leases: &[Lease], keep: bool) -> Option<&'static str> {
    statements(leases, keep).map(|s| s.complete_and_claim.as_str())
}
