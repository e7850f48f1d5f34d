//! Gathers the requests that handlers running at the same time make into batches, so that
//! one transaction serves many jobs: a batch takes whatever is waiting when a batch slot
//! frees up, so a request that comes alone is served at once, and under load the batches
//! grow by themselves (up to `max`).

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::handler::BoxFuture;

/// What serves one batch: an answer per request, in the order given.
pub type BatchFn<T, R> = Arc<dyn Fn(Vec<T>) -> BoxFuture<'static, Vec<R>> + Send + Sync>;

type Request<T, R> = (T, oneshot::Sender<R>);

/// Requests waiting for a batch, at most, before a caller waits to hand its own over.
const WAITING: usize = 1024;

/// A batching front for `serve`, with up to `parallel` batches in flight. The loop starts
/// with the first request (on the runtime that makes it) and ends once the batcher and
/// every [`BatchSender`] are gone and every batch has answered.
pub struct Batcher<T, R> {
    max: usize,
    parallel: usize,
    serve: BatchFn<T, R>,
    sender: OnceLock<mpsc::Sender<Request<T, R>>>,
}

/// Hands requests to a [`Batcher`]; cheap to clone.
pub struct BatchSender<T, R>(mpsc::Sender<Request<T, R>>);

impl<T, R> Clone for BatchSender<T, R> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    pub fn new(max: usize, parallel: usize, serve: BatchFn<T, R>) -> Self {
        Self { max, parallel, serve, sender: OnceLock::new() }
    }

    /// A sender for this batcher; starts its loop on first use (call it on a runtime).
    pub fn sender(&self) -> BatchSender<T, R> {
        let tx = self.sender.get_or_init(|| {
            let (tx, rx) = mpsc::channel(WAITING);
            let serve = self.serve.clone();
            tokio::spawn(gather(rx, self.max, self.parallel, move |batch: Vec<Request<T, R>>| {
                let serve = serve.clone();
                async move {
                    let (items, replies): (Vec<T>, Vec<oneshot::Sender<R>>) = batch.into_iter().unzip();
                    let answers = serve(items).await;
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
            }));
            tx
        });
        BatchSender(tx.clone())
    }
}

impl<T, R> BatchSender<T, R> {
    /// Serves `item` in the next batch; `None` when the batcher stopped without answering.
    pub async fn call(&self, item: T) -> Option<R> {
        let (reply, answer) = oneshot::channel();
        self.0.send((item, reply)).await.ok()?;
        answer.await.ok()
    }
}

/// Serves what arrives on `rx` in batches of up to `max`, with up to `parallel` batches in
/// flight: a batch takes whatever is waiting when a slot frees up. Ends when every sender
/// is gone and every batch has been served.
pub async fn gather<T, F, Fut>(mut rx: mpsc::Receiver<T>, max: usize, parallel: usize, serve: F)
where
    T: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut running: JoinSet<()> = JoinSet::new();
    let mut open = true;
    while open || !running.is_empty() {
        tokio::select! {
            first = rx.recv(), if open && running.len() < parallel.max(1) => {
                let Some(first) = first else {
                    open = false;
                    continue;
                };
                let mut batch = vec![first];
                while batch.len() < max {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                running.spawn(serve(batch));
            }
            Some(_) = running.join_next() => {}
        }
    }
}
