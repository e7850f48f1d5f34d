//! Serving a router so that no slow or greedy client can hold a listener (`http.*`).
//!
//! `axum::serve` sets no header-read timeout and caps nothing. Here every connection is an
//! HTTP/1.1 connection with:
//! - a header-read timeout (hyper's): a request's line and headers must arrive in time,
//!   which also bounds how long a kept-alive connection idles between requests;
//! - a request timeout: the answer (the body read included) within the limit, else `408`;
//! - an idle timeout: a connection on which nothing is read or written for that long is
//!   closed (a client that stops reading its answer, or trickles a body);
//! - a connection limit: at most `max_connections` served at once; the rest wait in the
//!   kernel's accept queue, so a flood costs the flooder, not the process's descriptors.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use airlock_core::config::HttpServeConfig;
use axum::Router;
use axum::http::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The limits of one listener, from `http.*`.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    pub header_read_timeout: Duration,
    pub request_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// How often `/metrics` samples the database's gauges.
    pub metrics_sample: Duration,
}

impl From<&HttpServeConfig> for ServeLimits {
    fn from(c: &HttpServeConfig) -> Self {
        Self {
            header_read_timeout: Duration::from_secs(c.header_read_timeout_seconds),
            request_timeout: Duration::from_secs(c.request_timeout_seconds),
            idle_timeout: Duration::from_secs(c.idle_timeout_seconds),
            max_connections: c.max_connections,
            metrics_sample: Duration::from_secs(c.metrics_sample_seconds),
        }
    }
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self::from(&HttpServeConfig::default())
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` fires; then stops
/// accepting, lets every open connection finish the request it is answering, and returns
/// when the last one has closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ServeLimits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let router = router
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, limits.request_timeout))
        .layer(axum::Extension(crate::MetricsSampling(limits.metrics_sample)));
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: not fatal;
                    // wait a little so a persistent error does not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            serve_connection(stream, router, limits, shutdown).await;
            tracing::trace!(%peer, "connection closed");
            drop(slot);
        });
    }
    connections.close();
    connections.wait().await;
    Ok(())
}

async fn serve_connection(stream: TcpStream, router: Router, limits: ServeLimits, shutdown: CancellationToken) {
    let activity = Activity::new();
    let io = TokioIo::new(Tracked { inner: stream, activity: activity.clone() });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
    let conn = builder.serve_connection(io, TowerToHyperService::new(router)).with_upgrades();
    tokio::pin!(conn);
    let mut draining = false;
    let mut check = Instant::now() + limits.idle_timeout;
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = shutdown.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep_until(check) => {
                let idle = activity.idle_for();
                if idle >= limits.idle_timeout {
                    tracing::debug!(idle_ms = idle.as_millis() as u64, "closing an idle connection");
                    metrics::counter!("airlock_http_idle_closed_total").increment(1);
                    return;
                }
                check = Instant::now() + (limits.idle_timeout - idle);
            }
        }
    }
}

/// When a connection last read or wrote a byte.
#[derive(Clone)]
struct Activity {
    epoch: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self { epoch: Instant::now(), last_ms: Arc::new(AtomicU64::new(0)) }
    }
    fn touch(&self) {
        self.last_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }
}

/// A stream that stamps [`Activity`] whenever bytes move.
struct Tracked {
    inner: TcpStream,
    activity: Activity,
}

impl AsyncRead for Tracked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
