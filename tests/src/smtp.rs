//! A real SMTP server for tests, with TLS and per-connection fault injection.
//!
//! [`SmtpServer`] speaks the ESMTP subset a submission client needs (EHLO/HELO, STARTTLS,
//! AUTH PLAIN/LOGIN, MAIL, RCPT, DATA, RSET, NOOP, QUIT), so lettre delivers through it
//! exactly as it would through a production relay. Certificates come from a throwaway
//! [`TestCa`], which clients are told to trust.
//!
//! Each accepted TCP connection takes one [`Fault`] from a queue, or, once the queue is
//! empty, a random fault (when [`SmtpServer::set_random_faults`] is on) or the default
//! fault. A fault fires at most once, at the step it names, which lets a test make the
//! relay refuse, hang up, swallow a message without answering, or hold its answer until
//! the test releases it, and then check what the sender did about it.
//!
//! Invariants tests can rely on:
//! - a message is in [`SmtpServer::accepted`] *before* its positive reply is written, so a
//!   client that has seen `250` always finds it there;
//! - a message that hit [`Fault::DropAfterData`] is in [`SmtpServer::dropped_after_data`]
//!   and never in `accepted`, so "no message accepted twice" stays checkable while the
//!   ambiguous case stays visible;
//! - a message held by [`Fault::HoldAfterData`] is in neither list until
//!   [`SmtpServer::release_held`]; then it is accepted like any other;
//! - random faults are drawn from a seeded generator, so a seed replays the same sequence
//!   of faults for the same sequence of connections;
//! - dropping the server (or calling [`SmtpServer::stop`]) closes the listening socket and
//!   every open connection.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_core::sync::lock;
use anyhow::Context as _;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// The name the server gives itself and the name its certificate is issued for.
const HOSTNAME: &str = "localhost";
/// The text of the `220` greeting.
const GREETING: &str = "localhost ESMTP test";
/// Longest command line accepted (RFC 5321 asks for 512; AUTH responses can be longer).
const MAX_COMMAND_LINE: usize = 4096;
/// Longest line accepted inside DATA (RFC 5321 asks for 1000).
const MAX_DATA_LINE: usize = 1 << 20;
/// Largest message accepted; anything bigger gets 552 and the connection is closed.
const MAX_MESSAGE: usize = 32 << 20;
/// Pause after a failed `accept` (for example EMFILE) so the loop cannot spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

fn install_ring_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A throwaway certificate authority and a server certificate it signed.
///
/// Tests hand [`TestCa::ca_pem`] (or the file from [`TestCa::write_ca_file`]) to the
/// client as its only trust root, so TLS is verified for real instead of being switched
/// off, and a client configured with another CA fails the handshake as it would in
/// production.
pub struct TestCa {
    /// The CA certificate, PEM, for clients that take a root from text or a file.
    ca_pem: String,
    /// The CA certificate, DER, for rustls clients built in-process.
    ca_der: CertificateDer<'static>,
    /// Server side of TLS: the leaf certificate for `localhost`/`127.0.0.1` and its key.
    server_config: Arc<ServerConfig>,
}

impl TestCa {
    /// A fresh CA (CA:TRUE) and a leaf certificate (CA:FALSE) for `localhost` and
    /// `127.0.0.1` signed by it.
    pub fn new() -> anyhow::Result<Self> {
        install_ring_provider();

        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "airlock test CA");
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key).context("self-signing the CA")?;
        let issuer = Issuer::new(ca_params, ca_key);

        let leaf_key = KeyPair::generate().context("generating the server key")?;
        let mut leaf_params = CertificateParams::new(vec![HOSTNAME.to_owned(), "127.0.0.1".to_owned()])?;
        leaf_params.is_ca = IsCa::ExplicitNoCa;
        leaf_params.distinguished_name.push(DnType::CommonName, HOSTNAME);
        leaf_params.use_authority_key_identifier_extension = true;
        leaf_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_cert = leaf_params.signed_by(&leaf_key, &issuer).context("signing the server certificate")?;

        let server_config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf_cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .context("building the TLS server config")?;

        Ok(Self { ca_pem: ca_cert.pem(), ca_der: ca_cert.der().clone(), server_config: Arc::new(server_config) })
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }

    /// The CA certificate, DER, for building a rustls root store directly.
    pub fn ca_der(&self) -> CertificateDer<'static> {
        self.ca_der.clone()
    }

    /// Writes the CA certificate to `dir/ca.pem` and returns that path, for processes
    /// configured with a CA file.
    pub fn write_ca_file(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let path = dir.join("ca.pem");
        std::fs::write(&path, &self.ca_pem).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// The TLS configuration the server presents: the leaf certificate and its key.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server_config)
    }
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// How the server offers TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// Offers STARTTLS and refuses MAIL before TLS with `530` (submission, port 587 style).
    StartTls,
    /// TLS from the first byte (submissions, port 465 style).
    Implicit,
    /// No TLS offered; AUTH is offered in clear.
    Plain,
}

/// What goes wrong on one connection. A fault fires once, at the step it names; the rest
/// of the connection (if it stays open) behaves normally.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing goes wrong.
    None,
    /// Accept TCP, then close before the greeting (before the TLS handshake in
    /// [`TlsMode::Implicit`], where the unread ClientHello makes the close a reset).
    DropOnConnect,
    /// After EHLO (and STARTTLS), close when MAIL FROM arrives, without replying.
    DropBeforeMail,
    /// Reply 250 to RCPT, then close when DATA arrives, without replying.
    DropAfterRcpt,
    /// Receive the whole payload (up to `"\r\n.\r\n"`), then close without replying.
    ///
    /// A real relay in this state may or may not have queued the message, so it is
    /// recorded in [`SmtpServer::dropped_after_data`], never in [`SmtpServer::accepted`].
    DropAfterData,
    /// Reply this code and text to the first MAIL FROM (for example 421, 450, 550). The
    /// connection stays open. A 2xx code starts the transaction as usual.
    ReplyAtMail(u16, String),
    /// Reply this code and text to the first RCPT TO. The connection stays open. A 2xx
    /// code adds the recipient as usual.
    ReplyAtRcpt(u16, String),
    /// After receiving the first payload, reply this instead of 250. The connection stays
    /// open. A 2xx code records the message as accepted.
    ReplyAtDataEnd(u16, String),
    /// Receive the whole payload, then answer nothing until [`SmtpServer::release_held`];
    /// then accept it with 250. It keeps a sender between its effect and its record for as
    /// long as a test needs (see [`SmtpServer::wait_held`]).
    HoldAfterData,
}

/// The protocol step at which a fault fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FaultPoint {
    Mail,
    Rcpt,
    Data,
    DataEnd,
}

impl Fault {
    fn point(&self) -> Option<FaultPoint> {
        match self {
            Fault::None | Fault::DropOnConnect => None,
            Fault::DropBeforeMail | Fault::ReplyAtMail(..) => Some(FaultPoint::Mail),
            Fault::ReplyAtRcpt(..) => Some(FaultPoint::Rcpt),
            Fault::DropAfterRcpt => Some(FaultPoint::Data),
            Fault::DropAfterData | Fault::ReplyAtDataEnd(..) | Fault::HoldAfterData => Some(FaultPoint::DataEnd),
        }
    }

    /// A short stable name, for counting faults by kind.
    pub fn label(&self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::DropOnConnect => "drop_on_connect",
            Fault::DropBeforeMail => "drop_before_mail",
            Fault::DropAfterRcpt => "drop_after_rcpt",
            Fault::DropAfterData => "drop_after_data",
            Fault::ReplyAtMail(..) => "reply_at_mail",
            Fault::ReplyAtRcpt(..) => "reply_at_rcpt",
            Fault::ReplyAtDataEnd(..) => "reply_at_data_end",
            Fault::HoldAfterData => "hold_after_data",
        }
    }
}

/// The faults [`SmtpServer::set_random_faults`] draws from, equally likely: a dropped
/// connection at every phase (on connect, before MAIL, after RCPT, after the payload),
/// a transient refusal at every phase (421 at MAIL, 450 at RCPT, 451 after the payload),
/// and a permanent refusal (550 at RCPT).
pub fn random_fault_menu() -> Vec<Fault> {
    vec![
        Fault::DropOnConnect,
        Fault::DropBeforeMail,
        Fault::DropAfterRcpt,
        Fault::DropAfterData,
        Fault::ReplyAtMail(421, "4.3.2 Service not available, closing channel".into()),
        Fault::ReplyAtRcpt(450, "4.2.1 Mailbox busy, try again later".into()),
        Fault::ReplyAtDataEnd(451, "4.3.0 Local error in processing".into()),
        Fault::ReplyAtRcpt(550, "5.1.1 No such user".into()),
    ]
}

/// Seeded random faults: each connection gets one with probability `p`.
struct RandomFaults {
    p: f64,
    /// splitmix64 state: tiny, seedable, and good enough to pick faults.
    state: u64,
    menu: Vec<Fault>,
}

impl RandomFaults {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn draw(&mut self) -> Option<Fault> {
        let roll = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        if self.menu.is_empty() || roll >= self.p {
            return None;
        }
        let i = (self.next_u64() % self.menu.len() as u64) as usize;
        Some(self.menu[i].clone())
    }
}

/// How to start an [`SmtpServer`].
#[derive(Clone, Debug)]
pub struct SmtpOptions {
    /// How TLS is offered.
    pub tls: TlsMode,
    /// The CA whose certificate the server presents; required unless `tls` is
    /// [`TlsMode::Plain`].
    pub ca: Option<Arc<TestCa>>,
    /// The fault for connections that find the fault queue empty.
    pub default_fault: Fault,
    /// How long the server takes to answer a message's end, as a relay that queues it
    /// durably does (zero: at once).
    pub data_end_delay: Duration,
}

impl SmtpOptions {
    /// STARTTLS with certificates from `ca`, no default fault.
    pub fn starttls(ca: Arc<TestCa>) -> Self {
        Self { tls: TlsMode::StartTls, ca: Some(ca), default_fault: Fault::None, data_end_delay: Duration::ZERO }
    }

    /// Implicit TLS with certificates from `ca`, no default fault.
    pub fn implicit(ca: Arc<TestCa>) -> Self {
        Self { tls: TlsMode::Implicit, ca: Some(ca), default_fault: Fault::None, data_end_delay: Duration::ZERO }
    }

    /// No TLS, no default fault.
    pub fn plain() -> Self {
        Self { tls: TlsMode::Plain, ca: None, default_fault: Fault::None, data_end_delay: Duration::ZERO }
    }
}

/// One message as the server received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// The reverse path from MAIL FROM, without `<>` (empty for the null sender).
    pub mail_from: String,
    /// The forward paths from RCPT TO, without `<>`, in order.
    pub rcpt_to: Vec<String>,
    /// The payload with dot-stuffing removed and line endings as sent; the terminating
    /// `.` line is not included.
    pub data: Vec<u8>,
    /// The Message-ID header value without `<>` (header name matched case-insensitively,
    /// folded lines unfolded), if the message has one.
    pub message_id: Option<String>,
    /// Whether the message arrived over TLS.
    pub tls: bool,
    /// The user name from AUTH, if the client authenticated.
    pub auth_user: Option<String>,
}

/// TLS as the connection handler needs it.
enum Security {
    Plain,
    StartTls(TlsAcceptor),
    Implicit(TlsAcceptor),
}

/// State shared by the accept loop, every connection and the test.
struct Shared {
    security: Security,
    /// Faults for the next connections, one each, in order.
    faults: Mutex<VecDeque<Fault>>,
    /// Fault for connections that find `faults` empty.
    default_fault: Mutex<Fault>,
    /// See [`SmtpOptions::data_end_delay`].
    data_end_delay: Duration,
    /// When set, connections that find `faults` empty draw from it before the default.
    random: Mutex<Option<RandomFaults>>,
    /// Faults handed to connections, by [`Fault::label`] (`none` excluded).
    drawn: Mutex<HashMap<&'static str, usize>>,
    /// Messages waiting in [`Fault::HoldAfterData`], so a test can wait for them.
    held: watch::Sender<usize>,
    /// Bumped by [`SmtpServer::release_held`]; a held message goes on once it moves.
    release: watch::Sender<u64>,
    accepted: Mutex<Vec<Received>>,
    dropped_after_data: Mutex<Vec<Received>>,
    connections: AtomicUsize,
    /// Number of accepted messages, so `wait_for` can wait without polling.
    accepted_count: watch::Sender<usize>,
}

impl Shared {
    fn next_fault(&self) -> Fault {
        let queued = lock(&self.faults).pop_front();
        let random = || lock(&self.random).as_mut().and_then(RandomFaults::draw);
        let fault = queued.or_else(random).unwrap_or_else(|| lock(&self.default_fault).clone());
        if fault != Fault::None {
            *lock(&self.drawn).entry(fault.label()).or_insert(0) += 1;
        }
        fault
    }

    /// Waits until [`SmtpServer::release_held`] is called after this point.
    async fn hold(&self) {
        let mut release = self.release.subscribe();
        self.held.send_modify(|n| *n += 1);
        let _ = release.changed().await;
        self.held.send_modify(|n| *n -= 1);
    }

    fn record_accepted(&self, received: Received) {
        let count = {
            let mut accepted = lock(&self.accepted);
            accepted.push(received);
            accepted.len()
        };
        self.accepted_count.send_replace(count);
    }

    fn record_dropped_after_data(&self, received: Received) {
        lock(&self.dropped_after_data).push(received);
    }
}

/// An SMTP server on `127.0.0.1` with an ephemeral port, running until dropped.
pub struct SmtpServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// Stops the accept loop and closes every open connection.
    shutdown: CancellationToken,
}

impl SmtpServer {
    /// Binds `127.0.0.1:0` and starts accepting connections.
    pub async fn start(opts: SmtpOptions) -> anyhow::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), opts).await
    }

    /// Binds `addr` (a development sink uses a fixed loopback port) and starts accepting.
    pub async fn start_on(addr: SocketAddr, opts: SmtpOptions) -> anyhow::Result<Self> {
        install_ring_provider();
        let security = match (opts.tls, opts.ca) {
            (TlsMode::Plain, _) => Security::Plain,
            (TlsMode::StartTls, Some(ca)) => Security::StartTls(TlsAcceptor::from(ca.server_config())),
            (TlsMode::Implicit, Some(ca)) => Security::Implicit(TlsAcceptor::from(ca.server_config())),
            (mode, None) => anyhow::bail!("TlsMode::{mode:?} needs a TestCa in SmtpOptions::ca"),
        };
        let listener = TcpListener::bind(addr).await.context("binding the SMTP listener")?;
        let addr = listener.local_addr()?;
        let (accepted_count, _) = watch::channel(0);
        let (held, _) = watch::channel(0);
        let (release, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            security,
            faults: Mutex::new(VecDeque::new()),
            default_fault: Mutex::new(opts.default_fault),
            data_end_delay: opts.data_end_delay,
            random: Mutex::new(None),
            drawn: Mutex::new(HashMap::new()),
            held,
            release,
            accepted: Mutex::new(Vec::new()),
            dropped_after_data: Mutex::new(Vec::new()),
            connections: AtomicUsize::new(0),
            accepted_count,
        });
        let shutdown = CancellationToken::new();
        tokio::spawn(accept_loop(listener, Arc::clone(&shared), shutdown.clone()));
        Ok(Self { addr, shared, shutdown })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Faults to apply to the next connections, one per connection, in order; after the
    /// queue is empty, the default fault applies.
    pub fn push_faults(&self, faults: impl IntoIterator<Item = Fault>) {
        lock(&self.shared.faults).extend(faults);
    }

    /// Replaces the fault for connections that find the queue empty.
    pub fn set_default_fault(&self, f: Fault) {
        *lock(&self.shared.default_fault) = f;
    }

    /// From now on, each connection that finds the queue empty gets a fault drawn from
    /// [`random_fault_menu`] with probability `p` (else the default fault). The same seed
    /// gives the same sequence of draws.
    pub fn set_random_faults(&self, p: f64, seed: u64) {
        self.set_random_faults_from(p, seed, random_fault_menu());
    }

    /// [`SmtpServer::set_random_faults`] with another menu of faults.
    pub fn set_random_faults_from(&self, p: f64, seed: u64, menu: Vec<Fault>) {
        *lock(&self.shared.random) = Some(RandomFaults { p: p.clamp(0.0, 1.0), state: seed, menu });
    }

    /// Stops drawing random faults.
    pub fn clear_random_faults(&self) {
        *lock(&self.shared.random) = None;
    }

    /// How many connections were handed each kind of fault so far, by [`Fault::label`].
    pub fn faults_drawn(&self) -> HashMap<&'static str, usize> {
        lock(&self.shared.drawn).clone()
    }

    /// Waits until at least `n` messages are held by [`Fault::HoldAfterData`]; false if
    /// the timeout elapsed first.
    pub async fn wait_held(&self, n: usize, timeout: Duration) -> bool {
        let mut held = self.shared.held.subscribe();
        tokio::time::timeout(timeout, held.wait_for(|held| *held >= n)).await.is_ok()
    }

    /// Lets every message held so far be accepted and answered.
    pub fn release_held(&self) {
        self.shared.release.send_modify(|generation| *generation += 1);
    }

    /// Messages answered with a positive reply after DATA, in order of acceptance.
    pub fn accepted(&self) -> Vec<Received> {
        lock(&self.shared.accepted).clone()
    }

    /// Messages received in full on a connection that was then closed without a reply
    /// ([`Fault::DropAfterData`]).
    pub fn dropped_after_data(&self) -> Vec<Received> {
        lock(&self.shared.dropped_after_data).clone()
    }

    /// Number of TCP connections accepted so far, faulted ones included.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` messages are accepted or the timeout elapses; returns
    /// [`SmtpServer::accepted`] either way.
    pub async fn wait_for(&self, n: usize, timeout: Duration) -> Vec<Received> {
        self.wait_after(0, n, timeout).await
    }

    /// Like [`SmtpServer::wait_for`], but returns only the messages accepted after the
    /// first `skip` (a reader that keeps up copies each message once).
    pub async fn wait_after(&self, skip: usize, n: usize, timeout: Duration) -> Vec<Received> {
        let mut count = self.shared.accepted_count.subscribe();
        let _ = tokio::time::timeout(timeout, count.wait_for(|accepted| *accepted >= n)).await;
        lock(&self.shared.accepted).iter().skip(skip).cloned().collect()
    }

    /// Count of accepted messages per Message-ID, for "no message accepted twice".
    /// Messages without a Message-ID are not counted.
    pub fn accepted_by_message_id(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for id in lock(&self.shared.accepted).iter().filter_map(|received| received.message_id.clone()) {
            *counts.entry(id).or_insert(0) += 1;
        }
        counts
    }

    /// Stops accepting (new connections are refused) and closes open connections, to
    /// simulate a relay that went away. Recorded messages stay readable.
    pub fn stop(&self) {
        self.shutdown.cancel();
    }
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(err) => {
                tracing::warn!(error = %err, "smtp test server: accept failed");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(ACCEPT_RETRY) => continue,
                }
            }
        };
        shared.connections.fetch_add(1, Ordering::SeqCst);
        let fault = shared.next_fault();
        let shared = Arc::clone(&shared);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                served = serve(stream, &shared, fault) => {
                    if let Err(err) = served {
                        tracing::debug!(error = %err, "smtp test server: connection ended with an error");
                    }
                }
            }
        });
    }
}

/// Runs one connection from accept to close.
async fn serve(mut tcp: TcpStream, shared: &Shared, fault: Fault) -> io::Result<()> {
    if fault == Fault::DropOnConnect {
        return Ok(());
    }
    // Replies are small and each is followed by a read; don't let Nagle delay them.
    let _ = tcp.set_nodelay(true);
    let mut session = Session::new(fault);
    match &shared.security {
        Security::Implicit(acceptor) => {
            let mut tls = acceptor.accept(tcp).await?;
            session.tls = true;
            write_reply(&mut tls, 220, GREETING).await?;
            run_session(tls, &mut session, shared).await?;
        }
        Security::Plain => {
            write_reply(&mut tcp, 220, GREETING).await?;
            run_session(tcp, &mut session, shared).await?;
        }
        Security::StartTls(acceptor) => {
            write_reply(&mut tcp, 220, GREETING).await?;
            if let Ended::StartTls(tcp) = run_session(tcp, &mut session, shared).await? {
                let tls = acceptor.accept(tcp).await?;
                session.start_tls();
                run_session(tls, &mut session, shared).await?;
            }
        }
    }
    Ok(())
}

/// Per-connection protocol state.
struct Session {
    /// The fault still to fire on this connection; becomes `Fault::None` once it has.
    fault: Fault,
    tls: bool,
    /// EHLO or HELO seen since the connection (or TLS) started.
    greeted: bool,
    auth_user: Option<String>,
    /// The transaction in progress, from MAIL until the end of DATA or RSET.
    envelope: Option<Envelope>,
}

struct Envelope {
    mail_from: String,
    rcpt_to: Vec<String>,
}

impl Session {
    fn new(fault: Fault) -> Self {
        Self { fault, tls: false, greeted: false, auth_user: None, envelope: None }
    }

    /// RFC 3207: after the handshake the client starts over and earlier state is void.
    fn start_tls(&mut self) {
        self.tls = true;
        self.greeted = false;
        self.auth_user = None;
        self.envelope = None;
    }

    /// Takes the pending fault if it fires at `point`.
    fn fire(&mut self, point: FaultPoint) -> Option<Fault> {
        if self.fault.point() == Some(point) { Some(std::mem::replace(&mut self.fault, Fault::None)) } else { None }
    }
}

/// How a session ended.
enum Ended<S> {
    Closed,
    /// The client asked for STARTTLS and was told to go ahead; the raw stream is handed
    /// back for the handshake.
    StartTls(S),
}

/// What to do after a command.
enum Step {
    Continue,
    Close,
    StartTls,
}

/// One command/reply loop over `stream`.
async fn run_session<S>(stream: S, session: &mut Session, shared: &Shared) -> io::Result<Ended<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut conn = Connection { io: BufReader::new(stream), session, shared };
    let mut line = Vec::new();
    loop {
        match read_line(&mut conn.io, &mut line, MAX_COMMAND_LINE).await? {
            Line::Complete => {}
            Line::Eof => return Ok(Ended::Closed),
            Line::TooLong => {
                conn.reply(500, "5.5.6 Line too long").await?;
                return Ok(Ended::Closed);
            }
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            conn.reply(500, "5.5.2 Syntax error, command unrecognized").await?;
            continue;
        };
        let command = text.trim_end_matches(['\r', '\n']);
        let (verb, args) = command.split_once(' ').unwrap_or((command, ""));
        match conn.command(&verb.to_ascii_uppercase(), args).await? {
            Step::Continue => {}
            Step::Close => return Ok(Ended::Closed),
            // Bytes the client sent after STARTTLS but before the handshake are discarded
            // with the buffer (RFC 3207 section 5 / command injection).
            Step::StartTls => return Ok(Ended::StartTls(conn.io.into_inner())),
        }
    }
}

struct Connection<'a, S> {
    io: BufReader<S>,
    session: &'a mut Session,
    shared: &'a Shared,
}

impl<S> Connection<'_, S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    async fn reply(&mut self, code: u16, text: &str) -> io::Result<()> {
        write_reply(self.io.get_mut(), code, text).await
    }

    fn offers_starttls(&self) -> bool {
        matches!(self.shared.security, Security::StartTls(_)) && !self.session.tls
    }

    fn offers_auth(&self) -> bool {
        self.session.tls || matches!(self.shared.security, Security::Plain)
    }

    async fn command(&mut self, verb: &str, args: &str) -> io::Result<Step> {
        match verb {
            "EHLO" => self.ehlo(args).await,
            "HELO" => {
                self.session.greeted = true;
                self.session.envelope = None;
                self.reply(250, HOSTNAME).await?;
                Ok(Step::Continue)
            }
            "STARTTLS" => self.starttls(args).await,
            "AUTH" => self.auth(args).await,
            "MAIL" => self.mail(args).await,
            "RCPT" => self.rcpt(args).await,
            "DATA" => self.data().await,
            "RSET" => {
                self.session.envelope = None;
                self.reply(250, "2.0.0 Ok").await?;
                Ok(Step::Continue)
            }
            "NOOP" => {
                self.reply(250, "2.0.0 Ok").await?;
                Ok(Step::Continue)
            }
            "QUIT" => {
                self.reply(221, "2.0.0 Bye").await?;
                // Sends close_notify over TLS; the peer may already be gone.
                let _ = self.io.get_mut().shutdown().await;
                Ok(Step::Close)
            }
            _ => {
                self.reply(500, "5.5.2 Syntax error, command unrecognized").await?;
                Ok(Step::Continue)
            }
        }
    }

    async fn ehlo(&mut self, args: &str) -> io::Result<Step> {
        if args.trim().is_empty() {
            self.reply(501, "5.5.4 Syntax: EHLO hostname").await?;
            return Ok(Step::Continue);
        }
        self.session.greeted = true;
        self.session.envelope = None;
        let mut lines = vec![HOSTNAME, "8BITMIME", "SMTPUTF8"];
        if self.offers_starttls() {
            lines.push("STARTTLS");
        }
        if self.offers_auth() {
            lines.push("AUTH PLAIN LOGIN");
        }
        self.reply(250, &lines.join("\n")).await?;
        Ok(Step::Continue)
    }

    async fn starttls(&mut self, args: &str) -> io::Result<Step> {
        if self.session.tls {
            self.reply(503, "5.5.1 TLS already active").await?;
        } else if !self.offers_starttls() {
            self.reply(502, "5.5.1 STARTTLS not available").await?;
        } else if !args.trim().is_empty() {
            self.reply(501, "5.5.4 Syntax: STARTTLS").await?;
        } else {
            self.reply(220, "ready").await?;
            return Ok(Step::StartTls);
        }
        Ok(Step::Continue)
    }

    async fn auth(&mut self, args: &str) -> io::Result<Step> {
        if !self.offers_auth() {
            self.reply(530, "5.7.0 Must issue a STARTTLS command first").await?;
            return Ok(Step::Continue);
        }
        if !self.session.greeted || self.session.envelope.is_some() || self.session.auth_user.is_some() {
            self.reply(503, "5.5.1 AUTH not allowed now").await?;
            return Ok(Step::Continue);
        }
        let args = args.trim();
        let (mechanism, initial) = match args.split_once(' ') {
            Some((mechanism, initial)) => (mechanism, Some(initial.trim().to_owned())),
            None => (args, None),
        };
        let user = match mechanism.to_ascii_uppercase().as_str() {
            "PLAIN" => {
                let Some(response) = self.challenge(initial, "").await? else {
                    return Ok(Step::Close);
                };
                if response == "*" {
                    return self.auth_cancelled().await;
                }
                decode_plain(&response)
            }
            "LOGIN" => {
                let Some(user) = self.challenge(initial, "VXNlcm5hbWU6").await? else {
                    return Ok(Step::Close);
                };
                if user == "*" {
                    return self.auth_cancelled().await;
                }
                let Some(password) = self.challenge(None, "UGFzc3dvcmQ6").await? else {
                    return Ok(Step::Close);
                };
                if password == "*" {
                    return self.auth_cancelled().await;
                }
                // Any password is fine, but it must be well-formed.
                decode_text(&password).and(decode_text(&user))
            }
            _ => {
                self.reply(504, "5.5.4 Unrecognized authentication type").await?;
                return Ok(Step::Continue);
            }
        };
        match user {
            Some(user) => {
                self.session.auth_user = Some(user);
                self.reply(235, "2.7.0 Authentication successful").await?;
            }
            None => {
                self.reply(501, "5.5.2 Cannot decode AUTH response").await?;
            }
        }
        Ok(Step::Continue)
    }

    /// Returns `initial` if the client sent one, otherwise sends a `334` challenge and
    /// reads the response line. `None` when the client hung up.
    async fn challenge(&mut self, initial: Option<String>, prompt: &str) -> io::Result<Option<String>> {
        if initial.is_some() {
            return Ok(initial);
        }
        self.reply(334, prompt).await?;
        let mut line = Vec::new();
        match read_line(&mut self.io, &mut line, MAX_COMMAND_LINE).await? {
            Line::Complete => Ok(Some(String::from_utf8_lossy(&line).trim_end_matches(['\r', '\n']).trim().to_owned())),
            Line::Eof | Line::TooLong => Ok(None),
        }
    }

    async fn auth_cancelled(&mut self) -> io::Result<Step> {
        self.reply(501, "5.7.0 Authentication cancelled").await?;
        Ok(Step::Continue)
    }

    async fn mail(&mut self, args: &str) -> io::Result<Step> {
        if !self.session.greeted {
            self.reply(503, "5.5.1 Error: send HELO/EHLO first").await?;
            return Ok(Step::Continue);
        }
        if matches!(self.shared.security, Security::StartTls(_)) && !self.session.tls {
            self.reply(530, "5.7.0 Must issue a STARTTLS command first").await?;
            return Ok(Step::Continue);
        }
        if self.session.envelope.is_some() {
            self.reply(503, "5.5.1 Error: nested MAIL command").await?;
            return Ok(Step::Continue);
        }
        let Some(mail_from) = parse_path(args, "FROM:") else {
            self.reply(501, "5.5.4 Syntax: MAIL FROM:<address>").await?;
            return Ok(Step::Continue);
        };
        let envelope = Envelope { mail_from, rcpt_to: Vec::new() };
        match self.session.fire(FaultPoint::Mail) {
            Some(Fault::DropBeforeMail) => return Ok(Step::Close),
            Some(Fault::ReplyAtMail(code, text)) => {
                if is_completion(code) {
                    self.session.envelope = Some(envelope);
                }
                self.reply(code, &text).await?;
                return Ok(Step::Continue);
            }
            _ => {}
        }
        self.session.envelope = Some(envelope);
        self.reply(250, "2.1.0 Ok").await?;
        Ok(Step::Continue)
    }

    async fn rcpt(&mut self, args: &str) -> io::Result<Step> {
        if self.session.envelope.is_none() {
            self.reply(503, "5.5.1 Error: need MAIL command").await?;
            return Ok(Step::Continue);
        }
        let Some(rcpt) = parse_path(args, "TO:").filter(|rcpt| !rcpt.is_empty()) else {
            self.reply(501, "5.5.4 Syntax: RCPT TO:<address>").await?;
            return Ok(Step::Continue);
        };
        let (code, text) = match self.session.fire(FaultPoint::Rcpt) {
            Some(Fault::ReplyAtRcpt(code, text)) => (code, text),
            _ => (250, "2.1.5 Ok".to_owned()),
        };
        if let Some(envelope) = self.session.envelope.as_mut().filter(|_| is_completion(code)) {
            envelope.rcpt_to.push(rcpt);
        }
        self.reply(code, &text).await?;
        Ok(Step::Continue)
    }

    async fn data(&mut self) -> io::Result<Step> {
        let Some(envelope) = self.session.envelope.take() else {
            self.reply(503, "5.5.1 Error: need RCPT command").await?;
            return Ok(Step::Continue);
        };
        if envelope.rcpt_to.is_empty() {
            self.session.envelope = Some(envelope);
            self.reply(554, "5.5.1 Error: no valid recipients").await?;
            return Ok(Step::Continue);
        }
        if let Some(Fault::DropAfterRcpt) = self.session.fire(FaultPoint::Data) {
            return Ok(Step::Close);
        }
        self.reply(354, "End data with <CR><LF>.<CR><LF>").await?;
        let data = match read_payload(&mut self.io).await? {
            Payload::Complete(data) => data,
            Payload::Eof => return Ok(Step::Close),
            Payload::TooLarge => {
                self.reply(552, "5.3.4 Message size exceeds fixed limit").await?;
                return Ok(Step::Close);
            }
        };
        let received = Received {
            mail_from: envelope.mail_from,
            rcpt_to: envelope.rcpt_to,
            message_id: parse_message_id(&data),
            data,
            tls: self.session.tls,
            auth_user: self.session.auth_user.clone(),
        };
        match self.session.fire(FaultPoint::DataEnd) {
            Some(Fault::HoldAfterData) => {
                self.shared.hold().await;
                self.shared.record_accepted(received);
                let text = format!("2.0.0 Ok: queued as {}", uuid::Uuid::new_v4());
                self.reply(250, &text).await?;
                Ok(Step::Continue)
            }
            Some(Fault::DropAfterData) => {
                self.shared.record_dropped_after_data(received);
                Ok(Step::Close)
            }
            Some(Fault::ReplyAtDataEnd(code, text)) => {
                if is_completion(code) {
                    self.shared.record_accepted(received);
                }
                self.reply(code, &text).await?;
                Ok(Step::Continue)
            }
            _ => {
                if !self.shared.data_end_delay.is_zero() {
                    tokio::time::sleep(self.shared.data_end_delay).await;
                }
                self.shared.record_accepted(received);
                let text = format!("2.0.0 Ok: queued as {}", uuid::Uuid::new_v4());
                self.reply(250, &text).await?;
                Ok(Step::Continue)
            }
        }
    }
}

fn is_completion(code: u16) -> bool {
    (200..300).contains(&code)
}

/// Writes one reply; a `text` with several lines becomes a multi-line reply.
async fn write_reply<W: AsyncWrite + Unpin>(w: &mut W, code: u16, text: &str) -> io::Result<()> {
    w.write_all(format_reply(code, text).as_bytes()).await?;
    w.flush().await
}

fn format_reply(code: u16, text: &str) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        lines.push("");
    }
    let last = lines.len() - 1;
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let separator = if i == last { ' ' } else { '-' };
        out.push_str(&format!("{code}{separator}{line}\r\n"));
    }
    out
}

enum Line {
    Complete,
    Eof,
    TooLong,
}

/// Reads one line (with its terminator) into `buf`, at most `max` bytes.
async fn read_line<R>(reader: &mut R, buf: &mut Vec<u8>, max: usize) -> io::Result<Line>
where
    R: AsyncBufRead + Unpin,
{
    buf.clear();
    (&mut *reader).take(max as u64).read_until(b'\n', buf).await?;
    if buf.ends_with(b"\n") {
        Ok(Line::Complete)
    } else if buf.len() >= max {
        Ok(Line::TooLong)
    } else {
        Ok(Line::Eof)
    }
}

enum Payload {
    Complete(Vec<u8>),
    Eof,
    TooLarge,
}

/// Reads a DATA payload up to the lone `.` line, removing dot-stuffing (RFC 5321 4.5.2).
async fn read_payload<R>(reader: &mut R) -> io::Result<Payload>
where
    R: AsyncBufRead + Unpin,
{
    let mut data = Vec::new();
    let mut line = Vec::new();
    loop {
        match read_line(reader, &mut line, MAX_DATA_LINE).await? {
            Line::Complete => {}
            Line::Eof => return Ok(Payload::Eof),
            Line::TooLong => return Ok(Payload::TooLarge),
        }
        if line == b".\r\n" || line == b".\n" {
            return Ok(Payload::Complete(data));
        }
        let unstuffed = line.strip_prefix(b".").unwrap_or(&line);
        if data.len() + unstuffed.len() > MAX_MESSAGE {
            return Ok(Payload::TooLarge);
        }
        data.extend_from_slice(unstuffed);
    }
}

/// Parses `FROM:<path> params` / `TO:<path> params` and returns the path without `<>`.
/// ESMTP parameters (SIZE, BODY, SMTPUTF8, ...) are ignored.
fn parse_path(args: &str, keyword: &str) -> Option<String> {
    let args = args.trim_start();
    let head = args.get(..keyword.len())?;
    if !head.eq_ignore_ascii_case(keyword) {
        return None;
    }
    let rest = args.get(keyword.len()..)?.trim_start();
    let inner = rest.strip_prefix('<')?;
    let end = inner.find('>')?;
    Some(inner[..end].to_owned())
}

/// Decodes an AUTH PLAIN response (`authzid NUL authcid NUL password`) to the authcid.
fn decode_plain(encoded: &str) -> Option<String> {
    let decoded = BASE64.decode(encoded).ok()?;
    let mut fields = decoded.split(|byte| *byte == 0);
    let _authzid = fields.next()?;
    let authcid = fields.next()?;
    let _password = fields.next()?;
    if fields.next().is_some() {
        return None;
    }
    String::from_utf8(authcid.to_vec()).ok()
}

fn decode_text(encoded: &str) -> Option<String> {
    String::from_utf8(BASE64.decode(encoded).ok()?).ok()
}

/// The Message-ID header value without `<>`: header names match case-insensitively,
/// folded continuation lines are unfolded, and only the header block is searched.
fn parse_message_id(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let mut value: Option<String> = None;
    for line in text.split('\n').map(|line| line.trim_end_matches('\r')) {
        if line.is_empty() {
            break;
        }
        if line.starts_with([' ', '\t']) {
            if let Some(value) = value.as_mut() {
                value.push_str(line);
            }
            continue;
        }
        if value.is_some() {
            break;
        }
        match line.split_once(':') {
            Some((name, rest)) if name.trim().eq_ignore_ascii_case("message-id") => {
                value = Some(rest.to_owned());
            }
            _ => {}
        }
    }
    let value = value?;
    let value = value.trim();
    let id = match value.find('<') {
        Some(start) => {
            let inner = &value[start + 1..];
            inner.find('>').map_or(inner, |end| &inner[..end])
        }
        None => value,
    };
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use lettre::message::header::ContentType;
    use lettre::transport::smtp::authentication::Credentials;
    use lettre::transport::smtp::client::{Certificate, CertificateStore, Tls, TlsParameters};
    use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

    const WAIT: Duration = Duration::from_secs(5);

    fn tls_parameters(ca: &TestCa) -> TlsParameters {
        TlsParameters::builder(HOSTNAME.into())
            .certificate_store(CertificateStore::None)
            .add_root_certificate(Certificate::from_pem(ca.ca_pem().as_bytes()).unwrap())
            .build_rustls()
            .unwrap()
    }

    fn transport(port: u16, tls: Tls) -> AsyncSmtpTransport<Tokio1Executor> {
        AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(HOSTNAME)
            .port(port)
            .tls(tls)
            .timeout(Some(WAIT))
            .build()
    }

    fn message(id: &str) -> Message {
        Message::builder()
            .from("Agent <agent@airlock.test>".parse().unwrap())
            .to("Human <human@example.test>".parse().unwrap())
            .subject("hello")
            .message_id(Some(format!("<{id}>")))
            .header(ContentType::TEXT_PLAIN)
            .body(String::from("line one\r\n.leading dot\r\nend\r\n"))
            .unwrap()
    }

    async fn starttls_server() -> (Arc<TestCa>, SmtpServer) {
        let ca = Arc::new(TestCa::new().unwrap());
        let server = SmtpServer::start(SmtpOptions::starttls(Arc::clone(&ca))).await.unwrap();
        (ca, server)
    }

    #[tokio::test]
    async fn starttls_delivers_with_message_id_and_auth() {
        let (ca, server) = starttls_server().await;
        let mailer = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(HOSTNAME)
            .port(server.port())
            .tls(Tls::Required(tls_parameters(&ca)))
            .credentials(Credentials::new("agent".into(), "secret".into()))
            .timeout(Some(WAIT))
            .build();

        let response = mailer.send(message("m1@airlock.test")).await.unwrap();
        assert_eq!(u16::from(response.code()), 250);

        let accepted = server.accepted();
        assert_eq!(accepted.len(), 1);
        let received = &accepted[0];
        assert_eq!(received.message_id.as_deref(), Some("m1@airlock.test"));
        assert!(received.tls);
        assert_eq!(received.auth_user.as_deref(), Some("agent"));
        assert_eq!(received.mail_from, "agent@airlock.test");
        assert_eq!(received.rcpt_to, vec!["human@example.test".to_owned()]);
        let data = String::from_utf8(received.data.clone()).unwrap();
        assert!(data.contains("\r\n.leading dot\r\n"), "dot-stuffing not undone: {data:?}");
        assert!(data.ends_with("\r\n"));
        assert_eq!(server.accepted_by_message_id()["m1@airlock.test"], 1);
        assert_eq!(server.connections(), 1);
    }

    #[tokio::test]
    async fn implicit_tls_delivers() {
        let ca = Arc::new(TestCa::new().unwrap());
        let server = SmtpServer::start(SmtpOptions::implicit(Arc::clone(&ca))).await.unwrap();
        let mailer = transport(server.port(), Tls::Wrapper(tls_parameters(&ca)));

        mailer.send(message("m2@airlock.test")).await.unwrap();

        let accepted = server.wait_for(1, WAIT).await;
        assert_eq!(accepted.len(), 1);
        assert!(accepted[0].tls);
        assert_eq!(accepted[0].message_id.as_deref(), Some("m2@airlock.test"));
        assert_eq!(accepted[0].auth_user, None);
    }

    #[tokio::test]
    async fn client_not_trusting_the_ca_fails_the_handshake() {
        let (_ca, server) = starttls_server().await;
        let other_ca = TestCa::new().unwrap();
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&other_ca)));

        let err = mailer.send(message("m3@airlock.test")).await.unwrap_err();

        // lettre reports a failed handshake as a connection error, not `is_tls()`.
        assert!(!err.is_transient() && !err.is_permanent(), "{err:?}");
        assert!(server.accepted().is_empty());
        assert!(server.dropped_after_data().is_empty());
    }

    #[tokio::test]
    async fn client_not_trusting_the_ca_fails_implicit_tls() {
        let ca = Arc::new(TestCa::new().unwrap());
        let server = SmtpServer::start(SmtpOptions::implicit(ca)).await.unwrap();
        let other_ca = TestCa::new().unwrap();
        let mailer = transport(server.port(), Tls::Wrapper(tls_parameters(&other_ca)));

        assert!(mailer.send(message("m4@airlock.test")).await.is_err());
        assert!(server.accepted().is_empty());
    }

    #[tokio::test]
    async fn mail_without_starttls_is_refused_with_530() {
        let (_ca, server) = starttls_server().await;
        let mailer = transport(server.port(), Tls::None);

        let err = mailer.send(message("m5@airlock.test")).await.unwrap_err();

        assert!(err.is_permanent(), "{err:?}");
        assert_eq!(err.status().map(u16::from), Some(530));
        assert!(server.accepted().is_empty());
    }

    #[tokio::test]
    async fn reply_at_rcpt_550_is_permanent() {
        let (ca, server) = starttls_server().await;
        server.push_faults([Fault::ReplyAtRcpt(550, "5.1.1 No such user".into())]);
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));

        let err = mailer.send(message("m6@airlock.test")).await.unwrap_err();

        assert!(err.is_permanent(), "{err:?}");
        assert_eq!(err.status().map(u16::from), Some(550));
        assert!(server.accepted().is_empty());
    }

    #[tokio::test]
    async fn reply_at_mail_421_is_transient_and_faults_apply_in_order() {
        let (ca, server) = starttls_server().await;
        server.push_faults([Fault::ReplyAtMail(421, "4.3.2 Try again later".into())]);
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));

        let err = mailer.send(message("m7@airlock.test")).await.unwrap_err();
        assert!(err.is_transient(), "{err:?}");
        assert_eq!(err.status().map(u16::from), Some(421));
        assert!(server.accepted().is_empty());

        // The queue is empty now, so the next connection gets the default (no fault).
        mailer.send(message("m7@airlock.test")).await.unwrap();
        assert_eq!(server.accepted_by_message_id()["m7@airlock.test"], 1);
        assert_eq!(server.connections(), 2);
    }

    #[tokio::test]
    async fn reply_at_data_end_rejects_the_message() {
        let (ca, server) = starttls_server().await;
        server.push_faults([Fault::ReplyAtDataEnd(554, "5.7.1 Rejected".into())]);
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));

        let err = mailer.send(message("m8@airlock.test")).await.unwrap_err();

        assert!(err.is_permanent(), "{err:?}");
        assert!(server.accepted().is_empty());
        assert!(server.dropped_after_data().is_empty());
    }

    #[tokio::test]
    async fn drop_after_data_is_recorded_apart_from_accepted() {
        let (ca, server) = starttls_server().await;
        server.set_default_fault(Fault::DropAfterData);
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));

        let err = mailer.send(message("m9@airlock.test")).await.unwrap_err();

        assert!(!err.is_transient() && !err.is_permanent(), "{err:?}");
        assert!(server.accepted().is_empty());
        let dropped = server.dropped_after_data();
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].message_id.as_deref(), Some("m9@airlock.test"));
        assert!(server.accepted_by_message_id().is_empty());
    }

    #[tokio::test]
    async fn drops_at_every_step_fail_the_send() {
        let server = SmtpServer::start(SmtpOptions::plain()).await.unwrap();
        let faults = [Fault::DropOnConnect, Fault::DropBeforeMail, Fault::DropAfterRcpt, Fault::DropAfterData];
        server.push_faults(faults.clone());
        let mailer = transport(server.port(), Tls::None);

        for fault in &faults {
            let err = mailer.send(message("m10@airlock.test")).await.unwrap_err();
            // No reply code: lettre's error alone cannot tell at which step the
            // connection died (plain TCP gives a response error, TLS a network error).
            assert_eq!(err.status(), None, "{fault:?}: {err:?}");
        }
        mailer.send(message("m10@airlock.test")).await.unwrap();

        assert_eq!(server.connections(), faults.len() + 1);
        assert_eq!(server.accepted().len(), 1);
        assert_eq!(server.dropped_after_data().len(), 1);
        assert!(!server.accepted()[0].tls);
    }

    #[tokio::test]
    async fn many_concurrent_connections() {
        let (ca, server) = starttls_server().await;
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));

        let sends = (0..20).map(|i| {
            let mailer = mailer.clone();
            tokio::spawn(async move { mailer.send(message(&format!("c{i}@airlock.test"))).await })
        });
        for send in sends.collect::<Vec<_>>() {
            send.await.unwrap().unwrap();
        }

        assert_eq!(server.wait_for(20, WAIT).await.len(), 20);
        let by_id = server.accepted_by_message_id();
        assert_eq!(by_id.len(), 20);
        assert!(by_id.values().all(|count| *count == 1));
    }

    #[tokio::test]
    async fn stop_refuses_new_connections() {
        let server = SmtpServer::start(SmtpOptions::plain()).await.unwrap();
        let mailer = transport(server.port(), Tls::None);
        server.stop();
        // The accept loop observes the cancellation asynchronously; bound the wait.
        let refused = tokio::time::timeout(WAIT, async {
            loop {
                if TcpStream::connect(server.addr()).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(refused.is_ok());
        assert!(mailer.send(message("m11@airlock.test")).await.is_err());
    }

    #[tokio::test]
    async fn starting_tls_modes_without_a_ca_is_an_error() {
        let opts = SmtpOptions {
            tls: TlsMode::StartTls,
            ca: None,
            default_fault: Fault::None,
            data_end_delay: Duration::ZERO,
        };
        assert!(SmtpServer::start(opts).await.is_err());
    }

    /// Drives the server by hand over plain TCP: several transactions on one connection,
    /// RSET, NOOP, AUTH LOGIN, unknown commands and a folded Message-ID.
    #[tokio::test]
    async fn raw_session_reuses_the_connection() {
        let server = SmtpServer::start(SmtpOptions::plain()).await.unwrap();
        let stream = TcpStream::connect(server.addr()).await.unwrap();
        let mut client = tokio::io::BufReader::new(stream);

        async fn expect(client: &mut tokio::io::BufReader<TcpStream>, code: &str) -> String {
            let mut all = String::new();
            loop {
                let mut line = String::new();
                client.read_line(&mut line).await.unwrap();
                assert!(line.starts_with(code), "expected {code}, got {line:?}");
                all.push_str(&line);
                if line.as_bytes().get(3) == Some(&b' ') {
                    return all;
                }
            }
        }
        async fn send(client: &mut tokio::io::BufReader<TcpStream>, text: &str) {
            client.get_mut().write_all(text.as_bytes()).await.unwrap();
        }

        assert_eq!(expect(&mut client, "220").await, "220 localhost ESMTP test\r\n");
        send(&mut client, "EHLO client.test\r\n").await;
        let ehlo = expect(&mut client, "250").await;
        assert!(ehlo.contains("AUTH PLAIN LOGIN"));
        assert!(!ehlo.contains("STARTTLS"));
        assert!(!ehlo.contains("PIPELINING"));
        send(&mut client, "FROB\r\n").await;
        expect(&mut client, "500").await;
        send(&mut client, "AUTH LOGIN\r\n").await;
        expect(&mut client, "334").await;
        send(&mut client, &format!("{}\r\n", BASE64.encode("robot"))).await;
        expect(&mut client, "334").await;
        send(&mut client, &format!("{}\r\n", BASE64.encode("pw"))).await;
        expect(&mut client, "235").await;
        send(&mut client, "RCPT TO:<x@y>\r\n").await;
        expect(&mut client, "503").await;

        for (i, folded) in [(1, false), (2, true)] {
            send(&mut client, "MAIL FROM:<a@b.test> SIZE=100 BODY=8BITMIME\r\n").await;
            expect(&mut client, "250").await;
            send(&mut client, "RCPT TO:<c@d.test>\r\nRCPT TO:<e@f.test>\r\n").await;
            expect(&mut client, "250").await;
            expect(&mut client, "250").await;
            send(&mut client, "DATA\r\n").await;
            expect(&mut client, "354").await;
            let header = if folded {
                format!("message-ID:\r\n  <raw{i}@airlock.test>\r\n")
            } else {
                format!("Message-Id: <raw{i}@airlock.test>\r\n")
            };
            send(&mut client, &format!("{header}Subject: x\r\n\r\n..dot\r\nbody\r\n.\r\n")).await;
            expect(&mut client, "250 2.0.0 Ok: queued as ").await;
        }
        send(&mut client, "MAIL FROM:<>\r\n").await;
        expect(&mut client, "250").await;
        send(&mut client, "RSET\r\nNOOP\r\n").await;
        expect(&mut client, "250").await;
        expect(&mut client, "250").await;
        send(&mut client, "QUIT\r\n").await;
        expect(&mut client, "221").await;

        let accepted = server.accepted();
        assert_eq!(accepted.len(), 2);
        for (i, received) in accepted.iter().enumerate() {
            assert_eq!(received.message_id, Some(format!("raw{}@airlock.test", i + 1)));
            assert_eq!(received.rcpt_to, vec!["c@d.test".to_owned(), "e@f.test".to_owned()]);
            assert_eq!(received.auth_user.as_deref(), Some("robot"));
            assert!(received.data.ends_with(b"\r\n.dot\r\nbody\r\n"));
        }
        assert_eq!(server.connections(), 1);
    }

    #[tokio::test]
    async fn hold_after_data_answers_only_when_released() {
        let (ca, server) = starttls_server().await;
        server.push_faults([Fault::HoldAfterData]);
        let mailer = transport(server.port(), Tls::Required(tls_parameters(&ca)));
        let send = tokio::spawn(async move { mailer.send(message("h1@airlock.test")).await });

        assert!(server.wait_held(1, WAIT).await);
        assert!(server.accepted().is_empty(), "held, not accepted yet");
        assert!(!send.is_finished());
        server.release_held();

        send.await.unwrap().unwrap();
        assert_eq!(server.accepted_by_message_id()["h1@airlock.test"], 1);
        assert!(server.dropped_after_data().is_empty());
    }

    #[tokio::test]
    async fn random_faults_are_seeded_and_cover_every_phase() {
        let draws = |seed: u64| {
            let mut r = RandomFaults { p: 0.5, state: seed, menu: random_fault_menu() };
            (0..400).map(|_| r.draw()).collect::<Vec<_>>()
        };
        let a = draws(7);
        assert_eq!(a, draws(7), "the same seed replays the same faults");
        assert_ne!(a, draws(8));
        let faulted = a.iter().flatten().count();
        assert!((120..=280).contains(&faulted), "about half of 400: {faulted}");
        for fault in random_fault_menu() {
            assert!(a.iter().flatten().any(|f| *f == fault), "{fault:?} never drawn");
        }

        // Through the server: every connection faulted with p = 1, none with p = 0.
        let server = SmtpServer::start(SmtpOptions::plain()).await.unwrap();
        server.set_random_faults_from(1.0, 1, vec![Fault::ReplyAtMail(421, "later".into())]);
        let mailer = transport(server.port(), Tls::None);
        for _ in 0..3 {
            assert!(mailer.send(message("r1@airlock.test")).await.unwrap_err().is_transient());
        }
        assert_eq!(server.faults_drawn()["reply_at_mail"], 3);
        server.clear_random_faults();
        mailer.send(message("r1@airlock.test")).await.unwrap();
        server.set_random_faults(0.0, 1);
        mailer.send(message("r2@airlock.test")).await.unwrap();
        assert_eq!(server.accepted().len(), 2);
        assert_eq!(server.faults_drawn().values().sum::<usize>(), 3);
    }

    #[test]
    fn message_id_parsing() {
        assert_eq!(parse_message_id(b"MESSAGE-ID: <a@b>\r\n\r\nx").as_deref(), Some("a@b"));
        assert_eq!(parse_message_id(b"Subject: s\r\nMessage-ID:\r\n\t<a@b>\r\nTo: t\r\n\r\n").as_deref(), Some("a@b"));
        assert_eq!(parse_message_id(b"Message-ID: bare@id\n\n").as_deref(), Some("bare@id"));
        assert_eq!(parse_message_id(b"Subject: s\r\n\r\nMessage-ID: <body@only>\r\n"), None);
        assert_eq!(parse_message_id(b"Subject: s\r\n\r\n"), None);
    }

    #[test]
    fn multi_line_replies() {
        assert_eq!(format_reply(250, "a\nb\nc"), "250-a\r\n250-b\r\n250 c\r\n");
        assert_eq!(format_reply(334, ""), "334 \r\n");
    }

    #[test]
    fn paths_ignore_parameters_and_case() {
        assert_eq!(parse_path("from:<a@b> SIZE=1", "FROM:").as_deref(), Some("a@b"));
        assert_eq!(parse_path("FROM: <a@b>", "FROM:").as_deref(), Some("a@b"));
        assert_eq!(parse_path("FROM:<>", "FROM:").as_deref(), Some(""));
        assert_eq!(parse_path("FROM:a@b", "FROM:"), None);
        assert_eq!(parse_path("TO:<a@b>", "FROM:"), None);
    }
}
