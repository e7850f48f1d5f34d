//! Sending email over SMTP, one phase at a time, so that every failure is classified by
//! *when* it happened:
//!
//! - anything before the message body is on the wire (connect, TLS, EHLO, AUTH, MAIL, RCPT,
//!   DATA) → the message was certainly not delivered: retry (4xx, network) or fail (5xx);
//! - a reply to the body → delivered (2xx), refused for now (4xx) or for good (5xx);
//! - the connection lost or timed out after the body was sent, before the reply →
//!   *ambiguous*: the relay may have queued it. Never retried; parked for a human.
//!
//! TLS is required by default (STARTTLS must be offered, or implicit TLS) and certificates
//! are verified against the system roots plus an optional CA file. Plaintext is refused
//! unless the host is loopback and `smtp.allow_plaintext_loopback` is set.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lettre::address::Envelope;
use lettre::message::{Mailbox, Message, MultiPart, SinglePart, header};
use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{AsyncSmtpConnection, Certificate, TlsParameters};
use lettre::transport::smtp::commands::{Data, Mail, Rcpt};
use lettre::transport::smtp::extension::ClientId;

use crate::EffectOutcome;
use airlock_core::config::{SmtpConfig, SmtpTls, is_loopback_host};
use airlock_core::secret;
use airlock_core::sync::lock;
use airlock_delivery::artifact::EmailArtifact;

#[derive(Debug, thiserror::Error)]
pub enum SmtpSetupError {
    #[error("smtp.tls = none is only allowed to a loopback host with smtp.allow_plaintext_loopback = true")]
    PlaintextRefused,
    #[error("smtp.ca_file: {0}")]
    CaFile(String),
    #[error("smtp TLS parameters: {0}")]
    Tls(String),
    #[error("smtp credentials: {0}")]
    Credentials(String),
}

/// A configured SMTP client. Cheap to clone (clones share their open connections).
///
/// A connection whose last message was accepted is kept open for the next one (up to
/// `smtp.max_idle_connections`, for `smtp.idle_timeout_seconds`): a message then costs no
/// TCP or TLS handshake. Before reuse it must answer a NOOP; one that does not is dropped
/// and the next is tried, or a new one opened. Any other outcome closes the connection.
#[derive(Clone)]
pub struct SmtpSender {
    host: String,
    port: u16,
    mode: SmtpTls,
    tls: Option<TlsParameters>,
    credentials: Option<Credentials>,
    hello: ClientId,
    timeout: Duration,
    max_idle: usize,
    idle_timeout: Duration,
    idle: Arc<Mutex<Vec<(AsyncSmtpConnection, Instant)>>>,
}

impl std::fmt::Debug for SmtpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmtpSender")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("mode", &self.mode)
            .finish()
    }
}

impl SmtpSender {
    pub fn from_config(cfg: &SmtpConfig) -> Result<Self, SmtpSetupError> {
        let tls = match cfg.tls {
            SmtpTls::None => {
                if !cfg.allow_plaintext_loopback || !is_loopback_host(&cfg.host) {
                    return Err(SmtpSetupError::PlaintextRefused);
                }
                None
            }
            SmtpTls::Required | SmtpTls::Wrapper => {
                let mut b = TlsParameters::builder(cfg.host.clone());
                if let Some(path) = cfg.ca_file.as_deref().filter(|p| !p.is_empty()) {
                    let pem = std::fs::read(path).map_err(|e| SmtpSetupError::CaFile(format!("{path}: {e}")))?;
                    let cert =
                        Certificate::from_pem(&pem).map_err(|e| SmtpSetupError::CaFile(format!("{path}: {e}")))?;
                    b = b.add_root_certificate(cert);
                }
                Some(b.build_rustls().map_err(|e| SmtpSetupError::Tls(e.to_string()))?)
            }
        };
        let credentials = match (&cfg.username_env, &cfg.password_env) {
            (Some(u), Some(p)) => {
                let user = secret::from_env(u).ok_or_else(|| SmtpSetupError::Credentials(format!("{u} is not set")))?;
                let pass = secret::from_env(p).ok_or_else(|| SmtpSetupError::Credentials(format!("{p} is not set")))?;
                Some(Credentials::new(user.expose().to_string(), pass.expose().to_string()))
            }
            (None, None) => None,
            _ => {
                return Err(SmtpSetupError::Credentials(
                    "set both smtp.username_env and smtp.password_env, or neither".into(),
                ));
            }
        };
        let hello = match &cfg.helo_name {
            Some(n) => ClientId::Domain(n.clone()),
            None => ClientId::default(),
        };
        Ok(Self {
            host: cfg.host.clone(),
            port: cfg.port,
            mode: cfg.tls,
            tls,
            credentials,
            hello,
            timeout: Duration::from_secs(cfg.timeout_seconds.max(1)),
            max_idle: cfg.max_idle_connections,
            idle_timeout: Duration::from_secs(cfg.idle_timeout_seconds),
            idle: Arc::default(),
        })
    }

    /// Sends one formatted message and classifies the result.
    pub async fn send(&self, envelope: &Envelope, message: &[u8]) -> EffectOutcome {
        let mut conn = match self.reuse().await {
            Some(c) => c,
            None => match self.open().await {
                Ok(c) => c,
                Err(e) => return e,
            },
        };
        let result = self.transact(&mut conn, envelope, message).await;
        let to_close = match result {
            EffectOutcome::Sent { .. } => self.keep(conn),
            // The relay's state is unknown: the connection is dropped, not closed politely.
            EffectOutcome::Ambiguous { .. } => None,
            _ => Some(conn),
        };
        if let Some(mut conn) = to_close {
            let _ = tokio::time::timeout(self.timeout, conn.quit()).await;
        }
        result
    }

    /// Keeps a connection for the next message; gives it back when no more may be kept.
    fn keep(&self, conn: AsyncSmtpConnection) -> Option<AsyncSmtpConnection> {
        let mut idle = lock(&self.idle);
        if idle.len() < self.max_idle {
            idle.push((conn, Instant::now()));
            None
        } else {
            Some(conn)
        }
    }

    /// An open connection that still answers, if one is kept; stale ones are closed.
    async fn reuse(&self) -> Option<AsyncSmtpConnection> {
        loop {
            let (mut conn, since) = lock(&self.idle).pop()?;
            if since.elapsed() < self.idle_timeout
                && tokio::time::timeout(self.timeout, conn.test_connected()).await.unwrap_or(false)
            {
                return Some(conn);
            }
            conn.abort().await;
        }
    }

    async fn open(&self) -> Result<AsyncSmtpConnection, EffectOutcome> {
        let wrapper = match (self.mode, &self.tls) {
            (SmtpTls::Wrapper, Some(t)) => Some(t.clone()),
            _ => None,
        };
        let connect = AsyncSmtpConnection::connect_tokio1(
            (self.host.as_str(), self.port),
            Some(self.timeout),
            &self.hello,
            wrapper,
            None,
        );
        let mut conn = match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(before_body("connect", &e)),
            Err(_) => return Err(not_delivered("connect: timed out")),
        };
        if let (SmtpTls::Required, Some(t)) = (self.mode, &self.tls) {
            if !conn.can_starttls() {
                conn.abort().await;
                return Err(not_delivered("the server does not offer STARTTLS; TLS is required"));
            }
            match tokio::time::timeout(self.timeout, conn.starttls(t.clone(), &self.hello)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(before_body("starttls", &e)),
                Err(_) => return Err(not_delivered("starttls: timed out")),
            }
        }
        if let Some(creds) = &self.credentials {
            let auth = conn.auth(&[Mechanism::Plain, Mechanism::Login], creds);
            match tokio::time::timeout(self.timeout, auth).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(before_body("auth", &e)),
                Err(_) => return Err(not_delivered("auth: timed out")),
            }
        }
        Ok(conn)
    }

    async fn transact(&self, conn: &mut AsyncSmtpConnection, envelope: &Envelope, message: &[u8]) -> EffectOutcome {
        let t = self.timeout;
        let mail = Mail::new(envelope.from().cloned(), vec![]);
        match tokio::time::timeout(t, conn.command(mail)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return before_body("MAIL", &e),
            Err(_) => return not_delivered("MAIL: timed out"),
        }
        for to in envelope.to() {
            match tokio::time::timeout(t, conn.command(Rcpt::new(to.clone(), vec![]))).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return before_body("RCPT", &e),
                Err(_) => return not_delivered("RCPT: timed out"),
            }
        }
        match tokio::time::timeout(t, conn.command(Data)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return before_body("DATA", &e),
            Err(_) => return not_delivered("DATA: timed out"),
        }
        // From here the relay may accept the message at any moment.
        match tokio::time::timeout(t, conn.message(message)).await {
            Ok(Ok(resp)) => EffectOutcome::Sent { message_id: None, response: response_text(&resp) },
            Ok(Err(e)) => match e.status() {
                Some(code) if e.is_transient() => {
                    EffectOutcome::NotDelivered { detail: format!("after body: {code} {e}"), retry_after: None }
                }
                Some(code) if e.is_permanent() => {
                    EffectOutcome::Permanent { detail: format!("after body: {code} {e}") }
                }
                _ => EffectOutcome::Ambiguous { detail: format!("connection lost after the body was sent: {e}") },
            },
            Err(_) => EffectOutcome::Ambiguous { detail: "no reply after the body was sent: timed out".into() },
        }
    }
}

fn response_text(resp: &lettre::transport::smtp::response::Response) -> String {
    let lines: Vec<&str> = resp.message().collect();
    format!("{} {}", resp.code(), lines.join(" "))
}

fn not_delivered(detail: impl Into<String>) -> EffectOutcome {
    EffectOutcome::NotDelivered { detail: detail.into(), retry_after: None }
}

/// A failure before the body was sent: certainly not delivered.
fn before_body(phase: &str, e: &lettre::transport::smtp::Error) -> EffectOutcome {
    if e.is_permanent() {
        EffectOutcome::Permanent { detail: format!("{phase}: {e}") }
    } else {
        not_delivered(format!("{phase}: {e}"))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cannot build the message: {0}")]
pub struct BuildError(String);

/// Builds the RFC 5322 message of an email artifact, with the given Message-ID (which is
/// derived from the delivery's idempotency key).
pub fn build_message(email: &EmailArtifact, message_id: &str) -> Result<(Envelope, Vec<u8>), BuildError> {
    let err = |e: &dyn std::fmt::Display| BuildError(e.to_string());
    let mailbox = |a: &airlock_delivery::artifact::EmailAddress| -> Result<Mailbox, BuildError> {
        a.as_str().parse::<Mailbox>().map_err(|e| err(&e))
    };
    let mut b = Message::builder()
        .from(mailbox(&email.from)?)
        .subject(email.subject.clone())
        .message_id(Some(message_id.to_string()));
    for to in &email.to {
        b = b.to(mailbox(to)?);
    }
    for cc in &email.cc {
        b = b.cc(mailbox(cc)?);
    }
    let text = email.text.clone().filter(|t| !t.is_empty());
    let html = email.html.clone().filter(|t| !t.is_empty());
    let msg = match (text, html) {
        (Some(t), Some(h)) => b.multipart(MultiPart::alternative_plain_html(t, h)),
        (Some(t), None) => b.singlepart(SinglePart::builder().header(header::ContentType::TEXT_PLAIN).body(t)),
        (None, Some(h)) => b.singlepart(SinglePart::builder().header(header::ContentType::TEXT_HTML).body(h)),
        (None, None) => b.singlepart(SinglePart::builder().header(header::ContentType::TEXT_PLAIN).body(String::new())),
    }
    .map_err(|e| err(&e))?;
    Ok((msg.envelope().clone(), msg.formatted()))
}
