//! [`Ticks`]: the tick store as the scheduler's jobs call it, with the calls
//! of many jobs coalesced into the store's batch methods.
//!
//! Every job has its own driver task, so when a thousand jobs fire at the
//! same instant a thousand tasks each ask the store the same kinds of
//! question. Each kind of call has a lane: a call that finds its lane idle
//! is sent at once (a lone tick waits for nothing), and calls that arrive
//! while the lane's batch is in flight queue up and go together, as one
//! batch, as soon as it answers. There is no linger timer: the batch size
//! follows the load.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind, LockName, TickStore};
use tokio::sync::oneshot;

/// The most calls one batch carries; a longer queue goes in several.
const MAX_BATCH: usize = 1024;

/// The tick store of one scheduler, coalescing concurrent calls.
#[derive(Debug)]
pub(crate) struct Ticks {
    store: Arc<dyn TickStore>,
    clock: Arc<Lane<ServerTime>>,
    latest: Arc<Lane<Latest>>,
    marks: Arc<Lane<Marks>>,
    records: Arc<Lane<Records>>,
}

impl Ticks {
    pub(crate) fn new(store: Arc<dyn TickStore>) -> Self {
        Self {
            store,
            clock: Arc::default(),
            latest: Arc::default(),
            marks: Arc::default(),
            records: Arc::default(),
        }
    }

    /// [`TickStore::server_time`], shared: the answer is one reading taken
    /// after this call began (a call that arrives while a reading is in
    /// flight waits for the next one), so it is never older than the
    /// reading a call of its own would have taken. Cancel safe.
    ///
    /// Joining the reading in flight instead would not be unsafe either:
    /// the reading is only used to refuse ticks ahead of the server, and an
    /// older reading makes a tick look further ahead, so staleness could
    /// only refuse a tick a fresh reading would have let run, never the
    /// reverse. Waiting for a fresh one costs at most one round trip.
    pub(crate) async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        self.clock.call(&self.store, ()).await
    }

    /// [`TickStore::last_completed`], batched. Cancel safe.
    pub(crate) async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.latest.call(&self.store, job.clone()).await
    }

    /// [`TickStore::is_completed`], batched. Cancel safe.
    pub(crate) async fn is_completed(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<bool, BackendError> {
        self.marks.call(&self.store, (job.clone(), tick)).await
    }

    /// [`TickStore::record_completed`], batched. A batch keeps every mark
    /// for the longest `keep` asked in it (at least as long as each asked).
    /// Not cancel safe: a dropped call may or may not have recorded the tick
    /// (the batch goes on without its caller).
    pub(crate) async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.records
            .call(&self.store, (job.clone(), tick, keep))
            .await
    }
}

/// One kind of store call, as a batch.
trait Batch: Send + Sync + 'static {
    type Item: Send + 'static;
    type Answer: Send + 'static;

    /// One answer per item, in order.
    fn run(
        store: Arc<dyn TickStore>,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Vec<Result<Self::Answer, BackendError>>> + Send;
}

#[derive(Debug)]
struct ServerTime;

impl Batch for ServerTime {
    type Item = ();
    type Answer = Option<i64>;

    async fn run(
        store: Arc<dyn TickStore>,
        items: Vec<()>,
    ) -> Vec<Result<Option<i64>, BackendError>> {
        // One reading serves every caller: they all began before it was taken.
        let reading = store.server_time().await;
        items
            .iter()
            .map(|()| match &reading {
                Ok(ms) => Ok(*ms),
                Err(e) => Err(e.copied()),
            })
            .collect()
    }
}

#[derive(Debug)]
struct Latest;

impl Batch for Latest {
    type Item = LockName;
    type Answer = Option<i64>;

    async fn run(
        store: Arc<dyn TickStore>,
        items: Vec<LockName>,
    ) -> Vec<Result<Option<i64>, BackendError>> {
        store.last_completed_many(&items).await
    }
}

#[derive(Debug)]
struct Marks;

impl Batch for Marks {
    type Item = (LockName, i64);
    type Answer = bool;

    async fn run(
        store: Arc<dyn TickStore>,
        items: Vec<(LockName, i64)>,
    ) -> Vec<Result<bool, BackendError>> {
        store.is_completed_many(&items).await
    }
}

#[derive(Debug)]
struct Records;

impl Batch for Records {
    type Item = (LockName, i64, Duration);
    type Answer = ();

    async fn run(
        store: Arc<dyn TickStore>,
        items: Vec<(LockName, i64, Duration)>,
    ) -> Vec<Result<(), BackendError>> {
        let keep = items
            .iter()
            .map(|(_, _, keep)| *keep)
            .max()
            .unwrap_or_default();
        let ticks: Vec<(LockName, i64)> = items
            .into_iter()
            .map(|(job, tick, _)| (job, tick))
            .collect();
        store.record_completed_many(&ticks, keep).await
    }
}

type Reply<B> = oneshot::Sender<Result<<B as Batch>::Answer, BackendError>>;

/// The calls of one kind: those queued, and whether a batch is in flight.
struct Lane<B: Batch> {
    state: Mutex<LaneState<B>>,
}

struct LaneState<B: Batch> {
    queued: Vec<(B::Item, Reply<B>)>,
    flushing: bool,
}

impl<B: Batch> Default for Lane<B> {
    fn default() -> Self {
        Self {
            state: Mutex::new(LaneState {
                queued: Vec::new(),
                flushing: false,
            }),
        }
    }
}

impl<B: Batch> std::fmt::Debug for Lane<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Lane")
            .field("queued", &state.queued.len())
            .field("flushing", &state.flushing)
            .finish()
    }
}

impl<B: Batch> Lane<B> {
    fn state(&self) -> MutexGuard<'_, LaneState<B>> {
        // Each critical section leaves the state whole: poison carries no half-state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `item` and waits for its answer; starts the lane's flushing
    /// task if it was idle.
    ///
    /// The batch runs in its own task, so a caller that gives up (cancelled
    /// by shutdown) does not cancel the batch of the others.
    async fn call(
        self: &Arc<Self>,
        store: &Arc<dyn TickStore>,
        item: B::Item,
    ) -> Result<B::Answer, BackendError> {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut state = self.state();
            state.queued.push((item, tx));
            !std::mem::replace(&mut state.flushing, true)
        };
        if start {
            let flusher = Flusher {
                lane: Arc::clone(self),
                done: false,
            };
            let store = Arc::clone(store);
            tokio::spawn(async move { flusher.run(store).await });
        }
        rx.await.unwrap_or_else(|_| {
            Err(BackendError::new(
                BackendErrorKind::Other,
                "the tick store's batch ended without an answer",
            ))
        })
    }
}

/// Sends a lane's queued calls, batch after batch, until none is left; if
/// it is dropped midway (a panicking store, the runtime going away) it
/// frees the lane, and the callers it drops get an error (fail closed).
struct Flusher<B: Batch> {
    lane: Arc<Lane<B>>,
    /// Set once it found the queue empty and freed the lane itself.
    done: bool,
}

impl<B: Batch> Flusher<B> {
    async fn run(mut self, store: Arc<dyn TickStore>) {
        // Ends when the queue is empty; every round answers at least one
        // queued call, and calls only queue while their callers wait.
        loop {
            let batch: Vec<(B::Item, Reply<B>)> = {
                let mut state = self.lane.state();
                if state.queued.is_empty() {
                    state.flushing = false;
                    self.done = true;
                    return;
                }
                let take = state.queued.len().min(MAX_BATCH);
                state.queued.drain(..take).collect()
            };
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let mut answers = B::run(Arc::clone(&store), items).await.into_iter();
            for reply in replies {
                let answer = answers.next().unwrap_or_else(|| {
                    Err(BackendError::new(
                        BackendErrorKind::Protocol,
                        "the tick store answered fewer calls than the batch held",
                    ))
                });
                // A caller that gave up no longer listens; nothing to do.
                let _ = reply.send(answer);
            }
        }
    }
}

impl<B: Batch> Drop for Flusher<B> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Dropped before the queue emptied: free the lane so the next call
        // starts afresh, and fail the calls that waited.
        let mut state = self.lane.state();
        state.flushing = false;
        state.queued.clear();
    }
}

#[cfg(test)]
mod tests;
