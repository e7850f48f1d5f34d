//! Named fault points at step boundaries.
//!
//! Code calls [`hit`] with a point's name at every boundary that matters for crash
//! safety (after a claim, after a transaction commits, after an effect, ...). Unless a
//! test armed that point, `hit` is a single relaxed atomic load. A real process arms
//! points from `AIRLOCK_FAULTS` at start-up: `name=action[,name=action]`, where action is
//! `abort` (the process dies on the spot, like a SIGKILL), `error` (the step fails),
//! `pause` (the step blocks until the process is killed), or `stop` (the whole process
//! stops itself with SIGSTOP, like a machine frozen at that instruction, and goes on from
//! there when it gets SIGCONT). `action@N` acts at the point's Nth hit only (a boundary
//! met once per round, crashed at a given round); the earlier hits pass.
//!
//! Every point's name is listed in [`POINTS`], so suites can check they cover each one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// Every fault point the code base hits.
pub const POINTS: &[&str] = &[
    "job.after_claim",
    "job.before_complete",
    "job.after_complete",
    "rescue.before_commit",
    "send.after_attempt_commit",
    "send.after_effect",
    "send.after_receipt_commit",
    "score.before_commit",
    "score.after_commit",
];

/// The step boundaries of an agent turn (the turn's crash tests cover each one).
pub const TURN_POINTS: &[&str] = &[
    "turn.model.replied",
    "turn.model.recorded",
    "turn.tool.begun",
    "turn.tool.called",
    "turn.tool.result",
    "turn.deliver.submitted",
];

fn known(point: &str) -> bool {
    POINTS.contains(&point) || TURN_POINTS.contains(&point)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `std::process::abort()`: no destructor, no flush, as abrupt as SIGKILL.
    Abort,
    /// The step returns [`FaultError`].
    Error,
    /// The step never returns (until the process is killed).
    Pause,
    /// The process sends itself SIGSTOP; the step goes on after SIGCONT.
    Stop,
}

#[derive(Debug, thiserror::Error)]
#[error("fault injected at {0}")]
pub struct FaultError(pub &'static str);

static ANY_ARMED: AtomicBool = AtomicBool::new(false);
/// An armed point: its action, and how many hits pass before it acts.
static ARMED: OnceLock<Mutex<HashMap<String, (Action, u32)>>> = OnceLock::new();

fn armed() -> &'static Mutex<HashMap<String, (Action, u32)>> {
    ARMED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Arms a point in this process.
pub fn arm(point: &str, action: Action) {
    arm_at(point, action, 1);
}

/// Arms a point to act at its `nth` hit (1: the first).
pub fn arm_at(point: &str, action: Action, nth: u32) {
    armed().lock().unwrap_or_else(|e| e.into_inner()).insert(point.to_string(), (action, nth.max(1) - 1));
    ANY_ARMED.store(true, Ordering::SeqCst);
}

/// Disarms every point.
pub fn clear() {
    armed().lock().unwrap_or_else(|e| e.into_inner()).clear();
    ANY_ARMED.store(false, Ordering::SeqCst);
}

/// Parses `name=action,...` (as in `AIRLOCK_FAULTS`) and arms each point.
pub fn arm_from_spec(spec: &str) -> Result<(), String> {
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, action) = part.split_once('=').ok_or_else(|| format!("fault `{part}`: expected name=action"))?;
        if !known(name) {
            return Err(format!("fault `{name}`: no such point"));
        }
        let (action, nth) = match action.split_once('@') {
            Some((a, n)) => (
                a,
                n.parse::<u32>()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| format!("fault `{name}`: `@{n}` is not a hit number"))?,
            ),
            None => (action, 1),
        };
        let action = match action {
            "abort" => Action::Abort,
            "error" => Action::Error,
            "pause" => Action::Pause,
            "stop" => Action::Stop,
            other => return Err(format!("fault `{name}`: unknown action `{other}`")),
        };
        arm_at(name, action, nth);
    }
    Ok(())
}

/// Arms the points named in `AIRLOCK_FAULTS`, if any.
pub fn arm_from_env() -> Result<(), String> {
    match std::env::var("AIRLOCK_FAULTS") {
        Ok(spec) => arm_from_spec(&spec),
        Err(_) => Ok(()),
    }
}

/// Marks a step boundary. A no-op unless the point is armed.
pub async fn hit(point: &'static str) -> Result<(), FaultError> {
    debug_assert!(known(point), "unlisted fault point {point}");
    if !ANY_ARMED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let action = {
        let mut map = armed().lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(point) {
            Some((_, skip)) if *skip > 0 => {
                *skip -= 1;
                None
            }
            Some((a, _)) => Some(*a),
            None => None,
        }
    };
    match action {
        None => Ok(()),
        Some(Action::Abort) => {
            tracing::warn!(fault.point = point, "fault point: aborting the process");
            std::process::abort()
        }
        Some(Action::Error) => Err(FaultError(point)),
        Some(Action::Pause) => std::future::pending().await,
        Some(Action::Stop) => {
            tracing::warn!(fault.point = point, "fault point: stopping the process until SIGCONT");
            // Every thread stops here at once; the kernel resumes them all on SIGCONT.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        assert!(arm_from_spec("job.after_claim=sometimes").is_err());
        assert!(arm_from_spec("no.such.point=abort").is_err());
        assert!(arm_from_spec("job.after_claim").is_err());
        assert!(arm_from_spec("job.after_claim=abort@0").is_err());
        assert!(arm_from_spec("job.after_claim=abort@x").is_err());
    }
}
