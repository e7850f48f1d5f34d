//! The delivery state machine, in one place.
//!
//! Invariants:
//! - [`next`] is the only table of legal transitions; every state change of a delivery is
//!   a guarded `UPDATE … WHERE state = $expected` whose target comes from it, so code and
//!   database agree on what may follow what.
//! - Terminal states (`sent`, `failed`, `rejected`, `cancelled`) have no way out.
//! - Nothing reaches `sending` except from `approved`, and nothing reaches `approved`
//!   except by a human approval (or grant), a known-not-delivered retry, a rescued
//!   idempotent send, or a human's `resend`: no path skips the approval gate.
//! - A send that may have happened (`sending` after its effect started) leaves `sending`
//!   only for `sent`, `failed`, `parked`, or back to `approved` when it is known not to
//!   have been delivered or its effect is idempotent; a non-repeatable one is parked for
//!   a human, never retried silently.
//!
//! [`DeliveryState`] mirrors the Postgres enum `delivery_state`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a delivery is in the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "delivery_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum DeliveryState {
    /// Intent and artifact stored; not yet scored.
    Persisted,
    /// Scored; about to be routed to review or approval.
    Scored,
    /// Scored below the threshold; waits for a reviewer to accept, edit or reject.
    InReview,
    /// Waits for a human approval (or a matching grant) bound to the artifact hash.
    AwaitingApproval,
    /// Approved; waits for the send switch and a worker.
    Approved,
    /// A send attempt is committed; the effect may be happening.
    Sending,
    /// Delivered, with a receipt. Terminal.
    Sent,
    /// Will not be delivered (permanent refusal or policy). Terminal.
    Failed,
    /// The outcome of a started send is unknown; a human decides.
    Parked,
    /// Refused by a reviewer. Terminal.
    Rejected,
    /// Withdrawn by the agent or an operator, or by a human resolving a parked send.
    /// Terminal.
    Cancelled,
}

impl DeliveryState {
    /// Every state, in pipeline order.
    pub const ALL: [Self; 11] = [
        Self::Persisted,
        Self::Scored,
        Self::InReview,
        Self::AwaitingApproval,
        Self::Approved,
        Self::Sending,
        Self::Sent,
        Self::Failed,
        Self::Parked,
        Self::Rejected,
        Self::Cancelled,
    ];

    /// The wire and database spelling (`in_review`, `awaiting_approval`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Persisted => "persisted",
            Self::Scored => "scored",
            Self::InReview => "in_review",
            Self::AwaitingApproval => "awaiting_approval",
            Self::Approved => "approved",
            Self::Sending => "sending",
            Self::Sent => "sent",
            Self::Failed => "failed",
            Self::Parked => "parked",
            Self::Rejected => "rejected",
            Self::Cancelled => "cancelled",
        }
    }

    /// Inverse of [`DeliveryState::as_str`]; exact, lowercase.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// True for states no transition leaves: `sent`, `failed`, `rejected`, `cancelled`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Sent | Self::Failed | Self::Rejected | Self::Cancelled)
    }

    /// True while the effect cannot have started, so the agent or an operator may still
    /// cancel: `persisted`, `scored`, `in_review`, `awaiting_approval`, `approved`.
    pub fn can_cancel(self) -> bool {
        next(self, Action::Cancel).is_some()
    }
}

impl fmt::Display for DeliveryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happens to a delivery; each legal `(state, action)` pair has one target state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// The scorer recorded a score.
    Score,
    /// The score is below the review threshold.
    RouteToReview,
    /// The score is at or above the review threshold.
    RouteToApproval,
    /// A reviewer accepted the artifact as is.
    Accept,
    /// A reviewer stored a new artifact version.
    Edit,
    /// A human approved the current artifact hash, or a grant matched.
    Approve,
    /// A reviewer refused the delivery.
    Reject,
    /// A worker committed a send attempt (transaction A); the effect may now happen.
    StartSend,
    /// The receipt was committed (transaction B).
    ConfirmSent,
    /// The send is known not to have been delivered (e.g. refused before DATA, 4xx); try
    /// again later.
    RetryLater,
    /// The send was refused for good (5xx, unverified sender, policy at send time).
    FailPermanent,
    /// The outcome is unknown (connection lost after DATA, or the lease expired after the
    /// attempt started): a human must decide.
    Park,
    /// A human confirmed a parked send went out.
    ResolveConfirmedSent,
    /// A human asked for a parked send to be sent again.
    ResolveResend,
    /// A human cancelled a parked send.
    ResolveCancel,
    /// The agent or an operator withdrew the delivery before sending.
    Cancel,
    /// The rescuer returned an expired idempotent send (it carries its key) to `approved`.
    Requeue,
}

impl Action {
    /// Every action.
    pub const ALL: [Self; 17] = [
        Self::Score,
        Self::RouteToReview,
        Self::RouteToApproval,
        Self::Accept,
        Self::Edit,
        Self::Approve,
        Self::Reject,
        Self::StartSend,
        Self::ConfirmSent,
        Self::RetryLater,
        Self::FailPermanent,
        Self::Park,
        Self::ResolveConfirmedSent,
        Self::ResolveResend,
        Self::ResolveCancel,
        Self::Cancel,
        Self::Requeue,
    ];

    /// The spelling used in events and logs (`route_to_review`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Score => "score",
            Self::RouteToReview => "route_to_review",
            Self::RouteToApproval => "route_to_approval",
            Self::Accept => "accept",
            Self::Edit => "edit",
            Self::Approve => "approve",
            Self::Reject => "reject",
            Self::StartSend => "start_send",
            Self::ConfirmSent => "confirm_sent",
            Self::RetryLater => "retry_later",
            Self::FailPermanent => "fail_permanent",
            Self::Park => "park",
            Self::ResolveConfirmedSent => "resolve_confirmed_sent",
            Self::ResolveResend => "resolve_resend",
            Self::ResolveCancel => "resolve_cancel",
            Self::Cancel => "cancel",
            Self::Requeue => "requeue",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The one table of legal transitions: `Some(to)` when `action` is legal from `from`,
/// `None` otherwise (the caller answers 409 `INVALID_TRANSITION`).
pub fn next(from: DeliveryState, action: Action) -> Option<DeliveryState> {
    use Action as A;
    use DeliveryState as S;
    let to = match (from, action) {
        (S::Persisted, A::Score) => S::Scored,
        (S::Scored, A::RouteToReview) => S::InReview,
        (S::Scored, A::RouteToApproval) => S::AwaitingApproval,
        (S::InReview, A::Accept | A::Edit) => S::AwaitingApproval,
        // A reviewer may edit before approving; the edit is a new artifact version.
        (S::AwaitingApproval, A::Edit) => S::AwaitingApproval,
        (S::InReview | S::AwaitingApproval, A::Reject) => S::Rejected,
        (S::AwaitingApproval, A::Approve) => S::Approved,
        (S::Approved, A::StartSend) => S::Sending,
        (S::Sending, A::ConfirmSent) => S::Sent,
        (S::Sending, A::RetryLater | A::Requeue) => S::Approved,
        // From `approved`: a policy refusal at send time (e.g. sender no longer verified).
        (S::Sending | S::Approved, A::FailPermanent) => S::Failed,
        (S::Sending, A::Park) => S::Parked,
        (S::Parked, A::ResolveConfirmedSent) => S::Sent,
        (S::Parked, A::ResolveResend) => S::Approved,
        (S::Parked, A::ResolveCancel) => S::Cancelled,
        (S::Persisted | S::Scored | S::InReview | S::AwaitingApproval | S::Approved, A::Cancel) => S::Cancelled,
        _ => return None,
    };
    Some(to)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{Action as A, DeliveryState as S, *};

    /// Every legal transition, written out independently of `next`.
    const EXPECTED: &[(DeliveryState, Action, DeliveryState)] = &[
        (S::Persisted, A::Score, S::Scored),
        (S::Persisted, A::Cancel, S::Cancelled),
        (S::Scored, A::RouteToReview, S::InReview),
        (S::Scored, A::RouteToApproval, S::AwaitingApproval),
        (S::Scored, A::Cancel, S::Cancelled),
        (S::InReview, A::Accept, S::AwaitingApproval),
        (S::InReview, A::Edit, S::AwaitingApproval),
        (S::InReview, A::Reject, S::Rejected),
        (S::InReview, A::Cancel, S::Cancelled),
        (S::AwaitingApproval, A::Edit, S::AwaitingApproval),
        (S::AwaitingApproval, A::Approve, S::Approved),
        (S::AwaitingApproval, A::Reject, S::Rejected),
        (S::AwaitingApproval, A::Cancel, S::Cancelled),
        (S::Approved, A::StartSend, S::Sending),
        (S::Approved, A::FailPermanent, S::Failed),
        (S::Approved, A::Cancel, S::Cancelled),
        (S::Sending, A::ConfirmSent, S::Sent),
        (S::Sending, A::RetryLater, S::Approved),
        (S::Sending, A::FailPermanent, S::Failed),
        (S::Sending, A::Park, S::Parked),
        (S::Sending, A::Requeue, S::Approved),
        (S::Parked, A::ResolveConfirmedSent, S::Sent),
        (S::Parked, A::ResolveResend, S::Approved),
        (S::Parked, A::ResolveCancel, S::Cancelled),
    ];

    #[test]
    fn every_pair_matches_the_written_table() {
        let mut checked = 0;
        for from in S::ALL {
            for action in A::ALL {
                let expected = EXPECTED.iter().find(|(f, a, _)| *f == from && *a == action).map(|(_, _, to)| *to);
                assert_eq!(next(from, action), expected, "{from} --{action}-->");
                checked += 1;
            }
        }
        assert_eq!(checked, 11 * 17);
        let legal = S::ALL
            .into_iter()
            .flat_map(|s| A::ALL.into_iter().map(move |a| (s, a)))
            .filter(|(s, a)| next(*s, *a).is_some())
            .count();
        assert_eq!(legal, EXPECTED.len());
    }

    #[test]
    fn no_transition_leaves_a_terminal_state() {
        for from in S::ALL.into_iter().filter(|s| s.is_terminal()) {
            for action in A::ALL {
                assert_eq!(next(from, action), None, "{from} --{action}-->");
            }
        }
        let terminal: Vec<_> = S::ALL.into_iter().filter(|s| s.is_terminal()).collect();
        assert_eq!(terminal, vec![S::Sent, S::Failed, S::Rejected, S::Cancelled]);
    }

    #[test]
    fn sending_is_only_entered_from_approved_and_approved_never_skips_the_gate() {
        for from in S::ALL {
            for action in A::ALL {
                if next(from, action) == Some(S::Sending) {
                    assert_eq!((from, action), (S::Approved, A::StartSend));
                }
                if next(from, action) == Some(S::Approved) {
                    assert!(
                        matches!(from, S::AwaitingApproval | S::Sending | S::Parked),
                        "{from} --{action}--> approved"
                    );
                }
            }
        }
    }

    #[test]
    fn cancel_only_before_sending() {
        let cancellable: Vec<_> = S::ALL.into_iter().filter(|s| s.can_cancel()).collect();
        assert_eq!(cancellable, vec![S::Persisted, S::Scored, S::InReview, S::AwaitingApproval, S::Approved]);
    }

    #[test]
    fn spellings_round_trip() {
        for s in S::ALL {
            assert_eq!(S::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), serde_json::json!(s.as_str()));
            assert_eq!(serde_json::from_value::<S>(serde_json::json!(s.as_str())).unwrap(), s);
        }
        assert_eq!(S::parse("InReview"), None);
        assert_eq!(S::AwaitingApproval.as_str(), "awaiting_approval");
        for a in A::ALL {
            assert_eq!(serde_json::to_value(a).unwrap(), serde_json::json!(a.as_str()));
        }
        let distinct: std::collections::HashSet<_> = A::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(distinct.len(), A::ALL.len());
    }
}
