//! Run states: Rust mirrors the Postgres enum `run_state`, and [`next`] is the one table of
//! legal moves (the guarded statements of this crate make exactly these).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "run_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Its holder records steps and effects.
    Active,
    /// A step needs a human (an effect whose outcome nobody knows, an authorization).
    Waiting,
    /// Ended by its holder with a result. Terminal.
    Completed,
    /// Ended by its holder with an error. Terminal.
    Failed,
    /// Cancelled by its agent or an operator. Terminal.
    Cancelled,
    /// A step would have passed a limit of its budget. Terminal.
    BudgetExhausted,
}

/// What moves a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A step needs a human.
    Wait,
    /// The human decided; the holder goes on.
    Resume,
    Complete,
    Fail,
    Cancel,
    /// A step would pass a limit.
    Exhaust,
    /// A process takes the run over (epoch + 1); the state stays.
    Claim,
}

impl Action {
    pub const ALL: [Action; 7] =
        [Action::Wait, Action::Resume, Action::Complete, Action::Fail, Action::Cancel, Action::Exhaust, Action::Claim];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Wait => "wait",
            Action::Resume => "resume",
            Action::Complete => "complete",
            Action::Fail => "fail",
            Action::Cancel => "cancel",
            Action::Exhaust => "exhaust",
            Action::Claim => "claim",
        }
    }
}

impl RunState {
    pub const ALL: [RunState; 6] = [
        RunState::Active,
        RunState::Waiting,
        RunState::Completed,
        RunState::Failed,
        RunState::Cancelled,
        RunState::BudgetExhausted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Active => "active",
            RunState::Waiting => "waiting",
            RunState::Completed => "completed",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
            RunState::BudgetExhausted => "budget_exhausted",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Whether the run accepts nothing more: no step, no effect, no claim.
    pub fn is_terminal(self) -> bool {
        Action::ALL.iter().all(|a| next(self, *a).is_none())
    }

    /// The states from which `action` is legal, for the guards of the statements.
    pub fn from_states(action: Action) -> Vec<RunState> {
        RunState::ALL.into_iter().filter(|s| next(*s, action).is_some()).collect()
    }
}

/// The state `action` moves a run in `from` to, if the move is legal.
pub fn next(from: RunState, action: Action) -> Option<RunState> {
    use Action as A;
    use RunState as S;
    match (from, action) {
        (S::Active, A::Wait) => Some(S::Waiting),
        (S::Waiting, A::Resume) => Some(S::Active),
        (S::Active, A::Complete) => Some(S::Completed),
        (S::Active | S::Waiting, A::Fail) => Some(S::Failed),
        (S::Active | S::Waiting, A::Cancel) => Some(S::Cancelled),
        (S::Active, A::Exhaust) => Some(S::BudgetExhausted),
        (S::Active, A::Claim) => Some(S::Active),
        (S::Waiting, A::Claim) => Some(S::Waiting),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_table() {
        use Action as A;
        use RunState as S;
        let expected = [
            (S::Active, A::Wait, S::Waiting),
            (S::Waiting, A::Resume, S::Active),
            (S::Active, A::Complete, S::Completed),
            (S::Active, A::Fail, S::Failed),
            (S::Waiting, A::Fail, S::Failed),
            (S::Active, A::Cancel, S::Cancelled),
            (S::Waiting, A::Cancel, S::Cancelled),
            (S::Active, A::Exhaust, S::BudgetExhausted),
            (S::Active, A::Claim, S::Active),
            (S::Waiting, A::Claim, S::Waiting),
        ];
        for from in S::ALL {
            for a in A::ALL {
                let want = expected.iter().find(|(f, x, _)| *f == from && *x == a).map(|(_, _, to)| *to);
                assert_eq!(next(from, a), want, "{from:?} by {a:?}");
            }
        }
        let terminal: Vec<S> = S::ALL.into_iter().filter(|s| s.is_terminal()).collect();
        assert_eq!(terminal, vec![S::Completed, S::Failed, S::Cancelled, S::BudgetExhausted]);
        assert_eq!(S::from_states(A::Cancel), vec![S::Active, S::Waiting]);
        for s in S::ALL {
            assert_eq!(S::parse(s.as_str()), Some(s));
        }
    }
}
