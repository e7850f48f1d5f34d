//! The admin HTTP service.

use airlock_core::config::Config;
use axum::Router;
use axum::extract::FromRef;
use sqlx::PgPool;

/// What every admin handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: std::sync::Arc<Config>,
}

/// The whole admin router.
pub fn router(state: AppState) -> Router {
    Router::new().merge(airlock_core::http::health_routes()).with_state(state)
}
