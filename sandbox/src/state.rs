//! The sandboxed task's states, selection modes and decision verdicts, and the one table of
//! legal transitions.
//!
//! Invariants:
//! - [`next`] is the only table of legal transitions; every state change of a task is a
//!   guarded `UPDATE … WHERE state = $expected` whose target comes from it.
//! - Terminal states (`succeeded`, `failed`, `timed_out`, `denied`) have no way out.
//! - Nothing runs without a decision that chose a tier: `queued` is reached only by a
//!   choice (the platform's within bounds, or a human's).
//! - A run that was killed by its timeout ends `timed_out` and stays there: it is recorded,
//!   never retried blindly. Only a run whose worker was lost goes back to `queued`.
//!
//! The enums mirror the Postgres enums `sandbox_task_state`, `sandbox_mode` and
//! `sandbox_verdict`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a task is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "sandbox_task_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Stored; a `sandbox.select` job decides the tier.
    Selecting,
    /// Waits in the admin queue for an operator's choice.
    AwaitingChoice,
    /// A tier is chosen; a `sandbox.run` job will run it.
    Queued,
    /// A run has started.
    Running,
    /// The command exited 0. Terminal.
    Succeeded,
    /// The command exited non-zero, was killed for memory, CPU or disk, could not start,
    /// or its runs were exhausted. Terminal.
    Failed,
    /// Killed by its tier's wall-clock timeout. Terminal.
    TimedOut,
    /// Refused by policy or by a human. Terminal.
    Denied,
}

impl TaskState {
    pub const ALL: [Self; 8] = [
        Self::Selecting,
        Self::AwaitingChoice,
        Self::Queued,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::TimedOut,
        Self::Denied,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Selecting => "selecting",
            Self::AwaitingChoice => "awaiting_choice",
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
            Self::Denied => "denied",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::TimedOut | Self::Denied)
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who chooses the tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "sandbox_mode", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The agent, among the tiers allowed to it; anything else is denied.
    Agent,
    /// Central rules: task kind, declared size, history of similar tasks.
    Platform,
    /// An operator, from the admin queue.
    Human,
    /// The agent proposes; the platform enforces bounds; exceptions go to an operator.
    Hybrid,
}

impl Mode {
    pub const ALL: [Self; 4] = [Self::Agent, Self::Platform, Self::Human, Self::Hybrid];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Platform => "platform",
            Self::Human => "human",
            Self::Hybrid => "hybrid",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// What a decision said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "sandbox_verdict", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// A tier was chosen; the task is queued to run in it.
    Chosen,
    /// A human must choose.
    Escalated,
    /// Refused.
    Denied,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chosen => "chosen",
            Self::Escalated => "escalated",
            Self::Denied => "denied",
        }
    }
}

/// The size an agent declares for its task (a hint for the platform's rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Size {
    Small,
    Medium,
    Large,
}

impl Size {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Small => "small",
            Self::Medium => "medium",
            Self::Large => "large",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Small, Self::Medium, Self::Large].into_iter().find(|v| v.as_str() == s)
    }
}

/// How a run ended, as far as the task's state is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    Succeeded,
    Failed,
    TimedOut,
}

/// What happens to a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// A decision (the platform's, or a human's) chose a tier.
    Choose,
    /// The platform passed the choice to a human.
    Escalate,
    /// Policy or a human refused it.
    Deny,
    /// A run started (again, when the previous run's worker was lost).
    Start,
    /// A run ended with an outcome.
    Finish(RunEnd),
    /// The worker running it was lost; it may run again.
    Requeue,
    /// It cannot go on: selection or run attempts exhausted, or the run could not start.
    GiveUp,
}

/// The legal transitions: the target state, or `None` when `t` is not allowed from `s`.
pub fn next(s: TaskState, t: Transition) -> Option<TaskState> {
    use TaskState as S;
    use Transition as T;
    match (s, t) {
        (S::Selecting | S::AwaitingChoice, T::Choose) => Some(S::Queued),
        (S::Selecting, T::Escalate) => Some(S::AwaitingChoice),
        (S::Selecting | S::AwaitingChoice, T::Deny) => Some(S::Denied),
        // From `running`: the previous run's worker vanished before the rescuer noticed.
        (S::Queued | S::Running, T::Start) => Some(S::Running),
        (S::Running, T::Finish(RunEnd::Succeeded)) => Some(S::Succeeded),
        (S::Running, T::Finish(RunEnd::Failed)) => Some(S::Failed),
        (S::Running, T::Finish(RunEnd::TimedOut)) => Some(S::TimedOut),
        (S::Running, T::Requeue) => Some(S::Queued),
        (S::Selecting | S::Queued | S::Running, T::GiveUp) => Some(S::Failed),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_TRANSITIONS: [Transition; 9] = [
        Transition::Choose,
        Transition::Escalate,
        Transition::Deny,
        Transition::Start,
        Transition::Finish(RunEnd::Succeeded),
        Transition::Finish(RunEnd::Failed),
        Transition::Finish(RunEnd::TimedOut),
        Transition::Requeue,
        Transition::GiveUp,
    ];

    #[test]
    fn spellings_round_trip() {
        for s in TaskState::ALL {
            assert_eq!(TaskState::parse(s.as_str()), Some(s));
        }
        for m in Mode::ALL {
            assert_eq!(Mode::parse(m.as_str()), Some(m));
        }
        assert_eq!(Size::parse("large"), Some(Size::Large));
        assert_eq!(TaskState::parse("Queued"), None);
    }

    #[test]
    fn terminal_states_have_no_way_out() {
        for s in TaskState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for t in ALL_TRANSITIONS {
                assert_eq!(next(s, t), None, "{s} must not move on {t:?}");
            }
        }
    }

    #[test]
    fn nothing_queues_without_a_choice() {
        for s in TaskState::ALL {
            for t in ALL_TRANSITIONS {
                if next(s, t) == Some(TaskState::Queued) {
                    assert!(
                        t == Transition::Choose || (t == Transition::Requeue && s == TaskState::Running),
                        "{s} reaches queued by {t:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_timeout_is_final_and_only_a_lost_run_requeues() {
        assert_eq!(next(TaskState::Running, Transition::Finish(RunEnd::TimedOut)), Some(TaskState::TimedOut));
        assert_eq!(next(TaskState::TimedOut, Transition::Start), None);
        assert_eq!(next(TaskState::Running, Transition::Requeue), Some(TaskState::Queued));
        assert_eq!(next(TaskState::Queued, Transition::Requeue), None);
    }

    #[test]
    fn a_human_acts_only_on_a_waiting_task() {
        assert_eq!(next(TaskState::AwaitingChoice, Transition::Choose), Some(TaskState::Queued));
        assert_eq!(next(TaskState::AwaitingChoice, Transition::Deny), Some(TaskState::Denied));
        assert_eq!(next(TaskState::Queued, Transition::Choose), None);
        assert_eq!(next(TaskState::AwaitingChoice, Transition::Escalate), None);
    }
}
