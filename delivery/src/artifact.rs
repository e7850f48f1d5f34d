//! Artifacts: what an agent hands over (an email or a webhook call), parsed once at the
//! edge into types that hold only acceptable values.
//!
//! Invariants:
//! - [`Artifact::from_parts`] and [`Artifact::from_json`] are the only ways untrusted JSON
//!   becomes an [`Artifact`]; they apply every rule below and name the offending member
//!   by its JSON path (`email.to[1]`, `webhook.url`) in the [`ValidationError`].
//! - Unknown members inside `email`/`webhook` are refused, never ignored: a field the
//!   agent believes is honoured but is silently dropped would be a review hazard.
//! - The canonical form ([`Artifact::to_json`], [`Artifact::canonical_bytes`]) is a pure
//!   function of the artifact: object keys are sorted, optional members are always present
//!   (`null`, `[]`, `{}`), so the same artifact always has the same bytes and the same
//!   sha256, whatever order or spelling of defaults the agent used.
//! - An [`EmailAddress`] is a bare address (no display name, no whitespace) whose domain is
//!   lowercase; two addresses are the same recipient when they are equal ignoring case.
//! - A webhook URL is absolute `http(s)://host[:port]…`, printable ASCII, without
//!   credentials or fragment, and its host is one that every URL parser reads the same way
//!   (no backslashes, percent-encoding or numeric shorthands such as `127.1`), so the
//!   origin checked by the policy is the origin that is contacted.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Longest email address accepted, in bytes (RFC 5321 path limit minus the brackets).
pub const MAX_ADDRESS_BYTES: usize = 254;

/// Longest webhook URL accepted, in characters.
pub const MAX_URL_CHARS: usize = 2048;

/// Webhook header names an agent may not set (compared ignoring case): airlock sets the
/// first group itself, and the hop-by-hop ones belong to the HTTP transport.
pub const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "idempotency-key",
    "airlock-signature",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Why an input was refused: ordinary bad input, or input over the size limit (which the
/// HTTP layer reports as 413 rather than 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValidationKind {
    /// The input breaks a rule; answered with 400 `VALIDATION`.
    Invalid,
    /// The input is larger than [`Limits::max_artifact_bytes`]; answered with 413.
    TooLarge,
}

/// A refused input: which member (`field`, a JSON path such as `email.to[1]`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// JSON path of the offending member (`email.subject`, `webhook.headers.X-Trace`), or
    /// `artifact` for rules about the whole artifact.
    pub field: String,
    /// Human-readable reason, safe to return to the caller.
    pub message: String,
    /// Lets the caller pick the status code without matching on text.
    pub kind: ValidationKind,
}

impl ValidationError {
    /// An ordinary refusal of `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into(), kind: ValidationKind::Invalid }
    }

    /// A refusal because the input is over a size limit.
    pub fn oversized(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into(), kind: ValidationKind::TooLarge }
    }

    /// True when the input was refused for its size (HTTP 413), not its content.
    pub fn too_large(&self) -> bool {
        self.kind == ValidationKind::TooLarge
    }

    /// The same refusal, reported at another JSON path.
    fn at(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }
}

/// Size limits applied while parsing; configured per deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Upper bound on the canonical serialized artifact, in bytes.
    pub max_artifact_bytes: usize,
    /// Upper bound on `to` + `cc` of one email.
    pub max_recipients: usize,
    /// Upper bound on the subject, in characters (RFC 5322 line limit).
    pub max_subject_chars: usize,
    /// Upper bound on the number of custom webhook headers.
    pub max_headers: usize,
    /// Upper bound on one webhook header value (and name), in bytes.
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_artifact_bytes: 256 * 1024,
            max_recipients: 50,
            max_subject_chars: 998,
            max_headers: 20,
            max_header_bytes: 1024,
        }
    }
}

/// Splits `local@domain` at its last `@` and checks both parts as the SMTP transport will
/// (RFC 5321/5322 local part; a domain name, an internationalised one once in ASCII, or an
/// IP literal), with the same crates it uses, so an address accepted here is one it sends.
fn check_address(s: &str) -> Result<(&str, &str), &'static str> {
    let (user, domain) = s.rsplit_once('@').ok_or("Missing domain or user")?;
    if !email_address::EmailAddress::is_valid_local_part(user) {
        return Err("Invalid email user");
    }
    let ascii_ok = |d: &str| {
        email_address::EmailAddress::is_valid_domain(d)
            || d.strip_prefix('[').and_then(|ip| ip.strip_suffix(']')).unwrap_or(d).parse::<std::net::IpAddr>().is_ok()
    };
    if !(ascii_ok(domain) || idna::domain_to_ascii(domain).is_ok_and(|d| ascii_ok(&d))) {
        return Err("Invalid email domain");
    }
    Ok((user, domain))
}

/// A bare email address (`local@domain`), checked as the SMTP transport checks it, with its domain
/// lowercased and its local part kept as written (local parts may be case-sensitive).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EmailAddress(String);

impl EmailAddress {
    /// Parses a bare address. Display names (`Bob <bob@example.com>`), whitespace, control
    /// characters and addresses over [`MAX_ADDRESS_BYTES`] are refused; errors name the
    /// field `address` (callers re-path them).
    pub fn parse(s: &str) -> Result<Self, ValidationError> {
        let refuse = |message: String| ValidationError::new("address", message);
        if s.is_empty() {
            return Err(refuse("must not be empty".into()));
        }
        if s.len() > MAX_ADDRESS_BYTES {
            return Err(refuse(format!("is longer than {MAX_ADDRESS_BYTES} bytes")));
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(refuse("must not contain whitespace or control characters".into()));
        }
        airlock_core::text::refuse_format_chars(s).map_err(refuse)?;
        if s.contains(['<', '>']) {
            return Err(refuse("must be a bare address, without a display name or angle brackets".into()));
        }
        let (user, domain) =
            check_address(s).map_err(|e| refuse(format!("{s:?} is not a valid email address ({e})")))?;
        let normalised = format!("{user}@{}", domain.to_lowercase());
        // Lowercasing a non-ASCII domain can change its length; check the stored form too.
        if normalised.len() > MAX_ADDRESS_BYTES {
            return Err(refuse(format!("is longer than {MAX_ADDRESS_BYTES} bytes")));
        }
        check_address(&normalised).map_err(|e| refuse(format!("{s:?} is not a valid email address ({e})")))?;
        Ok(Self(normalised))
    }

    /// The address as stored: local part as written, domain lowercase.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The part before the last `@`, as written.
    pub fn local_part(&self) -> &str {
        self.0.rsplit_once('@').map_or("", |(local, _)| local)
    }

    /// The lowercase domain (the part after the last `@`).
    pub fn domain(&self) -> &str {
        self.0.rsplit_once('@').map_or("", |(_, domain)| domain)
    }

    /// Key under which two addresses count as the same recipient (case-insensitive).
    fn recipient_key(&self) -> String {
        self.0.to_lowercase()
    }
}

impl fmt::Display for EmailAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for EmailAddress {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for EmailAddress {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for EmailAddress {
    type Error = ValidationError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::parse(&s)
    }
}

impl From<EmailAddress> for String {
    fn from(a: EmailAddress) -> Self {
        a.0
    }
}

/// An email to send. Build it with [`Artifact::from_parts`] or [`Artifact::from_json`]:
/// the derived `Deserialize` checks shape and addresses only, not the limits or rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmailArtifact {
    /// Sender; must be a verified sender at send time (see `policy::check_sender`).
    pub from: EmailAddress,
    /// Primary recipients; never empty.
    pub to: Vec<EmailAddress>,
    /// Copied recipients.
    #[serde(default)]
    pub cc: Vec<EmailAddress>,
    /// Subject line: a single line, possibly empty.
    pub subject: String,
    /// Plain-text body.
    #[serde(default)]
    pub text: Option<String>,
    /// HTML body.
    #[serde(default)]
    pub html: Option<String>,
}

impl EmailArtifact {
    /// Every recipient, `to` first then `cc`.
    pub fn recipients(&self) -> impl Iterator<Item = &EmailAddress> {
        self.to.iter().chain(self.cc.iter())
    }
}

/// A webhook call to make: a `POST` of `body` as JSON to `url` with the custom `headers`
/// (airlock adds `Content-Type`, `Idempotency-Key` and `Airlock-Signature`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookArtifact {
    /// Absolute `https://` (or, on loopback in development, `http://`) URL.
    pub url: String,
    /// The JSON document posted; any JSON value.
    pub body: Value,
    /// Custom request headers; names are HTTP tokens, unique ignoring case.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// The kind of effect an artifact describes; mirrors the Postgres enum `channel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::Type)]
#[sqlx(type_name = "channel", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    /// An email sent over SMTP.
    Email,
    /// An HTTP `POST` to an allowlisted origin.
    Webhook,
}

impl Channel {
    /// Every channel.
    pub const ALL: [Self; 2] = [Self::Email, Self::Webhook];

    /// The wire and database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Email => "email",
            Self::Webhook => "webhook",
        }
    }

    /// Inverse of [`Channel::as_str`]; exact, lowercase.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed artifact. Serialized as `{"channel": "email", "email": {…}}` or
/// `{"channel": "webhook", "webhook": {…}}`, the same shape the agent API accepts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "channel", rename_all = "snake_case")]
pub enum Artifact {
    /// An email.
    Email {
        /// The email itself.
        email: EmailArtifact,
    },
    /// A webhook call.
    Webhook {
        /// The call itself.
        webhook: WebhookArtifact,
    },
}

impl Artifact {
    /// Parses the `channel` and `email`/`webhook` members of a request (the caller handles
    /// the request's other members such as `run_id` and `step_id`). The member matching
    /// `channel` must be present and the other absent; a JSON `null` counts as absent.
    pub fn from_parts(
        channel: &str,
        email: Option<&Value>,
        webhook: Option<&Value>,
        limits: &Limits,
    ) -> Result<Self, ValidationError> {
        let channel = Channel::parse(channel)
            .ok_or_else(|| ValidationError::new("channel", r#"must be "email" or "webhook""#))?;
        let email = email.filter(|v| !v.is_null());
        let webhook = webhook.filter(|v| !v.is_null());
        let artifact = match (channel, email, webhook) {
            (Channel::Email, Some(v), None) => Self::Email { email: parse_email(v, limits)? },
            (Channel::Webhook, None, Some(v)) => Self::Webhook { webhook: parse_webhook(v, limits)? },
            (Channel::Email, None, _) => {
                return Err(ValidationError::new("email", r#"is required when channel is "email""#));
            }
            (Channel::Webhook, _, None) => {
                return Err(ValidationError::new("webhook", r#"is required when channel is "webhook""#));
            }
            (Channel::Email, Some(_), Some(_)) => {
                return Err(ValidationError::new("webhook", r#"must be absent when channel is "email""#));
            }
            (Channel::Webhook, Some(_), Some(_)) => {
                return Err(ValidationError::new("email", r#"must be absent when channel is "webhook""#));
            }
        };
        let size = artifact.canonical_bytes().len();
        if size > limits.max_artifact_bytes {
            return Err(ValidationError::oversized(
                "artifact",
                format!("is {size} bytes; at most {} bytes are allowed", limits.max_artifact_bytes),
            ));
        }
        Ok(artifact)
    }

    /// Parses a whole artifact, `{"channel": "email", "email": {…}}`: the form
    /// [`Artifact::to_json`] produces, read back from storage or sent by a reviewer as an
    /// edit. Members other than `channel`, `email` and `webhook` are refused.
    pub fn from_json(v: &Value, limits: &Limits) -> Result<Self, ValidationError> {
        let map = object(v, "artifact")?;
        deny_unknown(map, "", &["channel", "email", "webhook"])?;
        let channel = required_str(map, "", "channel")?;
        Self::from_parts(channel, map.get("email"), map.get("webhook"), limits)
    }

    /// The canonical JSON form: every member present, object keys sorted on output.
    pub fn to_json(&self) -> Value {
        let mut outer = Map::new();
        outer.insert("channel".into(), Value::from(self.channel().as_str()));
        match self {
            Self::Email { email } => {
                let addresses =
                    |list: &[EmailAddress]| -> Value { list.iter().map(|a| Value::from(a.as_str())).collect() };
                let mut inner = Map::new();
                inner.insert("from".into(), Value::from(email.from.as_str()));
                inner.insert("to".into(), addresses(&email.to));
                inner.insert("cc".into(), addresses(&email.cc));
                inner.insert("subject".into(), Value::from(email.subject.as_str()));
                inner.insert("text".into(), email.text.clone().map_or(Value::Null, Value::from));
                inner.insert("html".into(), email.html.clone().map_or(Value::Null, Value::from));
                outer.insert("email".into(), Value::Object(inner));
            }
            Self::Webhook { webhook } => {
                let headers: Map<String, Value> =
                    webhook.headers.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
                let mut inner = Map::new();
                inner.insert("url".into(), Value::from(webhook.url.as_str()));
                inner.insert("body".into(), webhook.body.clone());
                inner.insert("headers".into(), Value::Object(headers));
                outer.insert("webhook".into(), Value::Object(inner));
            }
        }
        Value::Object(outer)
    }

    /// Which channel the artifact goes out on.
    pub fn channel(&self) -> Channel {
        match self {
            Self::Email { .. } => Channel::Email,
            Self::Webhook { .. } => Channel::Webhook,
        }
    }

    /// Canonical bytes: compact JSON of [`Artifact::to_json`] with object keys sorted at
    /// every depth (independently of serde_json's map feature flags). Same artifact, same
    /// bytes; this is what `artifact_sha256` hashes and what is stored.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = String::new();
        write_canonical(&self.to_json(), &mut out);
        out.into_bytes()
    }

    /// Lowercase hex sha256 of [`Artifact::canonical_bytes`]; the content address.
    pub fn sha256_hex(&self) -> String {
        hex::encode(Sha256::digest(self.canonical_bytes()))
    }
}

/// The origin of an absolute http(s) URL, `scheme://host[:port]`, lowercased, with the
/// default port (443 for https, 80 for http) omitted and IPv6 hosts in canonical form.
/// `None` when the URL is not one a webhook artifact may carry.
pub fn origin_of(url: &str) -> Option<String> {
    parse_url(url).ok().map(|u| u.origin())
}

/// URL scheme of a webhook target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Https => "https",
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Self::Http => 80,
            Self::Https => 443,
        }
    }
}

/// The parts of a webhook URL that policy decisions depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UrlParts<'a> {
    pub(crate) scheme: Scheme,
    /// Lowercase host name, dotted IPv4, or bracketed canonical IPv6.
    pub(crate) host: String,
    /// Explicit port, unless it is the scheme's default.
    pub(crate) port: Option<u16>,
    /// Everything after the authority (`/path?query`), possibly empty.
    pub(crate) path_and_query: &'a str,
}

impl UrlParts<'_> {
    /// `scheme://host[:port]`.
    pub(crate) fn origin(&self) -> String {
        match self.port {
            Some(port) => format!("{}://{}:{port}", self.scheme.as_str(), self.host),
            None => format!("{}://{}", self.scheme.as_str(), self.host),
        }
    }
}

/// Parses an absolute http(s) URL strictly. Anything a lenient parser (such as the WHATWG
/// one reqwest uses) could read differently is refused rather than guessed at.
pub(crate) fn parse_url(s: &str) -> Result<UrlParts<'_>, String> {
    if s.chars().count() > MAX_URL_CHARS {
        return Err(format!("is longer than {MAX_URL_CHARS} characters"));
    }
    if !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be printable ASCII without spaces (percent-encode other characters)".into());
    }
    if s.contains('\\') {
        return Err("must not contain a backslash".into());
    }
    if s.contains('#') {
        return Err("must not have a fragment".into());
    }
    let (scheme, rest) = s.split_once("://").ok_or("must be an absolute http:// or https:// URL")?;
    let scheme = if scheme.eq_ignore_ascii_case("https") {
        Scheme::Https
    } else if scheme.eq_ignore_ascii_case("http") {
        Scheme::Http
    } else {
        return Err("must be an absolute http:// or https:// URL".into());
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path_and_query) = rest.split_at(end);
    if authority.contains('@') {
        return Err("must not contain credentials (user:pass@)".into());
    }
    if authority.is_empty() {
        return Err("has no host".into());
    }
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (literal, after) = bracketed.split_once(']').ok_or("has an unterminated IPv6 address")?;
        let ip = Ipv6Addr::from_str(literal).map_err(|_| "has an invalid IPv6 address")?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or("has characters after the IPv6 address")?),
        };
        (format!("[{ip}]"), port)
    } else {
        let (host, port) = match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        };
        (parse_host_name(host)?, port)
    };
    let port = match port {
        None => None,
        Some(p) => {
            let valid = !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit());
            let n = if valid { p.parse::<u16>().ok() } else { None };
            match n {
                Some(0) | None => return Err(format!("has an invalid port {p:?}")),
                Some(n) if n == scheme.default_port() => None,
                Some(n) => Some(n),
            }
        }
    };
    Ok(UrlParts { scheme, host, port, path_and_query })
}

/// A registered name or dotted IPv4 address, lowercased. Numeric shorthands that URL
/// parsers expand (`127.1`, `0x7f.0.0.1`, `2130706433`) are refused.
fn parse_host_name(host: &str) -> Result<String, String> {
    if host.is_empty() {
        return Err("has no host".into());
    }
    if host.len() > 253 {
        return Err("has a host name longer than 253 characters".into());
    }
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_';
    if !host.chars().all(ok_char) {
        return Err(format!("has an invalid host {host:?}"));
    }
    if host.split('.').any(str::is_empty) {
        return Err(format!("has an empty label in host {host:?}"));
    }
    let last = host.rsplit('.').next().unwrap_or(host);
    let numeric = last.bytes().all(|b| b.is_ascii_digit()) || (last.len() > 2 && last[..2].eq_ignore_ascii_case("0x"));
    if numeric && Ipv4Addr::from_str(host).is_err() {
        return Err(format!("has an ambiguous numeric host {host:?}; use a dotted IPv4 address"));
    }
    Ok(host.to_ascii_lowercase())
}

fn parse_email(v: &Value, limits: &Limits) -> Result<EmailArtifact, ValidationError> {
    let map = object(v, "email")?;
    deny_unknown(map, "email", &["from", "to", "cc", "subject", "text", "html"])?;

    let from = EmailAddress::parse(required_str(map, "email", "from")?).map_err(|e| e.at("email.from"))?;
    let to = address_list(map, "to", true)?;
    let cc = address_list(map, "cc", false)?;
    if to.is_empty() {
        return Err(ValidationError::new("email.to", "must name at least one recipient"));
    }
    let count = to.len() + cc.len();
    if count > limits.max_recipients {
        return Err(ValidationError::new(
            "email",
            format!("has {count} recipients; at most {} are allowed", limits.max_recipients),
        ));
    }
    let mut seen = BTreeSet::new();
    let paths = (0..to.len()).map(|i| format!("email.to[{i}]"));
    let paths = paths.chain((0..cc.len()).map(|i| format!("email.cc[{i}]")));
    for (address, path) in to.iter().chain(cc.iter()).zip(paths) {
        if !seen.insert(address.recipient_key()) {
            return Err(ValidationError::new(path, format!("{address} is listed more than once")));
        }
    }

    let subject = required_str(map, "email", "subject")?;
    let chars = subject.chars().count();
    if chars > limits.max_subject_chars {
        return Err(ValidationError::new(
            "email.subject",
            format!("is {chars} characters; at most {} are allowed", limits.max_subject_chars),
        ));
    }
    if subject.contains(['\r', '\n']) {
        return Err(ValidationError::new("email.subject", "must not contain line breaks"));
    }
    if subject.chars().any(|c| c.is_control() && c != '\t') {
        return Err(ValidationError::new("email.subject", "must not contain control characters"));
    }
    // What the reviewer reads is what is sent: nothing invisible, nothing reordered.
    airlock_core::text::refuse_format_chars(subject).map_err(|e| ValidationError::new("email.subject", e))?;

    let text = optional_str(map, "email", "text")?;
    let html = optional_str(map, "email", "html")?;
    let has_body = |b: Option<&str>| b.is_some_and(|b| !b.trim().is_empty());
    if !has_body(text) && !has_body(html) {
        return Err(ValidationError::new("email", "needs a non-empty text or html body"));
    }

    Ok(EmailArtifact {
        from,
        to,
        cc,
        subject: subject.to_owned(),
        text: text.map(str::to_owned),
        html: html.map(str::to_owned),
    })
}

fn address_list(map: &Map<String, Value>, key: &str, required: bool) -> Result<Vec<EmailAddress>, ValidationError> {
    let path = format!("email.{key}");
    let items = match present(map, key) {
        None if required => return Err(ValidationError::new(path, "is required")),
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ValidationError::new(
                path,
                format!("must be an array of addresses, found {}", type_name(other)),
            ));
        }
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let item_path = format!("{path}[{i}]");
            match item {
                Value::String(s) => EmailAddress::parse(s).map_err(|e| e.at(item_path)),
                other => Err(ValidationError::new(item_path, format!("must be a string, found {}", type_name(other)))),
            }
        })
        .collect()
}

fn parse_webhook(v: &Value, limits: &Limits) -> Result<WebhookArtifact, ValidationError> {
    let map = object(v, "webhook")?;
    deny_unknown(map, "webhook", &["url", "body", "headers"])?;

    let url = required_str(map, "webhook", "url")?;
    parse_url(url).map_err(|m| ValidationError::new("webhook.url", m))?;

    // `null` is a valid body (any JSON), so only a missing member is refused here.
    let body = map.get("body").ok_or_else(|| ValidationError::new("webhook.body", "is required"))?;

    let headers = match present(map, "headers") {
        None => BTreeMap::new(),
        Some(Value::Object(h)) => parse_headers(h, limits)?,
        Some(other) => {
            return Err(ValidationError::new(
                "webhook.headers",
                format!("must be an object of strings, found {}", type_name(other)),
            ));
        }
    };

    Ok(WebhookArtifact { url: url.to_owned(), body: body.clone(), headers })
}

fn parse_headers(h: &Map<String, Value>, limits: &Limits) -> Result<BTreeMap<String, String>, ValidationError> {
    if h.len() > limits.max_headers {
        return Err(ValidationError::new(
            "webhook.headers",
            format!("has {} headers; at most {} are allowed", h.len(), limits.max_headers),
        ));
    }
    let mut seen = BTreeSet::new();
    let mut out = BTreeMap::new();
    for (name, value) in h {
        let path = format!("webhook.headers.{name}");
        if name.is_empty() || !name.bytes().all(is_tchar) {
            return Err(ValidationError::new(path, "header name must be an HTTP token"));
        }
        if name.len() > limits.max_header_bytes {
            return Err(ValidationError::new(
                path,
                format!("header name is longer than {} bytes", limits.max_header_bytes),
            ));
        }
        let lower = name.to_ascii_lowercase();
        if RESERVED_HEADERS.contains(&lower.as_str()) {
            return Err(ValidationError::new(path, "is set by airlock and may not be given"));
        }
        if !seen.insert(lower) {
            return Err(ValidationError::new(path, "is given more than once (ignoring case)"));
        }
        let Value::String(value) = value else {
            return Err(ValidationError::new(path, format!("must be a string, found {}", type_name(value))));
        };
        if value.contains(['\r', '\n']) {
            return Err(ValidationError::new(path, "must not contain line breaks"));
        }
        if !value.bytes().all(|b| b == b'\t' || b == b' ' || b.is_ascii_graphic()) {
            return Err(ValidationError::new(path, "must be printable ASCII"));
        }
        if value.len() > limits.max_header_bytes {
            return Err(ValidationError::new(path, format!("is longer than {} bytes", limits.max_header_bytes)));
        }
        out.insert(name.clone(), value.clone());
    }
    Ok(out)
}

/// RFC 7230 `tchar`: the characters of a header name.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() { key.to_owned() } else { format!("{parent}.{key}") }
}

fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, ValidationError> {
    v.as_object().ok_or_else(|| ValidationError::new(path, format!("must be an object, found {}", type_name(v))))
}

fn deny_unknown(map: &Map<String, Value>, path: &str, known: &[&str]) -> Result<(), ValidationError> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ValidationError::new(join(path, k), "unknown field")),
        None => Ok(()),
    }
}

/// A member, with JSON `null` read as absent.
fn present<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

fn required_str<'a>(map: &'a Map<String, Value>, path: &str, key: &str) -> Result<&'a str, ValidationError> {
    optional_str(map, path, key)?.ok_or_else(|| ValidationError::new(join(path, key), "is required"))
}

fn optional_str<'a>(map: &'a Map<String, Value>, path: &str, key: &str) -> Result<Option<&'a str>, ValidationError> {
    match present(map, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => {
            Err(ValidationError::new(join(path, key), format!("must be a string, found {}", type_name(other))))
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The canonical form of a JSON value: compact, object keys sorted at every depth. The
/// artifact hash is the sha256 of it, and so is a tool call's `arguments_sha256`.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

/// Lowercase hex sha256 of [`canonical_json`].
pub fn canonical_sha256(v: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(v).as_bytes()))
}

/// Compact JSON with object keys sorted at every depth.
fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(k.as_str()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn limits() -> Limits {
        Limits::default()
    }

    fn email_json() -> Value {
        json!({
            "from": "agent@example.com",
            "to": ["a@example.org"],
            "cc": [],
            "subject": "Hello",
            "text": "Hi there",
            "html": null
        })
    }

    fn email(v: Value) -> Result<Artifact, ValidationError> {
        Artifact::from_parts("email", Some(&v), None, &limits())
    }

    fn webhook(v: Value) -> Result<Artifact, ValidationError> {
        Artifact::from_parts("webhook", None, Some(&v), &limits())
    }

    fn field_of(r: Result<Artifact, ValidationError>) -> String {
        r.unwrap_err().field
    }

    fn with(mut base: Value, key: &str, value: Value) -> Value {
        base.as_object_mut().unwrap().insert(key.into(), value);
        base
    }

    fn hook(url: &str) -> Value {
        json!({"url": url, "body": {"a": 1}})
    }

    #[test]
    fn address_parsing() {
        let a = EmailAddress::parse("Bob.Smith@Example.COM").unwrap();
        assert_eq!(a.as_str(), "Bob.Smith@example.com");
        assert_eq!(a.domain(), "example.com");
        assert_eq!(a.local_part(), "Bob.Smith");
        for bad in [
            "",
            "Bob <bob@example.com>",
            "<bob@example.com>",
            "bob @example.com",
            "bob@example.com\n",
            "bob",
            "@example.com",
            "bob@",
            "a@b@",
        ] {
            let e = EmailAddress::parse(bad).unwrap_err();
            assert_eq!(e.field, "address", "{bad:?}");
            assert!(!e.too_large());
        }
        let long = format!("{}@example.com", "a".repeat(250));
        assert!(EmailAddress::parse(&long).is_err());
    }

    #[test]
    fn address_serde_goes_through_parse() {
        let a: EmailAddress = serde_json::from_value(json!("x@EXAMPLE.org")).unwrap();
        assert_eq!(a.as_str(), "x@example.org");
        assert_eq!(serde_json::to_value(&a).unwrap(), json!("x@example.org"));
        assert!(serde_json::from_value::<EmailAddress>(json!("Bob <x@example.org>")).is_err());
    }

    #[test]
    fn valid_email_round_trips() {
        let a = email(email_json()).unwrap();
        assert_eq!(a.channel(), Channel::Email);
        let stored = a.to_json();
        assert_eq!(
            stored,
            json!({"channel": "email", "email": {
                "from": "agent@example.com", "to": ["a@example.org"], "cc": [],
                "subject": "Hello", "text": "Hi there", "html": null}})
        );
        assert_eq!(Artifact::from_json(&stored, &limits()).unwrap(), a);
        // The derived serde form is the canonical form.
        assert_eq!(serde_json::to_value(&a).unwrap(), stored);
        assert_eq!(serde_json::from_value::<Artifact>(stored).unwrap(), a);
    }

    #[test]
    fn canonical_bytes_are_sorted_and_stable() {
        let a = email(email_json()).unwrap();
        let bytes = String::from_utf8(a.canonical_bytes()).unwrap();
        assert_eq!(
            bytes,
            r#"{"channel":"email","email":{"cc":[],"from":"agent@example.com","html":null,"subject":"Hello","text":"Hi there","to":["a@example.org"]}}"#
        );
        // Defaults spelled out or omitted, and domain case, do not change the hash.
        let sparse = json!({"from": "agent@EXAMPLE.com", "to": ["a@example.org"],
                            "subject": "Hello", "text": "Hi there"});
        let b = email(sparse).unwrap();
        assert_eq!(a.sha256_hex(), b.sha256_hex());
        assert_eq!(a.sha256_hex().len(), 64);
        assert!(a.sha256_hex().bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
        let c = email(with(email_json(), "subject", json!("Hello!"))).unwrap();
        assert_ne!(a.sha256_hex(), c.sha256_hex());
    }

    #[test]
    fn canonical_writer_matches_serde_for_nested_values() {
        let body = json!({"z": [1, {"b": "\u{1}\"", "a": null}], "a": 1.5, "m": true});
        let a = webhook(json!({"url": "https://h.example", "body": body})).unwrap();
        let expected = serde_json::to_vec(&a.to_json()).unwrap();
        assert_eq!(a.canonical_bytes(), expected);
    }

    #[test]
    fn email_structure_errors_name_the_path() {
        assert_eq!(field_of(email(with(email_json(), "bcc", json!([])))), "email.bcc");
        assert_eq!(field_of(email(with(email_json(), "to", json!("a@example.org")))), "email.to");
        assert_eq!(field_of(email(with(email_json(), "to", json!(["a@example.org", 3])))), "email.to[1]");
        assert_eq!(field_of(email(with(email_json(), "to", json!(["a@example.org", "nope"])))), "email.to[1]");
        assert_eq!(field_of(email(with(email_json(), "cc", json!(["x"])))), "email.cc[0]");
        assert_eq!(field_of(email(with(email_json(), "from", json!("B <b@x.org>")))), "email.from");
        assert_eq!(field_of(email(with(email_json(), "subject", json!(1)))), "email.subject");
        assert_eq!(field_of(email(with(email_json(), "text", json!(["x"])))), "email.text");
        let mut missing = email_json();
        missing.as_object_mut().unwrap().remove("subject");
        assert_eq!(field_of(email(missing)), "email.subject");
        assert_eq!(field_of(email(json!("not an object"))), "email");
    }

    #[test]
    fn email_rules() {
        assert_eq!(field_of(email(with(email_json(), "to", json!([])))), "email.to");
        let dup = with(email_json(), "cc", json!(["A@Example.org"]));
        let e = email(dup).unwrap_err();
        assert_eq!(e.field, "email.cc[0]");
        assert!(e.message.contains("more than once"));

        let many: Vec<String> = (0..51).map(|i| format!("r{i}@example.org")).collect();
        assert_eq!(field_of(email(with(email_json(), "to", json!(many)))), "email");
        let fifty: Vec<String> = (0..50).map(|i| format!("r{i}@example.org")).collect();
        assert!(email(with(email_json(), "to", json!(fifty))).is_ok());

        for bad in ["Hi\r\nBcc: x@evil.org", "Hi\nthere", "nul\u{0}"] {
            assert_eq!(field_of(email(with(email_json(), "subject", json!(bad)))), "email.subject");
        }
        for bad in ["Invoice \u{202E}fdp.exe", "Pay\u{200B}Pal", "\u{2066}isolated\u{2069}", "soft\u{00AD}hyphen"] {
            let e = email(with(email_json(), "subject", json!(bad))).unwrap_err();
            assert_eq!(e.field, "email.subject");
            assert!(e.message.contains("format characters"), "{}", e.message);
        }
        assert!(email(with(email_json(), "to", json!(["bob\u{200B}@example.org"]))).is_err());
        assert!(email(with(email_json(), "subject", json!("a\tb"))).is_ok());
        assert!(email(with(email_json(), "subject", json!(""))).is_ok());
        assert!(email(with(email_json(), "subject", json!("é".repeat(998)))).is_ok());
        assert_eq!(field_of(email(with(email_json(), "subject", json!("x".repeat(999))))), "email.subject");

        let no_body = with(with(email_json(), "text", json!("  ")), "html", json!(null));
        assert_eq!(field_of(email(no_body)), "email");
        let html_only = with(with(email_json(), "text", json!(null)), "html", json!("<p>x</p>"));
        assert!(email(html_only).is_ok());
    }

    #[test]
    fn oversized_artifact_is_flagged() {
        let small = Limits { max_artifact_bytes: 200, ..Limits::default() };
        let big = with(email_json(), "text", json!("x".repeat(300)));
        let e = Artifact::from_parts("email", Some(&big), None, &small).unwrap_err();
        assert_eq!(e.field, "artifact");
        assert!(e.too_large());
        assert!(e.message.contains("200"));
        assert!(Artifact::from_parts("email", Some(&email_json()), None, &small).is_ok());
    }

    #[test]
    fn channel_and_members() {
        let e = Artifact::from_parts("sms", Some(&email_json()), None, &limits()).unwrap_err();
        assert_eq!(e.field, "channel");
        let e = Artifact::from_parts("email", None, None, &limits()).unwrap_err();
        assert_eq!(e.field, "email");
        let e = Artifact::from_parts("email", Some(&email_json()), Some(&hook("https://h.io")), &limits()).unwrap_err();
        assert_eq!(e.field, "webhook");
        let e = Artifact::from_parts("webhook", Some(&email_json()), None, &limits()).unwrap_err();
        assert_eq!(e.field, "webhook");
        let e =
            Artifact::from_parts("webhook", Some(&email_json()), Some(&hook("https://h.io")), &limits()).unwrap_err();
        assert_eq!(e.field, "email");
        // An explicit null counts as absent.
        assert!(Artifact::from_parts("email", Some(&email_json()), Some(&Value::Null), &limits()).is_ok());
        assert_eq!(Channel::parse("webhook"), Some(Channel::Webhook));
        assert_eq!(Channel::parse("Email"), None);
        for c in Channel::ALL {
            assert_eq!(Channel::parse(c.as_str()), Some(c));
        }
    }

    #[test]
    fn from_json_is_strict() {
        let stored = json!({"channel": "email", "email": email_json(), "run_id": "x"});
        assert_eq!(Artifact::from_json(&stored, &limits()).unwrap_err().field, "run_id");
        let e = Artifact::from_json(&json!({"email": email_json()}), &limits()).unwrap_err();
        assert_eq!(e.field, "channel");
        let e = Artifact::from_json(&json!([]), &limits()).unwrap_err();
        assert_eq!(e.field, "artifact");
    }

    #[test]
    fn valid_webhook_round_trips() {
        let v = json!({"url": "https://hooks.example.com/a?b=c", "body": {"k": [1, 2]},
                       "headers": {"X-Trace": "abc 123"}});
        let a = webhook(v).unwrap();
        assert_eq!(a.channel(), Channel::Webhook);
        let stored = a.to_json();
        assert_eq!(stored["webhook"]["headers"], json!({"X-Trace": "abc 123"}));
        assert_eq!(Artifact::from_json(&stored, &limits()).unwrap(), a);
        assert_eq!(serde_json::to_value(&a).unwrap(), stored);
        // Headers default to {} and a null body is still a body.
        let b = webhook(json!({"url": "https://h.example", "body": null})).unwrap();
        assert_eq!(b.to_json()["webhook"]["headers"], json!({}));
        assert_eq!(field_of(webhook(json!({"url": "https://h.example"}))), "webhook.body");
        assert_eq!(field_of(webhook(with(hook("https://h.io"), "method", json!("GET")))), "webhook.method");
        assert_eq!(field_of(webhook(json!({"url": 5, "body": 1}))), "webhook.url");
    }

    #[test]
    fn webhook_urls() {
        for good in [
            "https://hooks.example.com",
            "https://hooks.example.com/",
            "http://localhost:8080/hook",
            "https://10.0.0.1:8443/x?y=z&w=%20",
            "https://[::1]:9000/x",
            "HTTPS://Hooks.Example.COM/Path",
        ] {
            assert!(webhook(hook(good)).is_ok(), "{good}");
        }
        for bad in [
            "ftp://example.com/",
            "example.com/path",
            "https:example.com",
            "https://",
            "https:///path",
            "https://user:pass@example.com/",
            "https://good.example@evil.example/",
            "https://example.com/#frag",
            "https://example.com/a b",
            "https://exa mple.com/",
            "https://example.com\\@evil.example/",
            "https://évil.example/",
            "https://example.com:0/",
            "https://example.com:99999/",
            "https://example.com:/",
            "https://example.com:80a/",
            "https://ex%61mple.com/",
            "https://127.1/",
            "https://2130706433/",
            "https://0x7f.0.0.1/",
            "https://[::1/",
            "https://[fe80::1%25eth0]/",
            "https://a..b/",
            "https://.a/",
        ] {
            assert_eq!(field_of(webhook(hook(bad))), "webhook.url", "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(2048));
        assert_eq!(field_of(webhook(hook(&long))), "webhook.url");
    }

    #[test]
    fn origins() {
        assert_eq!(origin_of("https://Hooks.Example.com/a").as_deref(), Some("https://hooks.example.com"));
        assert_eq!(origin_of("https://h.example:443/").as_deref(), Some("https://h.example"));
        assert_eq!(origin_of("https://h.example:0443").as_deref(), Some("https://h.example"));
        assert_eq!(origin_of("https://h.example:8443?q").as_deref(), Some("https://h.example:8443"));
        assert_eq!(origin_of("http://h.example:80/x").as_deref(), Some("http://h.example"));
        assert_eq!(origin_of("http://h.example:443/x").as_deref(), Some("http://h.example:443"));
        assert_eq!(origin_of("http://[0:0:0:0:0:0:0:1]:8080/").as_deref(), Some("http://[::1]:8080"));
        assert_eq!(origin_of("https://u@h.example/"), None);
        assert_eq!(origin_of("mailto:x@example.com"), None);
    }

    #[test]
    fn webhook_headers() {
        let h = |headers: Value| webhook(with(hook("https://h.example"), "headers", headers));
        assert!(h(json!({"X-Trace": "a b\tc", "Authorization": "Bearer x"})).is_ok());
        assert_eq!(field_of(h(json!({"Bad Name": "x"}))), "webhook.headers.Bad Name");
        assert_eq!(field_of(h(json!({"": "x"}))), "webhook.headers.");
        assert_eq!(field_of(h(json!({"X-A": "a\r\nX-B: b"}))), "webhook.headers.X-A");
        assert_eq!(field_of(h(json!({"X-A": "é"}))), "webhook.headers.X-A");
        assert_eq!(field_of(h(json!({"X-A": 1}))), "webhook.headers.X-A");
        assert_eq!(field_of(h(json!({"X-A": "x".repeat(1025)}))), "webhook.headers.X-A");
        assert_eq!(field_of(h(json!(["X-A"]))), "webhook.headers");
        for reserved in [
            "Host",
            "content-length",
            "Content-Type",
            "IDEMPOTENCY-KEY",
            "Airlock-Signature",
            "Transfer-Encoding",
            "Connection",
        ] {
            let e = h(json!({ reserved: "x" })).unwrap_err();
            assert_eq!(e.field, format!("webhook.headers.{reserved}"));
        }
        assert!(h(json!({"X-A": "1", "x-a": "2"})).is_err());
        let many: Map<String, Value> = (0..21).map(|i| (format!("X-{i}"), json!("v"))).collect();
        assert_eq!(field_of(h(Value::Object(many))), "webhook.headers");
        let twenty: Map<String, Value> = (0..20).map(|i| (format!("X-{i}"), json!("v"))).collect();
        assert!(h(Value::Object(twenty)).is_ok());
    }
}
