//! Tracing set-up shared by every binary: JSON lines when `AIRLOCK_LOG_FORMAT=json`,
//! human-readable otherwise; filtered by `RUST_LOG` (default `info,sqlx=warn`). Logs go to stderr
//! so that stdout stays free for what a command prints (a token, `ok`).

use tracing_subscriber::{EnvFilter, fmt};

/// Installs the global subscriber. Calling it twice is harmless (the second is ignored).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let json = std::env::var("AIRLOCK_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ =
        if json { builder.json().flatten_event(true).with_current_span(true).try_init() } else { builder.try_init() };
}

/// Installs the ring crypto provider for rustls. Every binary calls this first; mixing
/// providers panics at run time.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
