//! airlock-api: the agent-facing HTTP API.
//!
//! Every route but the health checks needs an agent's bearer token, and an agent sees only
//! its own runs, deliveries and tasks (anything else is 404, so ids do not leak). [`router`]
//! builds the service so tests can start it in-process; `main.rs` binds it. [`runs`] holds
//! the durable-run routes, [`turns`] the agent turns', [`tasks`] the sandboxed tasks',
//! [`mcp`] the same routes as Model Context Protocol tools at `/mcp`.

use std::sync::Arc;

use airlock_agent::catalogue::Catalogue;
use airlock_core::config::Config;
use airlock_delivery::pipeline::{self, Submission};
use airlock_delivery::store::{self, Actor};
use airlock_delivery::view;
use airlock_http::{Access, ApiError, Auth, BearerAuth, JsonBody, RouteRule, parse_id};
use airlock_queue::Waker;
use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::PgPool;
use utoipa::OpenApi;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub mod mcp;
pub mod runs;
pub mod tasks;
pub mod turns;

/// What every agent-API handler can reach.
#[derive(Clone, FromRef)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
    /// Wakes the workers after a submission commits.
    pub waker: Waker,
    /// The tools turns may be given, fixed at start.
    pub catalogue: Arc<Catalogue>,
}

impl AppState {
    /// The state over `pool`, with a waker of its own (needs a Tokio runtime). A tool the
    /// configuration declares that cannot be served is refused, naming its key.
    pub fn new(pool: PgPool, config: Arc<Config>) -> anyhow::Result<Self> {
        let waker = Waker::new(pool.clone());
        let catalogue = Arc::new(Catalogue::from_config(&config).map_err(|m| anyhow::anyhow!("tools: {m}"))?);
        Ok(Self { pool, config, waker, catalogue })
    }
}

/// Who may call each route of this service: the one authorization table, enforced by
/// [`airlock_http::authorize`] before any handler runs.
pub const ROUTES: &[RouteRule] = &[
    RouteRule { method: "POST", path: "/v1/runs", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/runs/{id}", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/claim", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/steps", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/runs/{id}/steps", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/effects", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/effects/{step_id}/outcome", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/complete", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/fail", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/cancel", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/runs/{id}/turns", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/turns/{id}", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/turns/{id}/events", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/turns/{id}/cancel", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/turns/{id}/resume", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/deliveries", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/deliveries/{id}", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/deliveries/{id}/cancel", access: Access::Agent },
    RouteRule { method: "POST", path: "/v1/tasks", access: Access::Agent },
    RouteRule { method: "GET", path: "/v1/tasks/{id}", access: Access::Agent },
    RouteRule { method: "POST", path: "/mcp", access: Access::Agent },
    RouteRule { method: "GET", path: "/mcp", access: Access::Agent },
    RouteRule { method: "DELETE", path: "/mcp", access: Access::Agent },
    RouteRule { method: "GET", path: "/healthz", access: Access::Public },
    RouteRule { method: "GET", path: "/readyz", access: Access::Public },
    RouteRule { method: "GET", path: "/metrics", access: Access::Public },
    RouteRule { method: "GET", path: "/openapi.json", access: Access::Public },
];

#[derive(OpenApi)]
#[openapi(
    info(title = "airlock agent API", description = "Runs and deliveries, for agents."),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

/// The routes with their OpenAPI description.
pub fn documented_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(runs::create_run))
        .routes(routes!(runs::get_run))
        .routes(routes!(runs::claim_run))
        .routes(routes!(runs::record_step, runs::list_steps))
        .routes(routes!(runs::begin_effect))
        .routes(routes!(runs::record_outcome))
        .routes(routes!(runs::complete_run))
        .routes(routes!(runs::fail_run))
        .routes(routes!(runs::cancel_run))
        .routes(routes!(turns::create_turn))
        .routes(routes!(turns::get_turn))
        .routes(routes!(turns::turn_events))
        .routes(routes!(turns::cancel_turn))
        .routes(routes!(turns::resume_turn))
        .routes(routes!(submit_delivery))
        .routes(routes!(get_delivery))
        .routes(routes!(cancel_delivery))
        .routes(routes!(tasks::create_task))
        .routes(routes!(tasks::get_task))
        .routes(routes!(mcp::mcp, mcp::mcp_stream, mcp::mcp_end))
}

/// The OpenAPI document of this service.
pub fn openapi() -> utoipa::openapi::OpenApi {
    airlock_http::assemble(documented_routes()).split_for_parts().1
}

/// The whole agent router.
pub fn router(state: AppState) -> Router {
    // Room for the artifact plus the request's own members; larger bodies are 413.
    let body_limit = state.config.delivery.max_artifact_bytes + 64 * 1024;
    let (router, _) = airlock_http::finish(
        "api",
        documented_routes(),
        state.pool.clone(),
        ROUTES,
        body_limit,
        airlock_delivery::metrics::gauges,
    );
    // `/mcp` calls the same routes in process, behind its own authorization and hardening.
    let (routes, _) = documented_routes().layer(axum::extract::DefaultBodyLimit::max(body_limit)).split_for_parts();
    let mcp = mcp::service(routes.with_state(state.clone()), body_limit);
    router.layer(axum::Extension(mcp)).with_state(state)
}

/// Hands an email or a webhook call to airlock. Idempotent on (run_id, step_id).
#[utoipa::path(post, path = "/v1/deliveries", request_body(content = Object, description = "run_id, step_id, channel and its email or webhook member"),
    responses((status = 201, description = "persisted"), (status = 200, description = "the same submission again"),
        (status = 400, description = "invalid"), (status = 404, description = "no such run"), (status = 409, description = "IDEMPOTENCY_CONFLICT, BUDGET_EXHAUSTED or RECIPIENT_SUPPRESSED"),
        (status = 413, description = "too large"),
        (status = 429, description = "RATE_LIMITED: a limit of limits.* is reached; try again after Retry-After seconds")))]
async fn submit_delivery(
    State(state): State<AppState>,
    auth: Auth,
    JsonBody(body): JsonBody<Value>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let agent = auth.agent()?;
    let submission = Submission::parse(&body, &pipeline::limits(&state.config))?;
    let (d, created) = pipeline::submit(&state.pool, &state.config, &state.waker, agent, submission).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((
        status,
        Json(json!({
            "id": d.id, "state": d.state, "idempotency_key": d.idempotency_key,
            "artifact_sha256": d.submitted_sha256, "channel": d.channel, "run_id": d.run_id, "step_id": d.step_id,
        })),
    ))
}

/// The delivery, when it belongs to the calling agent.
async fn own_delivery(pool: &PgPool, auth: &Auth, id: &str) -> Result<store::Delivery, ApiError> {
    let agent = auth.agent()?;
    match store::get(pool, parse_id(id)?).await? {
        Some(d) if d.agent == agent => Ok(d),
        _ => Err(ApiError::not_found("delivery")),
    }
}

/// A delivery of the calling agent: state, score, receipt, events.
#[utoipa::path(get, path = "/v1/deliveries/{id}", params(("id" = String, Path, description = "delivery id")),
    responses((status = 200, description = "the delivery"), (status = 404, description = "no such delivery of this agent")))]
async fn get_delivery(State(pool): State<PgPool>, auth: Auth, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let agent = auth.agent()?;
    // Another agent's delivery is not read at all, and answers as an unknown id does.
    let (_, v) =
        view::show(&pool, parse_id(&id)?, false, Some(agent)).await?.ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(Json(v))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    reason: Option<String>,
}

/// Cancels a delivery that has not started sending.
#[utoipa::path(post, path = "/v1/deliveries/{id}/cancel", params(("id" = String, Path, description = "delivery id")), request_body = CancelBody,
    responses((status = 200, description = "cancelled"), (status = 404), (status = 409, description = "too late to cancel")))]
async fn cancel_delivery(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CancelBody>,
) -> Result<Json<Value>, ApiError> {
    let d = own_delivery(&pool, &auth, &id).await?;
    let actor = Actor::new("agent", d.agent.clone());
    let d = pipeline::cancel(&pool, &actor, None, d.id, body.reason.as_deref()).await?;
    Ok(Json(view::render(&pool, &d, false).await?))
}
