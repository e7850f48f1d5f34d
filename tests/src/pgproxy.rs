//! A TCP proxy in front of Postgres that can lose the answer to one COMMIT.
//!
//! A client (a real worker) is pointed at the proxy instead of the server. Once armed with
//! a marker — a piece of SQL such as `INSERT INTO send_attempts` — the proxy watches each
//! connection: after the marker went by, the next `COMMIT` is forwarded to the server
//! (which commits it), and then the connection is cut before the answer reaches the
//! client. That is the one database fault a retry cannot see through on its own: the
//! transaction *did* commit, yet the client got an error.
//!
//! The marker is matched on the wire, so it must travel as text: sqlx sends a statement's
//! text the first time a connection prepares it, which is always the case for the first
//! statement of its kind in a fresh process. The fault fires once per arming.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A simple-query `COMMIT` as the client library sends it (`Q`, length, text, NUL).
const COMMIT: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";

#[derive(Default)]
struct Shared {
    /// The SQL text that arms a connection; `None` when disarmed.
    marker: Mutex<Option<Vec<u8>>>,
    /// Answers to COMMIT that were cut.
    cut: AtomicUsize,
}

/// A running proxy on 127.0.0.1; stops when dropped.
pub struct PgProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl PgProxy {
    /// Starts a proxy to the server `upstream` (`host:port`).
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let stop = CancellationToken::new();
        let (s, token) = (shared.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = token.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                };
                let (s, token, upstream) = (s.clone(), token.clone(), upstream.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        tokio::select! {
                            _ = token.cancelled() => {}
                            _ = pipe(client, server, &s) => {}
                        }
                    }
                });
            }
        });
        Ok(Self { addr, shared, stop })
    }

    /// A proxy to the server a Postgres URL names.
    pub async fn for_url(url: &str) -> anyhow::Result<Self> {
        let parsed = reqwest::Url::parse(url)?;
        let host = parsed.host_str().unwrap_or("127.0.0.1").to_string();
        Self::start(format!("{host}:{}", parsed.port().unwrap_or(5432))).await
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        let mut parsed = reqwest::Url::parse(url).expect("a Postgres URL");
        parsed.set_host(Some("127.0.0.1")).expect("host");
        parsed.set_port(Some(self.addr.port())).expect("port");
        parsed.to_string()
    }

    /// Cuts the answer to the next COMMIT of a transaction in which `marker` was sent.
    pub fn cut_commit_after(&self, marker: &str) {
        *self.shared.marker.lock().unwrap_or_else(|e| e.into_inner()) = Some(marker.as_bytes().to_vec());
    }

    /// How many COMMIT answers were cut so far.
    pub fn cuts(&self) -> usize {
        self.shared.cut.load(Ordering::SeqCst)
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Pipes one connection both ways, cutting it after a marked COMMIT reached the server.
async fn pipe(client: TcpStream, server: TcpStream, shared: &Shared) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    // Set once the marked COMMIT went to the server: its answer must not come back.
    let cutting = AtomicBool::new(false);
    let upstream = async {
        let mut seen_marker = false;
        // The tail of the previous read, so a marker split across reads is still found.
        let mut window: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            window.extend_from_slice(&buf[..n]);
            let marker = shared.marker.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(marker) = marker {
                if !seen_marker && let Some(at) = find(&window, &marker) {
                    // Only a COMMIT sent after the marker counts.
                    seen_marker = true;
                    window.drain(..at + marker.len());
                }
                if seen_marker && find(&window, COMMIT).is_some() {
                    let mut armed = shared.marker.lock().unwrap_or_else(|e| e.into_inner());
                    if armed.is_some() {
                        *armed = None;
                        cutting.store(true, Ordering::SeqCst);
                    }
                }
            }
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
            let keep = window.len().saturating_sub(4096);
            window.drain(..keep);
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if cutting.load(Ordering::SeqCst) {
                // The server has answered the COMMIT: it committed. Drop the answer and the
                // connection, as a network failure at that instant would.
                shared.cut.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}
