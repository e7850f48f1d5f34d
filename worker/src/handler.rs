//! Job handlers: the code that does one kind of job, registered by kind.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use airlock_queue::{Job, Lease, Rescued};
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a handler gets: the claimed job, a pool, and a token that fires when the lease is
/// lost or the worker stops for good (the handler must then stop without effects).
#[derive(Clone)]
pub struct JobContext {
    pub job: Job,
    pub pool: PgPool,
    pub cancel: CancellationToken,
    pub lease_len: Duration,
}

impl JobContext {
    pub fn lease(&self) -> Lease {
        self.job.lease()
    }
}

/// How a handler's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done; the runtime completes the job.
    Completed,
    /// Done, and the handler already finalized the job in its own transaction (with the
    /// rows it serves), so the runtime writes nothing.
    Finalized,
    /// Run again later without spending an attempt.
    Snooze(Duration),
    /// Stop and wait for a human.
    Parked(String),
}

/// A failed run. Retryable unless `permanent`; `delay` overrides the backoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    pub message: String,
    pub permanent: bool,
    pub delay: Option<Duration>,
}

impl HandlerError {
    pub fn retry(message: impl Into<String>) -> Self {
        Self { message: message.into(), permanent: false, delay: None }
    }
    pub fn permanent(message: impl Into<String>) -> Self {
        Self { message: message.into(), permanent: true, delay: None }
    }
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }
}

/// The code for one job kind.
pub trait Handler: Send + Sync + 'static {
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>>;

    /// Called by the rescuer, inside its transaction, for each job of this kind whose lease
    /// expired, so the rows the job serves follow its new state.
    fn on_rescued<'a>(
        &'a self,
        _tx: &'a mut Transaction<'static, Postgres>,
        _rescued: &'a Rescued,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async { Ok(()) })
    }
}

/// A handler from an async closure (for simple kinds and tests).
pub struct FnHandler<F>(pub F);

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, HandlerError>> + Send + 'static,
{
    fn run(&self, ctx: JobContext) -> BoxFuture<'static, Result<Outcome, HandlerError>> {
        Box::pin((self.0)(ctx))
    }
}

/// Handlers by job kind.
#[derive(Default, Clone)]
pub struct Registry {
    handlers: HashMap<String, Arc<dyn Handler>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(&mut self, kind: impl Into<String>, handler: impl Handler) -> &mut Self {
        self.handlers.insert(kind.into(), Arc::new(handler));
        self
    }

    pub fn register_fn<F, Fut>(&mut self, kind: impl Into<String>, f: F) -> &mut Self
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Outcome, HandlerError>> + Send + 'static,
    {
        self.register(kind, FnHandler(f))
    }

    pub fn get(&self, kind: &str) -> Option<&Arc<dyn Handler>> {
        self.handlers.get(kind)
    }

    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }
}
