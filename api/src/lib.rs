//! airlock-api: the agent-facing HTTP API.
//!
//! [`router`] builds the service so tests can start it in-process; `main.rs` binds it.

use airlock_core::config::Config;
use axum::Router;
use axum::extract::FromRef;
use sqlx::PgPool;

/// What every agent-API handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: std::sync::Arc<Config>,
}

/// The whole agent router.
pub fn router(state: AppState) -> Router {
    Router::new().merge(airlock_core::http::health_routes()).with_state(state)
}
