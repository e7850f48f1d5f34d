//! Wires the binary: configuration, pool, migrations, handlers, signals.

use std::sync::Arc;
use std::time::Duration;

use airlock_channels::email::SmtpSender;
use airlock_channels::webhook::WebhookSender;
use airlock_core::config::Config;
use airlock_core::secret::Secret;
use airlock_delivery::pipeline::{SCORE_JOB, SEND_JOB};
use airlock_delivery::scoring::{DefaultScorer, Judge};
use tokio_util::sync::CancellationToken;

use crate::delivery::{ScoreHandler, SendHandler};
use crate::handler::Registry;
use crate::runtime::{Worker, WorkerSettings};

/// Every handler this build knows, as configured. Refuses a configuration that could not
/// send safely (a missing CA file, plaintext to a remote host, a missing signing secret
/// while webhook origins are allowed).
pub fn registry(cfg: &Arc<Config>, worker_id: &str) -> anyhow::Result<Registry> {
    registry_with(cfg, worker_id, &airlock_core::secret::from_env)
}

/// [`registry`] with secrets read by `secret_of` (given a variable's name) rather than
/// from the process environment.
pub fn registry_with(
    cfg: &Arc<Config>,
    worker_id: &str,
    secret_of: &dyn Fn(&str) -> Option<Secret>,
) -> anyhow::Result<Registry> {
    let sender = |timeout: Duration| {
        WebhookSender::from_config(&cfg.delivery, timeout, secret_of, Arc::new(airlock_channels::address::SystemLookup))
    };
    let mut r = Registry::new();
    let judge = match &cfg.scoring.model {
        None => None,
        Some(name) => {
            let model =
                cfg.models.get(name).ok_or_else(|| anyhow::anyhow!("scoring.model: `{name}` is not configured"))?;
            let judge = airlock_agent::judge::ModelJudge::new(name, model)
                .map_err(|e| anyhow::anyhow!("scoring.model: models.{name}: {e}"))?;
            Some(Arc::new(judge) as Arc<dyn Judge>)
        }
    };
    r.register(
        SCORE_JOB,
        ScoreHandler::new(cfg.clone(), Arc::new(DefaultScorer::new(cfg.delivery.known_domains.clone())), judge),
    );
    let smtp = SmtpSender::from_config(&cfg.smtp)?;
    let webhook = if cfg.delivery.allowed_webhook_origins().is_empty() {
        None
    } else {
        Some(sender(Duration::from_secs(cfg.delivery.webhook_timeout_seconds.max(1)))?)
    };
    r.register(SEND_JOB, SendHandler::new(cfg.clone(), worker_id.to_string(), Some(smtp), webhook));
    crate::sandbox::register(&mut r, cfg, worker_id)?;
    let tools = if cfg.tools.is_empty() {
        None
    } else {
        let sender = sender(Duration::from_secs(cfg.agent.tool_timeout_seconds))?;
        Some(Arc::new(crate::turn::WebhookTransport(sender)) as Arc<dyn airlock_agent::tools::Transport>)
    };
    crate::turn::register(&mut r, cfg, tools)?;
    crate::migrate::register(&mut r, cfg, worker_id)?;
    if cfg.worker.diagnostic_jobs {
        crate::diag::register(&mut r);
    }
    Ok(r)
}

/// Connects, migrates and runs a worker until `shutdown` fires.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let cfg = Arc::new(cfg);
    let pool = airlock_core::db::connect(&cfg.database).await?;
    airlock_core::db::migrate(&pool).await?;
    let settings = WorkerSettings::from_config(&cfg, WorkerSettings::new_id());
    let registry = registry(&cfg, &settings.id)?;
    if let Some(addr) = cfg.worker.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!(listen = %listener.local_addr()?, "worker health and metrics listening");
        tokio::spawn(airlock_http::serve(
            listener,
            ops_router(pool.clone()),
            airlock_http::ServeLimits::from(&cfg.http),
            shutdown.clone(),
        ));
    }
    let node = crate::node::start_from_config(&cfg, &pool, &shutdown).await?;
    let result = Worker::new(pool, registry, settings).run(shutdown).await;
    if let Some(node) = node {
        let _ = node.await;
    }
    result
}

/// `/healthz`, `/readyz` and `/metrics` of a worker (no authentication: they reveal
/// counts, never content).
pub fn ops_router(pool: sqlx::PgPool) -> axum::Router {
    airlock_core::metrics::install();
    let (router, _) = utoipa_axum::router::OpenApiRouter::new()
        .merge(airlock_http::health_routes())
        .routes(utoipa_axum::routes!(airlock_http::metrics_text))
        .split_for_parts();
    router.layer(axum::Extension::<airlock_core::metrics::Gauges>(airlock_delivery::metrics::gauges)).with_state(pool)
}
