//! What kind of failure an error is, said by the domain and read by the HTTP layer.
//!
//! Every crate's error type implements [`DomainError`]: it names its [`ErrorKind`], and
//! `airlock-http` alone turns a kind into a status and the contract's code. No domain crate
//! knows an HTTP type.

use std::time::Duration;

/// The kinds of failure the contract distinguishes (API.md's error codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Bad input: nothing was written.
    Validation,
    /// No valid credential.
    Unauthenticated,
    /// A valid credential without the right.
    Forbidden,
    /// No such thing (or not the caller's to see).
    NotFound,
    /// Not allowed from the current state.
    InvalidTransition,
    /// The artifact (or the exact arguments of a call) changed since the human saw it.
    StaleArtifact,
    /// The same key was used before with different content.
    IdempotencyConflict,
    /// A run's budget would be passed.
    BudgetExhausted,
    /// The caller's holder epoch is older than the run's.
    StaleEpoch,
    /// A replayed step does not match what was recorded.
    ReplayDiverged,
    /// A recipient nothing may be sent to.
    RecipientSuppressed,
    /// A body over its limit.
    PayloadTooLarge,
    /// A rate limit; try again after the given time.
    RateLimited,
    /// A dependency is down for now.
    Unavailable,
    /// A bug or an outage: the cause is logged, never shown.
    Internal,
}

impl ErrorKind {
    /// The contract's code for this kind (`SNAKE_UPPER`).
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::Validation => "VALIDATION",
            ErrorKind::Unauthenticated => "UNAUTHENTICATED",
            ErrorKind::Forbidden => "FORBIDDEN",
            ErrorKind::NotFound => "NOT_FOUND",
            ErrorKind::InvalidTransition => "INVALID_TRANSITION",
            ErrorKind::StaleArtifact => "STALE_ARTIFACT",
            ErrorKind::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            ErrorKind::BudgetExhausted => "BUDGET_EXHAUSTED",
            ErrorKind::StaleEpoch => "STALE_EPOCH",
            ErrorKind::ReplayDiverged => "REPLAY_DIVERGED",
            ErrorKind::RecipientSuppressed => "RECIPIENT_SUPPRESSED",
            ErrorKind::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            ErrorKind::RateLimited => "RATE_LIMITED",
            ErrorKind::Unavailable => "UNAVAILABLE",
            ErrorKind::Internal => "INTERNAL",
        }
    }

    /// Every kind, for tests and documentation.
    pub const ALL: [ErrorKind; 15] = [
        ErrorKind::Validation,
        ErrorKind::Unauthenticated,
        ErrorKind::Forbidden,
        ErrorKind::NotFound,
        ErrorKind::InvalidTransition,
        ErrorKind::StaleArtifact,
        ErrorKind::IdempotencyConflict,
        ErrorKind::BudgetExhausted,
        ErrorKind::StaleEpoch,
        ErrorKind::ReplayDiverged,
        ErrorKind::RecipientSuppressed,
        ErrorKind::PayloadTooLarge,
        ErrorKind::RateLimited,
        ErrorKind::Unavailable,
        ErrorKind::Internal,
    ];
}

/// An error that says what kind of failure it is.
pub trait DomainError: std::error::Error + Send + Sync + 'static {
    fn kind(&self) -> ErrorKind;

    /// For [`ErrorKind::RateLimited`]: when to try again.
    fn retry_after(&self) -> Option<Duration> {
        None
    }
}

/// A database error is an outage or a bug, never the caller's fault.
impl DomainError for sqlx::Error {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Internal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_snake_upper() {
        let codes: std::collections::BTreeSet<&str> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), ErrorKind::ALL.len());
        assert!(codes.iter().all(|c| c.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')));
    }
}
