//! Run states: Rust mirrors the Postgres enum `run_state`, and [`next`] is the one table of
//! legal moves.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "run_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Active,
    BudgetExhausted,
    Completed,
    Cancelled,
}

/// What moves a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A step spent the last of a limit.
    Exhaust,
    Complete,
    Cancel,
}

impl RunState {
    pub const ALL: [RunState; 4] =
        [RunState::Active, RunState::BudgetExhausted, RunState::Completed, RunState::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Active => "active",
            RunState::BudgetExhausted => "budget_exhausted",
            RunState::Completed => "completed",
            RunState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Whether the run accepts no further step.
    pub fn is_terminal(self) -> bool {
        next(self, Action::Cancel).is_none()
    }
}

/// The state `action` moves a run in `from` to, if the move is legal.
pub fn next(from: RunState, action: Action) -> Option<RunState> {
    use Action as A;
    use RunState as S;
    match (from, action) {
        (S::Active, A::Exhaust) => Some(S::BudgetExhausted),
        (S::Active, A::Complete) => Some(S::Completed),
        (S::Active, A::Cancel) => Some(S::Cancelled),
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
        let actions = [A::Exhaust, A::Complete, A::Cancel];
        let expected = |from: S, a: A| match (from, a) {
            (S::Active, A::Exhaust) => Some(S::BudgetExhausted),
            (S::Active, A::Complete) => Some(S::Completed),
            (S::Active, A::Cancel) => Some(S::Cancelled),
            _ => None,
        };
        for from in S::ALL {
            for a in actions {
                assert_eq!(next(from, a), expected(from, a), "{from:?} by {a:?}");
            }
        }
        assert!(!S::Active.is_terminal());
        assert!(S::Completed.is_terminal() && S::Cancelled.is_terminal() && S::BudgetExhausted.is_terminal());
        for s in S::ALL {
            assert_eq!(S::parse(s.as_str()), Some(s));
        }
    }
}
