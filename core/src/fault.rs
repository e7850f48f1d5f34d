//! Named fault points at step boundaries.
//!
//! Code calls [`hit`] with a point's name at every boundary that matters for crash
//! safety (after a claim, after a transaction commits, after an effect, ...). Unless a
//! test armed that point, `hit` is a single relaxed atomic load. A real process arms
//! points from `AIRLOCK_FAULTS` at start-up: `name=action[,name=action]`, where action is
//! `abort` (the process dies on the spot, like a SIGKILL), `error` (the step fails),
//! `pause` (the step blocks until the process is killed), or `stop` (the whole process
//! stops itself with SIGSTOP, like a machine frozen at that instruction, and goes on from
//! there when it gets SIGCONT).
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
static ARMED: OnceLock<Mutex<HashMap<String, Action>>> = OnceLock::new();

fn armed() -> &'static Mutex<HashMap<String, Action>> {
    ARMED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Arms a point in this process.
pub fn arm(point: &str, action: Action) {
    armed().lock().unwrap_or_else(|e| e.into_inner()).insert(point.to_string(), action);
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
        let action = match action {
            "abort" => Action::Abort,
            "error" => Action::Error,
            "pause" => Action::Pause,
            "stop" => Action::Stop,
            other => return Err(format!("fault `{name}`: unknown action `{other}`")),
        };
        arm(name, action);
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
    let action = armed().lock().unwrap_or_else(|e| e.into_inner()).get(point).copied();
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
    }
}
