//! Suppressions: addresses and domains nothing may be sent to, whoever asks.
//!
//! Invariants:
//! - A submission naming a suppressed recipient is refused (`RECIPIENT_SUPPRESSED`) and
//!   nothing is written; a delivery approved before its recipient was suppressed fails in
//!   transaction A of its send and is never sent ([`crate::pipeline::send::gate`]).
//! - A domain suppression covers the domain and every domain under it; addresses and
//!   domains compare without regard to case (a suppression errs on the side of not
//!   sending).
//! - Every change is audited in its own transaction, under the list's lock (see
//!   [`crate::store::suppressions`]).

use std::collections::BTreeSet;

use airlock_core::audit;
use airlock_core::error::{DomainError, ErrorKind};
use airlock_core::principals::Principal;
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::artifact::{Artifact, EmailAddress};
use crate::store::suppressions::{self as store, Suppression, SuppressionKind};

#[derive(Debug, thiserror::Error)]
pub enum SuppressionError {
    #[error("{0}")]
    Invalid(String),
    #[error("suppression not found")]
    NotFound,
    #[error("the suppression is already lifted")]
    AlreadyLifted,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl DomainError for SuppressionError {
    fn kind(&self) -> ErrorKind {
        match self {
            SuppressionError::Invalid(_) => ErrorKind::Validation,
            SuppressionError::NotFound => ErrorKind::NotFound,
            SuppressionError::AlreadyLifted => ErrorKind::InvalidTransition,
            SuppressionError::Db(_) => ErrorKind::Internal,
        }
    }
}

/// A suppression as an operator asks for it: an address or a domain, and why.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSuppression {
    pub address: Option<String>,
    pub domain: Option<String>,
    pub reason: Option<String>,
}

impl NewSuppression {
    /// The kind and normalised value (lowercase; a domain without a leading `@`) and reason.
    fn check(&self) -> Result<(SuppressionKind, String, String), SuppressionError> {
        let invalid = |m: &str| SuppressionError::Invalid(m.into());
        let reason = self.reason.as_deref().map(str::trim).unwrap_or("");
        if reason.is_empty() || reason.chars().count() > 2000 || reason.chars().any(char::is_control) {
            return Err(invalid("reason: 1 to 2000 characters without control characters are required"));
        }
        let (kind, value) = match (self.address.as_deref(), self.domain.as_deref()) {
            (Some(a), None) => {
                let a = EmailAddress::parse(a.trim())
                    .map_err(|e| SuppressionError::Invalid(format!("address: {}", e.message)))?;
                (SuppressionKind::Address, a.as_str().to_lowercase())
            }
            (None, Some(d)) => {
                let d = d.trim().trim_start_matches('@').trim_end_matches('.').to_lowercase();
                // The domain must be one an address could have: check it as the domain of one.
                if d.is_empty() || EmailAddress::parse(&format!("x@{d}")).is_err() {
                    return Err(invalid("domain: must be a domain name"));
                }
                (SuppressionKind::Domain, d)
            }
            _ => return Err(invalid("give exactly one of address or domain")),
        };
        Ok((kind, value, reason.to_string()))
    }
}

/// Suppresses an address or a domain (audited). An existing live suppression of the same
/// recipient is returned as it is (`false`), and nothing is written.
pub async fn create(
    pool: &PgPool,
    who: &Principal,
    new: &NewSuppression,
) -> Result<(Suppression, bool), SuppressionError> {
    let (kind, value, reason) = new.check()?;
    let mut tx = pool.begin().await?;
    store::lock_suppressions(&mut *tx).await?;
    let Some(s) = store::insert_suppression(&mut *tx, kind, &value, &reason, &who.name).await? else {
        let existing = store::find_live_suppression(&mut *tx, kind, &value).await?.ok_or(SuppressionError::NotFound)?;
        return Ok((existing, false));
    };
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action: "suppression.create",
            target_kind: "suppression",
            target_id: s.id.to_string(),
            reason: Some(&reason),
            data: json!({"kind": kind, "value": value}),
        },
    )
    .await?;
    tx.commit().await?;
    tracing::warn!(suppression.id = %s.id, by = %who.name, "recipient suppressed");
    Ok((s, true))
}

/// Lifts a suppression (audited).
pub async fn lift(
    pool: &PgPool,
    who: &Principal,
    id: Uuid,
    reason: Option<&str>,
) -> Result<Suppression, SuppressionError> {
    let reason = reason.map(str::trim).filter(|r| !r.is_empty()).unwrap_or("lifted");
    if reason.chars().count() > 2000 || reason.chars().any(char::is_control) {
        return Err(SuppressionError::Invalid("reason: at most 2000 characters, no control characters".into()));
    }
    let mut tx = pool.begin().await?;
    store::lock_suppressions(&mut *tx).await?;
    let Some(s) = store::lift_suppression(&mut *tx, id, &who.name).await? else {
        return Err(match store::get_suppression(&mut *tx, id).await? {
            Some(_) => SuppressionError::AlreadyLifted,
            None => SuppressionError::NotFound,
        });
    };
    audit::record(
        &mut tx,
        who,
        audit::Action {
            action: "suppression.lift",
            target_kind: "suppression",
            target_id: s.id.to_string(),
            reason: Some(reason),
            data: json!({"kind": s.kind, "value": s.value}),
        },
    )
    .await?;
    tx.commit().await?;
    Ok(s)
}

/// The recipients of an artifact a suppression is looked up by: lowercase addresses, and
/// every domain they are in (`a.b.example.org`, `b.example.org`, `example.org`, `org`).
/// Empty for a webhook.
pub fn lookup_keys(artifact: &Artifact) -> (Vec<String>, Vec<String>) {
    let Artifact::Email { email } = artifact else {
        return (Vec::new(), Vec::new());
    };
    let addresses: BTreeSet<String> = email.recipients().map(|a| a.as_str().to_lowercase()).collect();
    let mut domains = BTreeSet::new();
    for a in email.recipients() {
        let mut d = a.domain().to_lowercase();
        loop {
            domains.insert(d.clone());
            match d.split_once('.') {
                Some((_, rest)) if !rest.is_empty() => d = rest.to_string(),
                _ => break,
            }
        }
    }
    (addresses.into_iter().collect(), domains.into_iter().collect())
}

/// What a refusal says: the first suppression that matches.
pub fn describe(s: &Suppression) -> String {
    match s.kind {
        SuppressionKind::Address => format!("recipient {} is suppressed", s.value),
        SuppressionKind::Domain => format!("recipients in {} are suppressed", s.value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::Limits;

    fn email(to: &[&str]) -> Artifact {
        Artifact::from_json(
            &json!({"channel": "email", "email": {"from": "agent@example.com", "to": to, "cc": [],
                    "subject": "s", "text": "t", "html": null}}),
            &Limits::default(),
        )
        .unwrap()
    }

    #[test]
    fn keys_cover_every_parent_domain_and_ignore_case() {
        let (a, d) = lookup_keys(&email(&["Bob@Mail.Example.ORG", "x@example.org"]));
        assert_eq!(a, vec!["bob@mail.example.org", "x@example.org"]);
        assert_eq!(d, vec!["example.org", "mail.example.org", "org"]);
    }

    #[test]
    fn a_new_suppression_names_one_recipient_and_a_reason() {
        let new = |a: Option<&str>, d: Option<&str>, r: Option<&str>| NewSuppression {
            address: a.map(Into::into),
            domain: d.map(Into::into),
            reason: r.map(Into::into),
        };
        let (k, v, _) = new(Some("Bob@Example.ORG"), None, Some("bounced")).check().unwrap();
        assert_eq!((k, v.as_str()), (SuppressionKind::Address, "bob@example.org"));
        let (k, v, _) = new(None, Some("@Example.org"), Some("complaint")).check().unwrap();
        assert_eq!((k, v.as_str()), (SuppressionKind::Domain, "example.org"));
        assert!(new(Some("a@b.c"), Some("b.c"), Some("r")).check().is_err());
        assert!(new(None, None, Some("r")).check().is_err());
        assert!(new(Some("a@b.c"), None, None).check().is_err());
        assert!(new(Some("a@b.c"), None, Some("  ")).check().is_err());
        assert!(new(None, Some("a b"), Some("r")).check().is_err());
        assert!(new(None, Some("x@y"), Some("r")).check().is_err());
    }
}
