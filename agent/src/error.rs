//! What a turn's request or a human's decision can be refused for, and what kind of
//! failure each is.

use airlock_core::error::{DomainError, ErrorKind};
use airlock_runs::RunError;

#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// Bad input: nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// No such turn or authorization of this caller.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// Not allowed in the current state.
    #[error("{0}")]
    InvalidTransition(String),
    /// The same `step_id` was used for another turn request.
    #[error("{0}")]
    IdempotencyConflict(String),
    /// The arguments the human was shown are not the ones the model asked for.
    #[error("{0}")]
    StaleArguments(String),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Queue(#[from] airlock_queue::QueueError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for TurnError {
    fn kind(&self) -> ErrorKind {
        match self {
            TurnError::Invalid(_) => ErrorKind::Validation,
            TurnError::NotFound(_) => ErrorKind::NotFound,
            TurnError::InvalidTransition(_) => ErrorKind::InvalidTransition,
            TurnError::IdempotencyConflict(_) => ErrorKind::IdempotencyConflict,
            TurnError::StaleArguments(_) => ErrorKind::StaleArtifact,
            TurnError::Run(e) => e.kind(),
            TurnError::Queue(_) | TurnError::Db(_) => ErrorKind::Internal,
        }
    }
}
