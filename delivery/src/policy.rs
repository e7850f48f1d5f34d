//! Send-time policy: who may send, where webhooks may go, and the keys that make an
//! effect recognisable (idempotency key, Message-ID, webhook signature).
//!
//! Invariants:
//! - Everything here is a pure function of its inputs (configuration, artifact, run and
//!   step ids, secret), so a check made in the send transaction gives the same answer on
//!   every worker, and a key derived on one attempt is the key of every retry.
//! - Fail closed: an empty sender list lets no email out; an empty origin list lets no
//!   webhook out; an allowlist entry that is not a bare origin matches nothing.
//! - Plain `http://` is refused unless explicitly allowed, and even then only to a
//!   loopback host that is itself on the allowlist.
//! - Errors never echo a full webhook URL (its query may carry a token); at most its
//!   origin.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use uuid::Uuid;

use crate::artifact::{EmailAddress, Scheme, parse_url};

type HmacSha256 = Hmac<Sha256>;

/// Why an effect may not be performed as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The From address is not in `delivery.senders`.
    #[error("sender {0} is not a verified sender")]
    UnverifiedSender(String),
    /// The webhook URL's origin is not in `delivery.webhook_origins`.
    #[error("webhook origin {0} is not allowed")]
    OriginNotAllowed(String),
    /// The webhook URL is `http://` and plaintext to it is not allowed.
    #[error(
        "plain http is only allowed to a loopback origin with \
         delivery.webhook_allow_plaintext_loopback"
    )]
    PlaintextWebhook,
    /// The webhook URL does not parse (see `artifact::origin_of` for the rules).
    #[error("invalid url: {0}")]
    BadUrl(String),
}

/// Checks that `from` is a verified sender. `senders` entries are either an exact address
/// (local part compared exactly, domain ignoring case) or `@domain` (domain ignoring case,
/// exact: `@example.com` does NOT cover `sub.example.com`). Surrounding whitespace in an
/// entry is ignored.
pub fn check_sender(senders: &[String], from: &EmailAddress) -> Result<(), PolicyError> {
    let domain_matches = |domain: &str| !domain.is_empty() && domain.to_lowercase() == from.domain();
    let verified = senders.iter().any(|entry| {
        let entry = entry.trim();
        match entry.strip_prefix('@') {
            Some(domain) => domain_matches(domain),
            None => entry
                .rsplit_once('@')
                .is_some_and(|(local, domain)| local == from.local_part() && domain_matches(domain)),
        }
    });
    if verified { Ok(()) } else { Err(PolicyError::UnverifiedSender(from.to_string())) }
}

/// Normalises an allowlist entry (`https://host[:port]`, optionally with a trailing `/`)
/// the way [`crate::artifact::origin_of`] normalises a URL. `None` when the entry is not a
/// bare origin (it has a path or query, credentials, …); configuration should refuse those.
pub fn normalize_origin(entry: &str) -> Option<String> {
    let parts = parse_url(entry.trim()).ok()?;
    matches!(parts.path_and_query, "" | "/").then(|| parts.origin())
}

/// Checks a webhook URL against the allowlist `origins`: the URL's origin must equal one
/// entry after both are normalised. `http://` is accepted only when
/// `allow_plaintext_loopback` is set and the host is loopback (`localhost`, `127.0.0.0/8`,
/// `[::1]`), and the origin must still be on the allowlist.
pub fn check_webhook_url(origins: &[String], url: &str, allow_plaintext_loopback: bool) -> Result<(), PolicyError> {
    let parts = parse_url(url).map_err(PolicyError::BadUrl)?;
    if parts.scheme == Scheme::Http && !(allow_plaintext_loopback && is_loopback(&parts.host)) {
        return Err(PolicyError::PlaintextWebhook);
    }
    let origin = parts.origin();
    if origins.iter().filter_map(|o| normalize_origin(o)).any(|o| o == origin) {
        Ok(())
    } else {
        Err(PolicyError::OriginNotAllowed(origin))
    }
}

/// True for `localhost`, any `127.0.0.0/8` address and `[::1]` (hosts as normalised by the
/// URL parser: lowercase, IPv6 bracketed).
fn is_loopback(host: &str) -> bool {
    if host == "localhost" {
        return true;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok_and(|ip| ip.is_loopback());
    }
    host.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Idempotency key of the delivery of step `step_id` of run `run_id`: `"dlv_"` followed by
/// the run's one key derivation ([`airlock_runs::key::digest`]: the first 32 hex characters
/// of sha256(`"airlock/v1\0" + run_id + "\0" + step_id`)). Deterministic, so every retry
/// and every worker derives the same key.
pub fn idempotency_key(run_id: &Uuid, step_id: &str) -> String {
    format!("dlv_{}", airlock_runs::key::digest((*run_id).into(), step_id))
}

/// Message-ID of an email, derived from its idempotency key so that whoever resolves a
/// parked send (or the receiving system) can search for it: `<{key}@{from domain}>`.
pub fn message_id(idempotency_key: &str, from: &EmailAddress) -> String {
    format!("<{idempotency_key}@{}>", from.domain())
}

/// `Airlock-Signature` header value for a webhook request:
/// `t=<unix seconds>,v1=<lowercase hex HMAC-SHA256(secret, "<t>.<raw body>")>`.
pub fn webhook_signature(secret: &[u8], unix_seconds: i64, raw_body: &[u8]) -> String {
    let t = unix_seconds.to_string();
    let tag = signing_mac(secret, &t, raw_body).finalize().into_bytes();
    format!("t={t},v1={}", hex::encode(tag))
}

/// Verifies an `Airlock-Signature` header against `raw_body` (for receivers and tests).
/// Accepts the header when it has exactly one integer `t` and any `v1` matches (several
/// `v1` entries allow secret rotation); unknown entries are ignored. The comparison is
/// constant-time. The timestamp's age is not checked here: receivers should also refuse
/// old timestamps to limit replays.
pub fn verify_webhook_signature(secret: &[u8], header: &str, raw_body: &[u8]) -> bool {
    let mut t = None;
    let mut candidates = Vec::new();
    for entry in header.split(',') {
        let Some((key, value)) = entry.trim().split_once('=') else {
            return false;
        };
        match key {
            "t" => {
                if t.is_some() || value.parse::<i64>().is_err() {
                    return false;
                }
                t = Some(value);
            }
            "v1" => match hex::decode(value) {
                Ok(bytes) => candidates.push(bytes),
                Err(_) => return false,
            },
            _ => {}
        }
    }
    let Some(t) = t else {
        return false;
    };
    let mac = signing_mac(secret, t, raw_body);
    candidates.iter().any(|tag| mac.clone().verify_slice(tag).is_ok())
}

/// The HMAC key of a Standard Webhooks secret: `whsec_<base64 key>` gives the decoded
/// key; any other value is used as it is (a receiver then verifies with `whsec_` followed
/// by the value in base64). `None` for an empty secret or a `whsec_` one that is not
/// base64.
pub fn standard_webhook_key(secret: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    let secret = secret.trim();
    if secret.is_empty() {
        return None;
    }
    match secret.strip_prefix("whsec_") {
        Some(b64) => base64::engine::general_purpose::STANDARD.decode(b64).ok().filter(|k| !k.is_empty()),
        None => Some(secret.as_bytes().to_vec()),
    }
}

/// `webhook-signature` header value (Standard Webhooks): `v1,<base64 HMAC-SHA256(key,
/// "<webhook-id>.<webhook-timestamp>.<raw body>")>`.
pub fn standard_webhook_signature(key: &[u8], id: &str, unix_seconds: i64, raw_body: &[u8]) -> String {
    use base64::Engine;
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts keys of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(unix_seconds.to_string().as_bytes());
    mac.update(b".");
    mac.update(raw_body);
    format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
}

/// HMAC-SHA256 keyed with `secret`, fed `"<t>.<raw body>"`.
fn signing_mac(secret: &[u8], t: &str, raw_body: &[u8]) -> HmacSha256 {
    // HMAC is defined for keys of every length (long keys are hashed), so this cannot fail.
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(t.as_bytes());
    mac.update(b".");
    mac.update(raw_body);
    mac
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn addr(s: &str) -> EmailAddress {
        EmailAddress::parse(s).unwrap()
    }

    fn list(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn standard_webhook_keys_and_signatures() {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        assert_eq!(standard_webhook_key("whsec_AAEC").unwrap(), vec![0, 1, 2]);
        assert_eq!(standard_webhook_key("plain").unwrap(), b"plain".to_vec());
        assert!(standard_webhook_key("whsec_!!").is_none());
        assert!(standard_webhook_key("whsec_").is_none());
        assert!(standard_webhook_key(" ").is_none());
        let sig = standard_webhook_signature(b"k", "id-1", 1_700_000_000, b"{}");
        let tag = b64.decode(sig.strip_prefix("v1,").unwrap()).unwrap();
        let mut mac = HmacSha256::new_from_slice(b"k").unwrap();
        mac.update(b"id-1.1700000000.{}");
        assert!(mac.verify_slice(&tag).is_ok());
        assert_ne!(sig, standard_webhook_signature(b"other", "id-1", 1_700_000_000, b"{}"));
    }

    #[test]
    fn senders_exact_and_domain() {
        let senders = list(&["agent@Example.com", "@example.org", " ops@corp.example "]);
        assert!(check_sender(&senders, &addr("agent@example.com")).is_ok());
        assert!(check_sender(&senders, &addr("agent@EXAMPLE.COM")).is_ok());
        assert!(check_sender(&senders, &addr("anyone@example.org")).is_ok());
        assert!(check_sender(&senders, &addr("x@Example.ORG")).is_ok());
        assert!(check_sender(&senders, &addr("ops@corp.example")).is_ok());

        // Local part is exact; sub-domains are not covered; other domains refused.
        for refused in [
            "Agent@example.com",
            "other@example.com",
            "agent@sub.example.com",
            "x@sub.example.org",
            "x@example.org.evil",
            "x@notexample.org",
        ] {
            let err = check_sender(&senders, &addr(refused)).unwrap_err();
            assert!(matches!(err, PolicyError::UnverifiedSender(_)), "{refused}");
        }
        let err = check_sender(&[], &addr("agent@example.com")).unwrap_err();
        assert_eq!(err.to_string(), "sender agent@example.com is not a verified sender");
        // Malformed entries match nothing.
        assert!(check_sender(&list(&["@", "example.com", ""]), &addr("a@example.com")).is_err());
    }

    #[test]
    fn webhook_origins() {
        let origins = list(&["https://hooks.example.com", "https://api.example.net:8443/"]);
        let ok = |url: &str| check_webhook_url(&origins, url, false);
        assert!(ok("https://hooks.example.com/a/b?c=d").is_ok());
        assert!(ok("https://HOOKS.example.com:443/").is_ok());
        assert!(ok("https://api.example.net:8443/x").is_ok());

        for (url, origin) in [
            ("https://sub.hooks.example.com/", "https://sub.hooks.example.com"),
            ("https://hooks.example.com:8443/", "https://hooks.example.com:8443"),
            ("https://api.example.net/", "https://api.example.net"),
            ("https://hooks.example.com.evil.net/", "https://hooks.example.com.evil.net"),
        ] {
            assert_eq!(ok(url).unwrap_err(), PolicyError::OriginNotAllowed(origin.into()));
        }
        assert!(matches!(ok("https://u:p@hooks.example.com/"), Err(PolicyError::BadUrl(_))));
        assert!(matches!(ok("hooks.example.com"), Err(PolicyError::BadUrl(_))));
        assert!(check_webhook_url(&[], "https://hooks.example.com/", false).is_err());
    }

    #[test]
    fn bad_url_error_does_not_echo_the_url() {
        let err = check_webhook_url(&[], "https://h.example/?token=SECRET#x", false).unwrap_err();
        assert!(!err.to_string().contains("SECRET"));
    }

    #[test]
    fn allowlist_entries_must_be_bare_origins() {
        assert_eq!(normalize_origin("https://H.example:443/").as_deref(), Some("https://h.example"));
        assert_eq!(normalize_origin(" http://[::1]:8080 ").as_deref(), Some("http://[::1]:8080"));
        assert_eq!(normalize_origin("https://h.example/api"), None);
        assert_eq!(normalize_origin("https://h.example?x"), None);
        assert_eq!(normalize_origin("h.example"), None);
        let origins = list(&["https://h.example/api"]);
        assert!(check_webhook_url(&origins, "https://h.example/api", false).is_err());
    }

    #[test]
    fn plaintext_only_to_allowlisted_loopback_when_enabled() {
        let origins =
            list(&["http://localhost:8080", "http://127.0.0.1:9000", "http://[::1]:9001", "http://hooks.example.com"]);
        for url in ["http://localhost:8080/x", "http://127.0.0.1:9000/", "http://[::1]:9001/"] {
            assert!(check_webhook_url(&origins, url, true).is_ok(), "{url}");
            assert_eq!(check_webhook_url(&origins, url, false), Err(PolicyError::PlaintextWebhook));
        }
        // Loopback but not on the allowlist.
        assert_eq!(
            check_webhook_url(&origins, "http://127.0.0.2:9000/", true),
            Err(PolicyError::OriginNotAllowed("http://127.0.0.2:9000".into()))
        );
        // Allowlisted but not loopback: never plaintext.
        assert_eq!(check_webhook_url(&origins, "http://hooks.example.com/", true), Err(PolicyError::PlaintextWebhook));
        assert_eq!(check_webhook_url(&origins, "http://10.0.0.1/", true), Err(PolicyError::PlaintextWebhook));
        // An https origin does not admit http on the same host.
        let https_only = list(&["https://localhost:8080"]);
        assert!(check_webhook_url(&https_only, "http://localhost:8080/", true).is_err());
    }

    #[test]
    fn loopback_hosts() {
        for h in ["localhost", "127.0.0.1", "127.255.0.9", "[::1]"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["localhost.evil.net", "128.0.0.1", "[::2]", "0.0.0.0", "example.com"] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn idempotency_key_vector() {
        // python3: "dlv_" + sha256(b"airlock/v1\0" + run_id + b"\0" + b"draft-1")[:32]
        let run = Uuid::parse_str("00000000-0000-0000-0000-000000000001").unwrap();
        let key = idempotency_key(&run, "draft-1");
        assert_eq!(key, "dlv_0724f810eccd9baea946b67134c71a98");
        assert_eq!(idempotency_key(&run, "draft-1"), key);
        assert_ne!(idempotency_key(&run, "draft-2"), key);
        assert_ne!(idempotency_key(&Uuid::nil(), "draft-1"), key);
    }

    #[test]
    fn message_id_uses_from_domain() {
        let from = addr("agent@Example.com");
        assert_eq!(message_id("dlv_abc", &from), "<dlv_abc@example.com>");
    }

    #[test]
    fn signature_vector() {
        // python3: hmac.new(b"s3cret", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
        let sig = webhook_signature(b"s3cret", 1_700_000_000, br#"{"a":1}"#);
        assert_eq!(sig, "t=1700000000,v1=1698a50bc74d1ff1db85c4e0a5297c2ad9fdba245d5737cdb789e4cc6e098940");
        assert!(verify_webhook_signature(b"s3cret", &sig, br#"{"a":1}"#));
    }

    #[test]
    fn signature_verification_refuses_tampering() {
        let body = br#"{"a":1}"#;
        let sig = webhook_signature(b"s3cret", 1_700_000_000, body);
        assert!(!verify_webhook_signature(b"other", &sig, body));
        assert!(!verify_webhook_signature(b"s3cret", &sig, br#"{"a":2}"#));
        let shifted = sig.replace("t=1700000000", "t=1700000001");
        assert!(!verify_webhook_signature(b"s3cret", &shifted, body));
        let v1 = sig.split_once(",v1=").unwrap().1;
        assert!(!verify_webhook_signature(b"s3cret", &format!("v1={v1}"), body));
        assert!(!verify_webhook_signature(b"s3cret", "t=1700000000", body));
        assert!(!verify_webhook_signature(b"s3cret", "t=1700000000,v1=zz", body));
        assert!(!verify_webhook_signature(b"s3cret", "", body));
        let twice = format!("t=1700000000,{sig}");
        assert!(!verify_webhook_signature(b"s3cret", &twice, body));
        // Rotation: any matching v1 is enough; unknown entries are ignored.
        let rotated = format!("t=1700000000,v1={},v1={v1},v2=abc", "00".repeat(32));
        assert!(verify_webhook_signature(b"s3cret", &rotated, body));
        // Empty and long secrets are valid HMAC keys.
        let long = [7u8; 200];
        for secret in [&b""[..], &long[..]] {
            let s = webhook_signature(secret, 1, b"x");
            assert!(verify_webhook_signature(secret, &s, b"x"));
        }
    }
}
