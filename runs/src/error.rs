//! What can go wrong with a run's write, and what kind of failure each is.

use airlock_core::error::{DomainError, ErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No such run of this agent (another agent's run is not found either).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The caller's epoch is not the run's: another process claimed the run since.
    #[error("stale epoch {given}: the run is held at epoch {held}; claim it again to go on")]
    StaleEpoch { held: i64, given: i64 },
    /// The step was recorded before as something else.
    #[error("step `{step_id}` was recorded as {recorded}, not {given}")]
    Diverged { step_id: String, recorded: String, given: String },
    /// Recording this would pass a limit of the run's budget; the run is
    /// `budget_exhausted` and nothing was recorded.
    #[error("the run's budget is spent: {limit} would be passed")]
    BudgetExhausted { limit: &'static str },
    /// Not allowed in the run's current state.
    #[error("{0}")]
    InvalidTransition(String),
    /// Bad input: nothing was written.
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for RunError {
    fn kind(&self) -> ErrorKind {
        match self {
            RunError::NotFound(_) => ErrorKind::NotFound,
            RunError::StaleEpoch { .. } => ErrorKind::StaleEpoch,
            RunError::Diverged { .. } => ErrorKind::ReplayDiverged,
            RunError::BudgetExhausted { .. } => ErrorKind::BudgetExhausted,
            RunError::InvalidTransition(_) => ErrorKind::InvalidTransition,
            RunError::Invalid(_) => ErrorKind::Validation,
            RunError::Db(_) => ErrorKind::Internal,
        }
    }
}
