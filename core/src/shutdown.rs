//! The root shutdown signal of every binary: one cancellation token that SIGTERM or
//! SIGINT fires; every loop of the process selects on it (or on a child of it).

use tokio_util::sync::CancellationToken;

/// A token that fires on SIGTERM or SIGINT. Needs a Tokio runtime.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
}
