//! Fault injection through every call of the migration protocol.
//!
//! The node clients are wrapped in a double that fails a named call before it executes
//! (the request is lost) or after (the answer is lost), or corrupts a blob on the way. The
//! real `capsule.migrate` job runs in a real worker through each case; a sampler watches
//! the nodes the whole time. After each case: exactly one node runs the agent (never two
//! at any sampled moment), no node stages it unless it holds the new epoch, the holder's
//! working copy verifies, and Postgres names the same holder and epoch. Then the
//! coordinator itself is killed after every phase and another worker finishes the job.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use airlock_capsule::protocol::NodeCall;
use airlock_capsule::relocation::{self, Phase};
use airlock_capsule::{AgentId, agents};
use airlock_tests::app::TestApp;
use airlock_tests::capsule::{Fleet, When, wait_migration};
use airlock_worker::migrate::MigrateHooks;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;

const SOURCE: &str = "node_a";
const TARGET: &str = "node_b";

async fn start(pool: PgPool) -> (Fleet, TestApp) {
    let fleet = Fleet::start(&[SOURCE, TARGET]).await;
    let env = fleet.env();
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let app = TestApp::start(pool, &extra).await;
    (fleet, app)
}

async fn request(app: &TestApp, agent: &str, target: &str) -> uuid::Uuid {
    let (s, v) = app
        .call(
            "POST",
            &format!("{}/admin/v1/agents/{agent}/migrations", app.admin),
            Some(&app.operator),
            Some(json!({"target_node": target})),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    uuid::Uuid::parse_str(v["id"].as_str().unwrap()).unwrap()
}

/// Imports a fresh agent and places it on the source (no faults armed). Each agent's
/// workspace has one body of its own, so every migration has a blob to send.
async fn placed(fleet: &Fleet, app: &TestApp, agent: &str) {
    let variant = agent.bytes().fold(7u8, |h, b| h.wrapping_mul(31).wrapping_add(b));
    fleet.import_variant(&app.pool, agent, variant).await;
    let m = wait_migration(&app.pool, request(app, agent, SOURCE).await, Duration::from_secs(20)).await;
    assert_eq!(m.phase, Phase::Completed, "placement of {agent}: {m:?}");
}

/// Polls every node while a migration runs; remembers the most nodes ever seen active.
fn sampler(fleet: &Fleet, agent: &str) -> (Arc<AtomicUsize>, tokio_util::sync::CancellationToken) {
    let max = Arc::new(AtomicUsize::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let svcs: Vec<_> = fleet.nodes.iter().map(|n| n.svc.clone()).collect();
    let (m, s, id) = (max.clone(), stop.clone(), AgentId::parse(agent).unwrap());
    tokio::spawn(async move {
        while !s.is_cancelled() {
            let mut active = 0;
            for svc in &svcs {
                let st = svc.status(&id).await.unwrap();
                if st.reconciled && st.state == Some(airlock_capsule::protocol::HolderState::Active) {
                    active += 1;
                }
            }
            m.fetch_max(active, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    (max, stop)
}

/// A fault armed on one node's client.
type Armed = (&'static str, NodeCall, When);

struct Row {
    case: String,
    outcome: String,
    holders: String,
    staging: &'static str,
    verify: String,
    /// Why it aborted, or what it last waited for.
    note: String,
}

/// Runs one migration of a fresh agent from the source to the target, with `arm` applied
/// to the fault wrappers, and checks every invariant.
async fn run_case(fleet: &Fleet, app: &TestApp, case: &str, agent: &str, arm: impl FnOnce(&Fleet)) -> Row {
    placed(fleet, app, agent).await;
    fleet.clear_faults();
    arm(fleet);
    let (max_active, stop) = sampler(fleet, agent);
    let id = request(app, agent, TARGET).await;
    let m = wait_migration(&app.pool, id, Duration::from_secs(30)).await;
    stop.cancel();
    let fired = fleet.faults.values().map(|f| f.fired().len()).sum::<usize>();
    assert!(fired > 0 || case == "none", "{case}: the armed fault never fired");
    fleet.clear_faults();

    let obs = fleet.observe(agent, m.epoch).await;
    let active = obs.active();
    assert_eq!(active.len(), 1, "{case}: exactly one holder, got {}", obs.summary());
    assert!(max_active.load(Ordering::SeqCst) <= 1, "{case}: two nodes ran the agent at once");
    assert!(obs.staging_clean, "{case}: staging left behind: {obs:?}");
    assert!(obs.verify_problems.is_empty(), "{case}: {:?}", obs.verify_problems);
    let row = agents::get(&app.pool, &AgentId::parse(agent).unwrap()).await.unwrap().unwrap();
    assert_eq!(row.state, agents::AgentState::Active, "{case}");
    assert_eq!((row.holder.clone().unwrap(), row.epoch), active[0].clone(), "{case}: Postgres agrees with the nodes");
    match m.phase {
        Phase::Completed => assert_eq!(active[0], (TARGET.to_string(), m.epoch), "{case}"),
        Phase::Aborted => assert_eq!(active[0], (SOURCE.to_string(), m.from_epoch), "{case}"),
        other => panic!("{case}: ended in {other:?}"),
    }
    Row {
        case: case.to_string(),
        outcome: m.phase.as_str().to_string(),
        holders: obs.summary(),
        staging: if obs.staging_clean { "empty" } else { "LEFT" },
        verify: if obs.verify_problems.is_empty() { "ok".into() } else { obs.verify_problems.join("; ") },
        note: m.reason.clone().unwrap_or_default().chars().take(60).collect(),
    }
}

fn print_table(title: &str, rows: &[Row]) {
    let mut out = format!("\n{title}\n");
    out.push_str(&format!(
        "| {:<56} | {:<9} | {:<40} | {:<7} | {:<6} | {:<60} |\n",
        "call × when", "outcome", "holders", "staging", "verify", "reason (of an abort, or of the last wait)"
    ));
    out.push_str(&format!(
        "|{}|{}|{}|{}|{}|{}|\n",
        "-".repeat(58),
        "-".repeat(11),
        "-".repeat(42),
        "-".repeat(9),
        "-".repeat(8),
        "-".repeat(62)
    ));
    for r in rows {
        out.push_str(&format!(
            "| {:<56} | {:<9} | {:<40} | {:<7} | {:<6} | {:<60} |\n",
            r.case, r.outcome, r.holders, r.staging, r.verify, r.note
        ));
    }
    println!("{out}");
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    let _ = std::fs::create_dir_all(&dir);
    let file = dir.join(format!("{}.txt", title.split_whitespace().next().unwrap_or("table")));
    let _ = std::fs::write(file, out);
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn every_call_fails_before_and_after(pool: PgPool) {
    let (fleet, app) = start(pool.clone()).await;
    let (_stop, _worker) = fleet.start_coordinator(&pool, &app.config, "coordinator", Arc::default());

    // (node, call) on the protocol's path; recovery calls are armed with a fault that
    // makes the protocol need them.
    let path: [(&str, NodeCall); 7] = [
        (SOURCE, NodeCall::Freeze),
        (TARGET, NodeCall::Propose),
        (TARGET, NodeCall::HaveBlobs),
        (TARGET, NodeCall::PutBlob),
        (TARGET, NodeCall::Prepare),
        (TARGET, NodeCall::Activate),
        (SOURCE, NodeCall::Retire),
    ];
    let recovery: [(Armed, (&str, NodeCall)); 3] = [
        ((TARGET, NodeCall::Activate, When::After), (TARGET, NodeCall::Status)),
        ((TARGET, NodeCall::Propose, When::After), (TARGET, NodeCall::Abort)),
        ((TARGET, NodeCall::Prepare, When::Before), (SOURCE, NodeCall::Resume)),
    ];
    let mut rows = Vec::new();
    let mut n = 0;
    let mut next_agent = || {
        n += 1;
        format!("fault-{n}")
    };
    rows.push(run_case(&fleet, &app, "none", &next_agent(), |_| {}).await);
    for (node, call) in path {
        for when in [When::Before, When::After] {
            let case = format!("{node}.{} × {}", call.as_str(), when.as_str());
            rows.push(run_case(&fleet, &app, &case, &next_agent(), |f| f.faults[node].arm(call, when)).await);
        }
    }
    for ((tn, tc, tw), (node, call)) in recovery {
        for when in [When::Before, When::After] {
            let case =
                format!("{node}.{} × {} (after {tn}.{} × {})", call.as_str(), when.as_str(), tc.as_str(), tw.as_str());
            rows.push(
                run_case(&fleet, &app, &case, &next_agent(), |f| {
                    f.faults[tn].arm(tc, tw);
                    f.faults[node].arm(call, when);
                })
                .await,
            );
        }
    }
    let corrupt = next_agent();
    let row = run_case(&fleet, &app, "node_b.put_blob × corrupt in transit", &corrupt, |f| {
        f.faults[TARGET].arm(NodeCall::PutBlob, When::Corrupt)
    })
    .await;
    assert_eq!(row.outcome, "aborted", "a corrupt blob is refused on receipt");
    // The target kept no body under a hash it does not match.
    for entry in std::fs::read_dir(fleet.node(TARGET).data_dir.join("blobs")).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(airlock_capsule::sha256_hex(&std::fs::read(&p).unwrap()), name);
    }
    rows.push(row);

    // What each case must end as.
    let expect_completed = |case: &str| {
        case == "none"
            || case.contains("activate × after")
            || case.starts_with("node_a.retire")
            || case.starts_with("node_b.status")
    };
    for r in &rows {
        let want = if expect_completed(&r.case) { "completed" } else { "aborted" };
        assert_eq!(r.outcome, want, "{}", r.case);
    }
    print_table("capsule-fault-matrix (call × when → outcome, holders, staging, verify)", &rows);
}

/// Where a coordinator killed right after recording a phase leaves its relocation once
/// another coordinator has finished it: before the point of no return the move goes on;
/// recorded `activating` without an answer means asking the target (which did not
/// activate), so it aborts; an abort under way is finished.
const KILL_ROWS: [(Phase, Phase); 8] = [
    (Phase::Frozen, Phase::Completed),
    (Phase::Proposed, Phase::Completed),
    (Phase::Transferred, Phase::Completed),
    (Phase::Prepared, Phase::Completed),
    (Phase::Activating, Phase::Aborted),
    (Phase::Activated, Phase::Completed),
    (Phase::Retired, Phase::Completed),
    (Phase::Aborting, Phase::Aborted),
];

#[test]
fn every_halt_point_has_a_row() {
    for point in MigrateHooks::POINTS {
        assert!(
            KILL_ROWS.iter().any(|(p, _)| *p == point),
            "the coordinator can halt after `{}` but no row kills it there",
            point.as_str()
        );
    }
    for (p, _) in KILL_ROWS {
        assert!(MigrateHooks::POINTS.contains(&p), "row `{}` is not a halt point", p.as_str());
    }
}

#[sqlx::test(migrator = "airlock_core::db::MIGRATOR")]
async fn the_coordinator_killed_after_every_phase_is_finished_by_another(pool: PgPool) {
    let (fleet, app) = start(pool.clone()).await;
    let (_stop, placer) = fleet.start_coordinator(&pool, &app.config, "placer", Arc::default());
    let phases: Vec<Phase> = KILL_ROWS.iter().map(|(p, _)| *p).collect();
    let mut agents_placed = Vec::new();
    for (i, _) in phases.iter().enumerate() {
        let agent = format!("kill-{i}");
        placed(&fleet, &app, &agent).await;
        agents_placed.push(agent);
    }
    placer.abort();
    let _ = placer.await;

    let mut rows = Vec::new();
    for (phase, agent) in phases.into_iter().zip(agents_placed) {
        let hooks: Arc<MigrateHooks> = Arc::default();
        hooks.halt_after(Some(phase));
        if phase == Phase::Aborting {
            fleet.faults[TARGET].arm(NodeCall::Prepare, When::Before);
        }
        let (_s1, first) = fleet.start_coordinator(&pool, &app.config, &format!("first-{agent}"), hooks.clone());
        let (max_active, stop_sampling) = sampler(&fleet, &agent);
        let id = request(&app, &agent, TARGET).await;
        tokio::time::timeout(Duration::from_secs(20), hooks.halted.notified()).await.expect("the coordinator halts");
        // Killed: its tasks are dropped where they stand, its lease is left to expire.
        first.abort();
        let _ = first.await;
        let m = relocation::get(&pool, id).await.unwrap().unwrap();
        assert_eq!(m.phase, phase, "the phase is recorded before anything else happens");
        let job = m.job_id.unwrap();
        sqlx::query("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
            .bind(job)
            .execute(&pool)
            .await
            .unwrap();
        let mut tx = pool.begin().await.unwrap();
        let rescued = airlock_queue::rescue_expired(&mut tx, 10).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(rescued.len(), 1);
        sqlx::query("UPDATE jobs SET run_at = now() WHERE id = $1").bind(job).execute(&pool).await.unwrap();

        let (_s2, second) = fleet.start_coordinator(&pool, &app.config, &format!("second-{agent}"), Arc::default());
        let m = wait_migration(&pool, id, Duration::from_secs(30)).await;
        second.abort();
        let _ = second.await;
        stop_sampling.cancel();
        fleet.clear_faults();
        let obs = fleet.observe(&agent, m.epoch).await;
        let case = format!("coordinator killed after {}", phase.as_str());
        assert_eq!(obs.active().len(), 1, "{case}: {}", obs.summary());
        assert!(max_active.load(Ordering::SeqCst) <= 1, "{case}: two holders at once");
        assert!(obs.staging_clean, "{case}: {obs:?}");
        assert!(obs.verify_problems.is_empty(), "{case}: {:?}", obs.verify_problems);
        let want = KILL_ROWS.iter().find(|(p, _)| *p == phase).map(|(_, end)| *end).unwrap();
        assert_eq!(m.phase, want, "{case}");
        let history = relocation::history(&pool, id).await.unwrap();
        let workers: std::collections::BTreeSet<_> = history.iter().filter_map(|h| h.worker.clone()).collect();
        assert!(workers.len() == 2 || phase == Phase::Retired && m.phase == Phase::Completed, "{case}: {workers:?}");
        rows.push(Row {
            case,
            outcome: m.phase.as_str().into(),
            holders: obs.summary(),
            staging: "empty",
            verify: "ok".into(),
            note: m.reason.clone().unwrap_or_default().chars().take(60).collect(),
        });
    }
    print_table("capsule-coordinator-kills (phase → outcome, holders, staging, verify)", &rows);
}
