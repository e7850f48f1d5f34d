//! Scoring: how harmless an artifact looks, with the reasons, before a human sees it.
//!
//! Invariants:
//! - A score is in `[0, 1]` (1 = harmless) with at most three decimals; items below
//!   `scoring.review_threshold` are routed to `in_review`.
//! - [`DefaultScorer`] is deterministic: the same artifact and configuration always give
//!   the same value and the same reasons in the same order. Penalties are summed in
//!   thousandths (integers), so no floating-point drift can move an item across the
//!   threshold.
//! - Every penalty comes with one stable, human-readable reason; a score of 1.0 has no
//!   reasons, and no reason is given without a penalty.
//! - The scorer only advises: it never approves anything. [`Scorer`] is a trait so a
//!   model-based judge can be added beside it: a [`Judge`] (`scoring.model`) scores too, the
//!   lower score counts, and a judge that cannot give a verdict sends the item to review.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};

use crate::artifact::{Artifact, EmailArtifact, WebhookArtifact};

/// A scorer's verdict on one artifact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// In `[0, 1]`, rounded to three decimals; 1 means nothing looked risky.
    pub value: f64,
    /// One line per penalty, in rule order, for the reviewer.
    pub reasons: Vec<String>,
}

/// Something that rates artifacts; the pipeline records [`Scorer::name`] with each score.
pub trait Scorer: Send + Sync {
    /// Rates `artifact`; must not fail (a scorer that cannot decide should score low).
    fn score(&self, artifact: &Artifact) -> Score;
    /// Stable identifier of the scorer, stored beside its scores.
    fn name(&self) -> &'static str;
}

/// A judge's score of one artifact, or why it could not give one.
pub type Verdict = Result<Score, String>;

/// A second opinion that takes time (a model asked over the network): asked before the
/// scoring transaction, never inside it. A judge never fails the scoring: what it cannot
/// decide is an `Err` verdict, and the item goes to review.
pub trait Judge: Send + Sync {
    /// Scores `artifact`, or says why it could not.
    fn judge<'a>(&'a self, artifact: &'a Artifact) -> Pin<Box<dyn Future<Output = Verdict> + Send + 'a>>;
    /// Stable identifier of the judge, stored beside the scores it gave.
    fn name(&self) -> &str;
}

/// Recipients above this count are "many".
pub const MANY_RECIPIENTS: usize = 5;
/// Links above this count are "many".
pub const MANY_LINKS: usize = 5;
/// Email bodies (text + html) above this many bytes are "large".
pub const LARGE_EMAIL_BODY_BYTES: usize = 20 * 1024;
/// Subjects shorter than this many characters (after trimming) are "very short".
pub const SHORT_SUBJECT_CHARS: usize = 3;
/// Webhook bodies (compact JSON) above this many bytes are "large".
pub const LARGE_WEBHOOK_BODY_BYTES: usize = 16 * 1024;
/// Custom webhook headers above this count are "many".
pub const MANY_HEADERS: usize = 5;

/// Penalties in thousandths of a point.
const UNKNOWN_DOMAIN_EACH: u32 = 150;
const UNKNOWN_DOMAIN_MAX: u32 = 450;
const MANY_RECIPIENTS_PENALTY: u32 = 200;
const SOME_LINKS_PENALTY: u32 = 100;
const MANY_LINKS_PENALTY: u32 = 250;
const LARGE_BODY_PENALTY: u32 = 100;
const SHORT_SUBJECT_PENALTY: u32 = 100;
const HTML_ONLY_PENALTY: u32 = 50;
const PLAINTEXT_WEBHOOK_PENALTY: u32 = 300;
const MANY_HEADERS_PENALTY: u32 = 50;

/// The built-in rule-based scorer.
///
/// Email: each recipient whose domain is not in `known_domains` costs 0.15 (at most 0.45);
/// more than 5 recipients 0.2; links in the body 0.1 (more than 5 links: 0.25); a body over
/// 20 KiB 0.1; an empty or very short subject 0.1; HTML with no plain-text alternative
/// 0.05. Webhook: plain `http://` 0.3; a body over 16 KiB 0.1; more than 5 custom headers
/// 0.05.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DefaultScorer {
    /// Recipient domains considered known, lowercase (`example.com`; a leading `@` is
    /// tolerated). Matching is exact: `example.com` does not cover `sub.example.com`.
    /// When the list is empty, every recipient domain counts as unknown.
    pub known_domains: Vec<String>,
}

impl DefaultScorer {
    /// A scorer that treats `known_domains` as known recipient domains.
    pub fn new(known_domains: Vec<String>) -> Self {
        Self { known_domains }
    }

    fn is_known(&self, domain: &str) -> bool {
        self.known_domains.iter().any(|k| {
            let k = k.trim();
            let k = k.strip_prefix('@').unwrap_or(k);
            k.to_lowercase() == domain.to_lowercase()
        })
    }

    fn score_email(&self, email: &EmailArtifact, penalties: &mut Penalties) {
        let unknown: Vec<&str> = email.recipients().map(|r| r.domain()).filter(|d| !self.is_known(d)).collect();
        if !unknown.is_empty() {
            let n = unknown.len();
            let domains: BTreeSet<&str> = unknown.into_iter().collect();
            let domains = domains.into_iter().collect::<Vec<_>>().join(", ");
            let reason = if n == 1 {
                format!("1 recipient in an unknown domain ({domains})")
            } else {
                format!("{n} recipients in unknown domains ({domains})")
            };
            let cost = (UNKNOWN_DOMAIN_EACH.saturating_mul(count_u32(n))).min(UNKNOWN_DOMAIN_MAX);
            penalties.add(cost, reason);
        }

        let recipients = email.to.len() + email.cc.len();
        if recipients > MANY_RECIPIENTS {
            penalties.add(MANY_RECIPIENTS_PENALTY, format!("{recipients} recipients (more than {MANY_RECIPIENTS})"));
        }

        // Text and HTML are alternatives of one message: count the links of the richer one.
        let text = email.text.as_deref().unwrap_or("");
        let html = email.html.as_deref().unwrap_or("");
        let links = count_links(text).max(count_links(html));
        if links > MANY_LINKS {
            penalties.add(MANY_LINKS_PENALTY, format!("{links} links (more than {MANY_LINKS})"));
        } else if links > 0 {
            let noun = if links == 1 { "link" } else { "links" };
            penalties.add(SOME_LINKS_PENALTY, format!("{links} {noun} in the body"));
        }

        let body_bytes = text.len() + html.len();
        if body_bytes > LARGE_EMAIL_BODY_BYTES {
            penalties.add(LARGE_BODY_PENALTY, format!("body is {body_bytes} bytes (more than 20 KiB)"));
        }

        let subject_chars = email.subject.trim().chars().count();
        if subject_chars == 0 {
            penalties.add(SHORT_SUBJECT_PENALTY, "subject is empty".to_owned());
        } else if subject_chars < SHORT_SUBJECT_CHARS {
            penalties.add(SHORT_SUBJECT_PENALTY, format!("subject is very short ({subject_chars} characters)"));
        }

        if !html.trim().is_empty() && text.trim().is_empty() {
            penalties.add(HTML_ONLY_PENALTY, "HTML body without a plain-text alternative".into());
        }
    }

    fn score_webhook(webhook: &WebhookArtifact, penalties: &mut Penalties) {
        let scheme = webhook.url.split_once("://").map_or("", |(s, _)| s);
        if scheme.eq_ignore_ascii_case("http") {
            penalties.add(PLAINTEXT_WEBHOOK_PENALTY, "webhook uses plain http".into());
        }

        let body_bytes = webhook.body.to_string().len();
        if body_bytes > LARGE_WEBHOOK_BODY_BYTES {
            penalties.add(LARGE_BODY_PENALTY, format!("webhook body is {body_bytes} bytes (more than 16 KiB)"));
        }

        let headers = webhook.headers.len();
        if headers > MANY_HEADERS {
            penalties.add(MANY_HEADERS_PENALTY, format!("{headers} custom headers (more than {MANY_HEADERS})"));
        }
    }
}

impl Scorer for DefaultScorer {
    fn score(&self, artifact: &Artifact) -> Score {
        let mut penalties = Penalties::default();
        match artifact {
            Artifact::Email { email } => self.score_email(email, &mut penalties),
            Artifact::Webhook { webhook } => Self::score_webhook(webhook, &mut penalties),
        }
        penalties.into_score()
    }

    fn name(&self) -> &'static str {
        "default"
    }
}

/// Penalties accumulated in thousandths, with their reasons.
#[derive(Default)]
struct Penalties {
    milli: u32,
    reasons: Vec<String>,
}

impl Penalties {
    fn add(&mut self, milli: u32, reason: String) {
        self.milli = self.milli.saturating_add(milli);
        self.reasons.push(reason);
    }

    fn into_score(self) -> Score {
        let remaining = 1000u32.saturating_sub(self.milli);
        Score { value: f64::from(remaining) / 1000.0, reasons: self.reasons }
    }
}

/// Occurrences of `http://` and `https://`, ignoring case.
fn count_links(s: &str) -> usize {
    let lower = s.to_ascii_lowercase();
    lower.matches("http://").count() + lower.matches("https://").count()
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::artifact::Limits;

    fn scorer() -> DefaultScorer {
        DefaultScorer::new(vec!["example.com".into(), "example.org".into()])
    }

    fn email(patch: Value) -> Artifact {
        let mut v = json!({
            "from": "agent@example.com",
            "to": ["a@example.org"],
            "subject": "Quarterly report",
            "text": "Hello, the report is attached below."
        });
        for (k, val) in patch.as_object().unwrap() {
            v.as_object_mut().unwrap().insert(k.clone(), val.clone());
        }
        Artifact::from_parts("email", Some(&v), None, &Limits::default()).unwrap()
    }

    fn webhook(v: Value) -> Artifact {
        Artifact::from_parts("webhook", None, Some(&v), &Limits::default()).unwrap()
    }

    fn score(a: &Artifact) -> Score {
        scorer().score(a)
    }

    #[test]
    fn clean_email_is_harmless() {
        let s = score(&email(json!({})));
        assert_eq!(s, Score { value: 1.0, reasons: vec![] });
        assert_eq!(scorer().name(), "default");
    }

    #[test]
    fn unknown_domains_cost_each_up_to_a_cap() {
        let s = score(&email(json!({"to": ["a@other.org"]})));
        assert_eq!(s.value, 0.85);
        assert_eq!(s.reasons, vec!["1 recipient in an unknown domain (other.org)"]);

        let s = score(&email(json!({"to": ["a@other.org", "b@example.org"], "cc": ["c@other.org"]})));
        assert_eq!(s.value, 0.7);
        assert_eq!(s.reasons, vec!["2 recipients in unknown domains (other.org)"]);

        let s = score(&email(json!({"to": ["a@z.org", "b@y.org", "c@x.org", "d@w.org", "e@x.org"]})));
        assert_eq!(s.value, 0.55);
        assert_eq!(s.reasons, vec!["5 recipients in unknown domains (w.org, x.org, y.org, z.org)"]);

        // Sub-domains are not covered; domain case does not matter.
        let s = score(&email(json!({"to": ["a@sub.example.com", "b@EXAMPLE.com"]})));
        assert_eq!(s.value, 0.85);
        let tolerant = DefaultScorer::new(vec![" @Example.ORG ".into()]);
        assert_eq!(tolerant.score(&email(json!({}))).value, 1.0);
    }

    #[test]
    fn empty_known_domains_means_all_unknown() {
        let s = DefaultScorer::default().score(&email(json!({"to": ["a@example.com"]})));
        assert_eq!(s.value, 0.85);
        assert_eq!(s.reasons.len(), 1);
    }

    #[test]
    fn many_recipients() {
        let to: Vec<String> = (0..6).map(|i| format!("r{i}@example.com")).collect();
        let s = score(&email(json!({ "to": to })));
        assert_eq!(s.value, 0.8);
        assert_eq!(s.reasons, vec!["6 recipients (more than 5)"]);
        let to: Vec<String> = (0..5).map(|i| format!("r{i}@example.com")).collect();
        assert_eq!(score(&email(json!({ "to": to }))).value, 1.0);
    }

    #[test]
    fn links() {
        let s = score(&email(json!({"text": "see https://example.com/x"})));
        assert_eq!(s.value, 0.9);
        assert_eq!(s.reasons, vec!["1 link in the body"]);

        let five = "http://a HTTPS://b https://c http://d https://e";
        let s = score(&email(json!({ "text": five })));
        assert_eq!((s.value, s.reasons[0].as_str()), (0.9, "5 links in the body"));

        let six = format!("{five} https://f");
        let s = score(&email(json!({ "text": six })));
        assert_eq!(s.value, 0.75);
        assert_eq!(s.reasons, vec!["6 links (more than 5)"]);

        // Alternatives are not double counted: the richer body decides.
        let s = score(&email(json!({
            "text": "https://a https://b https://c",
            "html": "<a href=\"https://a\">a</a> <a href=\"https://b\">b</a> https://c"
        })));
        assert_eq!(s.reasons, vec!["3 links in the body"]);
    }

    #[test]
    fn large_body() {
        let s = score(&email(json!({"text": "x".repeat(20 * 1024 + 1)})));
        assert_eq!(s.value, 0.9);
        assert_eq!(s.reasons, vec!["body is 20481 bytes (more than 20 KiB)"]);
        assert_eq!(score(&email(json!({"text": "x".repeat(20 * 1024)}))).value, 1.0);
    }

    #[test]
    fn short_subject() {
        let s = score(&email(json!({"subject": ""})));
        assert_eq!((s.value, s.reasons.clone()), (0.9, vec!["subject is empty".to_owned()]));
        let s = score(&email(json!({"subject": "  "})));
        assert_eq!(s.reasons, vec!["subject is empty"]);
        let s = score(&email(json!({"subject": "Hi"})));
        assert_eq!(s.reasons, vec!["subject is very short (2 characters)"]);
        assert_eq!(score(&email(json!({"subject": "Hey"}))).value, 1.0);
    }

    #[test]
    fn html_without_text() {
        let s = score(&email(json!({"text": null, "html": "<p>Hello there</p>"})));
        assert_eq!(s.value, 0.95);
        assert_eq!(s.reasons, vec!["HTML body without a plain-text alternative"]);
        let both = email(json!({"html": "<p>Hello there</p>"}));
        assert_eq!(score(&both).value, 1.0);
    }

    #[test]
    fn penalties_add_up_in_rule_order_and_clamp() {
        let to: Vec<String> = (0..6).map(|i| format!("r{i}@x{i}.net")).collect();
        let links = "https://l ".repeat(6);
        let a = email(json!({
            "to": to, "subject": "", "text": null,
            "html": format!("{links}{}", "y".repeat(21 * 1024))
        }));
        let s = score(&a);
        // 0.45 + 0.2 + 0.25 + 0.1 + 0.1 + 0.05 = 1.15 > 1.
        assert_eq!(s.value, 0.0);
        assert_eq!(s.reasons.len(), 6);
        assert!(s.reasons[0].starts_with("6 recipients in unknown domains"));
        assert_eq!(s.reasons[1], "6 recipients (more than 5)");
        assert_eq!(s.reasons[2], "6 links (more than 5)");
        assert!(s.reasons[3].starts_with("body is "));
        assert_eq!(s.reasons[4], "subject is empty");
        assert_eq!(s.reasons[5], "HTML body without a plain-text alternative");
    }

    #[test]
    fn webhook_rules() {
        let clean = webhook(json!({"url": "https://h.example/x", "body": {"a": 1}}));
        assert_eq!(score(&clean), Score { value: 1.0, reasons: vec![] });

        let plain = webhook(json!({"url": "HTTP://localhost:8080/x", "body": {}}));
        let s = score(&plain);
        assert_eq!((s.value, s.reasons.clone()), (0.7, vec!["webhook uses plain http".to_owned()]));

        let big = webhook(json!({"url": "https://h.example", "body": "x".repeat(16 * 1024)}));
        let s = score(&big);
        assert_eq!(s.value, 0.9);
        assert_eq!(s.reasons, vec!["webhook body is 16386 bytes (more than 16 KiB)"]);

        let headers: serde_json::Map<String, Value> = (0..6).map(|i| (format!("X-{i}"), json!("v"))).collect();
        let many = webhook(json!({"url": "https://h.example", "body": 1, "headers": headers}));
        let s = score(&many);
        assert_eq!(s.value, 0.95);
        assert_eq!(s.reasons, vec!["6 custom headers (more than 5)"]);

        let all = webhook(json!({"url": "http://h.example", "body": "x".repeat(20000), "headers": headers}));
        assert_eq!(score(&all).value, 0.55);
    }

    #[test]
    fn deterministic() {
        let a = email(json!({"to": ["b@q.org", "a@p.org"], "text": "https://x", "subject": "?"}));
        let first = score(&a);
        for _ in 0..20 {
            assert_eq!(score(&a), first);
            assert_eq!(score(&a.clone()), first);
        }
        assert_eq!(first.value, 0.5);
        assert_eq!(first.reasons[0], "2 recipients in unknown domains (p.org, q.org)");
        // Values have at most three decimals.
        assert_eq!((first.value * 1000.0).round() / 1000.0, first.value);
    }
}
