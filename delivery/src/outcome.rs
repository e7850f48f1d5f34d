//! What is known after trying to perform a send: the transport's answer, in the pipeline's
//! terms. The transports (`airlock-channels`) produce it; transaction B records it.

use std::time::Duration;

/// What is known after trying to perform an effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EffectOutcome {
    /// Delivered; the receiver's answer is kept in the receipt.
    Sent { message_id: Option<String>, response: String },
    /// Certainly not delivered, and worth retrying.
    NotDelivered { detail: String, retry_after: Option<Duration> },
    /// Refused for good.
    Permanent { detail: String },
    /// Maybe delivered, maybe not: only a human can tell.
    Ambiguous { detail: String },
}

impl EffectOutcome {
    /// The value stored in `send_attempts.outcome`.
    pub fn label(&self) -> &'static str {
        match self {
            EffectOutcome::Sent { .. } => "sent",
            EffectOutcome::NotDelivered { .. } => "not_delivered",
            EffectOutcome::Permanent { .. } => "failed",
            EffectOutcome::Ambiguous { .. } => "ambiguous",
        }
    }

    pub fn detail(&self) -> &str {
        match self {
            EffectOutcome::Sent { response, .. } => response,
            EffectOutcome::NotDelivered { detail, .. }
            | EffectOutcome::Permanent { detail }
            | EffectOutcome::Ambiguous { detail } => detail,
        }
    }
}
