//! The gauges sampled when `/metrics` is scraped: deliveries by state, runs by state and
//! the send switch, with the queue's depth beside them.

use std::future::Future;
use std::pin::Pin;

use airlock_core::metrics::{DELIVERIES, SEND_ENABLED};
use sqlx::PgPool;

/// Every gauge a service reports ([`airlock_core::metrics::Gauges`]).
pub fn gauges(pool: &PgPool) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + '_>> {
    Box::pin(async move {
        airlock_queue::sample_depth(pool).await?;
        let deliveries: Vec<(String, i64)> =
            sqlx::query_as("SELECT state::text, count(*) FROM deliveries GROUP BY state").fetch_all(pool).await?;
        for (state, n) in deliveries {
            metrics::gauge!(DELIVERIES, "state" => state).set(n as f64);
        }
        airlock_runs::run::sample_gauges(pool).await?;
        let on: bool = sqlx::query_scalar("SELECT send_enabled FROM settings WHERE id = 1").fetch_one(pool).await?;
        metrics::gauge!(SEND_ENABLED).set(if on { 1.0 } else { 0.0 });
        Ok(())
    })
}
