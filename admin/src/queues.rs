//! Queue pauses by hand: an operator stops workers claiming from a named queue (running
//! jobs go on) and lets them claim again, from the admin API or the command line, each
//! time audited in the transaction that pauses or resumes. The `send` queue is not among
//! them: it follows the send switch, which is the one way to stop or allow sending.

use airlock_core::audit;
use airlock_core::principals::Role;
use airlock_delivery::pipeline::SEND_QUEUE;
use airlock_http::{ApiError, Auth, JsonBody};
use axum::Json;
use axum::extract::{Path, State};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use utoipa::ToSchema;

/// Why a pause or a resume was refused.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("{0}")]
    Invalid(String),
    #[error("the `send` queue follows the send switch: flip the switch instead")]
    SendQueue,
    #[error(transparent)]
    Queue(#[from] airlock_queue::QueueError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl airlock_core::error::DomainError for PauseError {
    fn kind(&self) -> airlock_core::error::ErrorKind {
        use airlock_core::error::ErrorKind;
        match self {
            PauseError::Invalid(_) => ErrorKind::Validation,
            PauseError::SendQueue => ErrorKind::InvalidTransition,
            PauseError::Queue(e) => e.kind(),
            PauseError::Db(_) => ErrorKind::Internal,
        }
    }
}

/// Who pauses: a principal over HTTP, or the command line's operating-system user.
pub enum Operator<'a> {
    Principal(&'a airlock_core::principals::Principal),
    Cli(&'a str),
}

/// A queue name as workers are configured with it: 1 to 100 characters of letters,
/// digits, `.`, `_`, `-` and `:`.
fn check_name(queue: &str) -> Result<(), PauseError> {
    let ok = !queue.is_empty()
        && queue.len() <= 100
        && queue.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if !ok {
        return Err(PauseError::Invalid("queue: 1 to 100 characters of letters, digits, `.`, `_`, `-` and `:`".into()));
    }
    if queue == SEND_QUEUE {
        return Err(PauseError::SendQueue);
    }
    Ok(())
}

/// Pauses (`pause`) or resumes a queue, audited with `reason` in the same transaction.
/// Pausing a paused queue or resuming one that is not paused changes nothing but is
/// audited all the same (what the operator meant is on record). Returns whether the
/// queue is paused now.
pub async fn set_paused(
    pool: &PgPool,
    who: Operator<'_>,
    queue: &str,
    pause: bool,
    reason: Option<&str>,
) -> Result<QueueState, PauseError> {
    check_name(queue)?;
    let reason = reason.map(str::trim).filter(|r| !r.is_empty()).ok_or_else(|| {
        PauseError::Invalid("reason: required (why the queue is paused or resumed, for the audit log)".into())
    })?;
    if reason.chars().any(char::is_control) || reason.len() > 2000 {
        return Err(PauseError::Invalid("reason: printable text of at most 2000 bytes".into()));
    }
    let mut tx = pool.begin().await?;
    let was_paused = airlock_queue::paused_queues(&mut *tx).await?.iter().any(|q| q == queue);
    let action = audit::Action {
        action: if pause { "queue.pause" } else { "queue.resume" },
        target_kind: "queue",
        target_id: queue.to_string(),
        reason: Some(reason),
        data: json!({"was_paused": was_paused}),
    };
    match who {
        Operator::Principal(p) => audit::record(&mut tx, p, action).await?,
        Operator::Cli(actor) => audit::record_as(&mut tx, actor, "admin", action).await?,
    }
    if pause {
        airlock_queue::pause_queue(&mut *tx, queue, reason).await?;
    } else {
        airlock_queue::resume_queue(&mut *tx, queue).await?;
    }
    tx.commit().await?;
    tracing::warn!(queue, pause, "queue pause set by hand");
    let now = list(pool).await?.into_iter().find(|q| q.name == queue);
    Ok(now.unwrap_or(QueueState {
        name: queue.to_string(),
        paused: false,
        paused_at: None,
        reason: None,
        depth: Default::default(),
    }))
}

/// A queue: whether it is paused (since when, why) and its depth by state.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct QueueState {
    pub name: String,
    pub paused: bool,
    pub paused_at: Option<chrono::DateTime<chrono::Utc>>,
    pub reason: Option<String>,
    /// Unfinished jobs by state (`available`, `running`, `parked`).
    pub depth: std::collections::BTreeMap<String, i64>,
}

/// The queues airlock itself enqueues to, listed even when empty.
const KNOWN: &[&str] = &[airlock_queue::DEFAULT_QUEUE, SEND_QUEUE, airlock_sandbox::service::QUEUE];

/// airlock's own queues and every other queue that holds unfinished jobs or is paused, by
/// name.
pub async fn list(pool: &PgPool) -> Result<Vec<QueueState>, airlock_queue::QueueError> {
    let counts = airlock_queue::count_by_queue_state(pool).await?;
    let pauses = airlock_queue::list_pauses(pool).await?;
    let mut out: std::collections::BTreeMap<String, QueueState> = Default::default();
    let blank = |name: &str| QueueState {
        name: name.to_string(),
        paused: false,
        paused_at: None,
        reason: None,
        depth: Default::default(),
    };
    for name in KNOWN {
        out.insert(name.to_string(), blank(name));
    }
    for c in counts {
        let q = out.entry(c.queue.clone()).or_insert_with(|| blank(&c.queue));
        q.depth.insert(c.state.as_str().to_string(), c.count);
    }
    for p in pauses {
        let q = out.entry(p.queue.clone()).or_insert_with(|| blank(&p.queue));
        q.paused = true;
        q.paused_at = Some(p.paused_at);
        q.reason = Some(p.reason);
    }
    Ok(out.into_values().collect())
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PauseBody {
    reason: Option<String>,
}

/// Queues with their depth and whether they are paused.
#[utoipa::path(get, path = "/admin/v1/queues", responses((status = 200, description = "airlock's own queues and every queue with unfinished jobs or a pause: depth by state, paused since when and why")))]
pub(crate) async fn list_queues(
    State(pool): State<PgPool>,
    auth: Auth,
) -> Result<Json<airlock_http::Page<QueueState>>, ApiError> {
    auth.require(Role::Operator)?;
    Ok(Json(airlock_http::Page { items: list(&pool).await?, next: None }))
}

/// Pauses a queue: workers stop claiming from it (running jobs go on). Audited.
#[utoipa::path(post, path = "/admin/v1/queues/{name}/pause", params(("name" = String, Path, description = "queue name")), request_body = PauseBody,
    responses((status = 200, description = "the queue, paused"), (status = 400, description = "no reason, or not a queue name"),
        (status = 409, description = "the `send` queue, which follows the send switch")))]
pub(crate) async fn pause(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<PauseBody>,
) -> Result<Json<QueueState>, ApiError> {
    let who = auth.require(Role::Operator)?;
    Ok(Json(set_paused(&pool, Operator::Principal(who), &name, true, body.reason.as_deref()).await?))
}

/// Resumes a paused queue: workers claim from it again at once. Audited.
#[utoipa::path(post, path = "/admin/v1/queues/{name}/resume", params(("name" = String, Path, description = "queue name")), request_body = PauseBody,
    responses((status = 200, description = "the queue, claimed from again"), (status = 400, description = "no reason, or not a queue name"),
        (status = 409, description = "the `send` queue, which follows the send switch")))]
pub(crate) async fn resume(
    State(pool): State<PgPool>,
    auth: Auth,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<PauseBody>,
) -> Result<Json<QueueState>, ApiError> {
    let who = auth.require(Role::Operator)?;
    Ok(Json(set_paused(&pool, Operator::Principal(who), &name, false, body.reason.as_deref()).await?))
}

/// Who is signed in.
#[derive(Debug, Serialize, ToSchema)]
pub struct Me {
    pub name: String,
    pub role: String,
}

/// The principal behind the token: the page shows who is signed in and only the controls
/// that role may use.
#[utoipa::path(get, path = "/admin/v1/me", responses((status = 200, description = "the caller's name and role"),
    (status = 401, description = "no valid token"), (status = 403, description = "an agent token")))]
pub(crate) async fn me(auth: Auth) -> Result<Json<Me>, ApiError> {
    let who = auth.require(Role::Reviewer)?;
    Ok(Json(Me { name: who.name.clone(), role: who.role.as_str().to_string() }))
}
