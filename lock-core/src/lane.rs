//! Lanes: concurrent calls of one kind, coalesced into batches.
//!
//! A backend (or the scheduler's tick store) often answers many calls of one
//! kind in one round trip as cheaply as one: a thousand jobs firing at the
//! same instant each ask for their tick lock, a thousand leases each need a
//! liveness proof. A [`Lane`] holds the calls of one [`Batch`] kind on one
//! host (a store, a connection): a call is sent at once while fewer than
//! [`Batch::IN_FLIGHT`] batches of its kind are in flight, and calls that
//! arrive past that queue and go together, as one batch, as soon as a batch
//! answers. There is no linger timer: the batch size follows the load, and a
//! lone call waits for nothing.
//!
//! A call sent at once runs as a batch of one in its caller's task, so a
//! lightly loaded lane costs its callers no task and no channel; only queued
//! calls are sent by a task of the lane's own, which the call whose batch
//! answers first starts.
//!
//! A call is always answered by a batch sent after the call was made, never
//! by one already in flight, so an answer that proves something (the
//! connection is alive, the time on the server) is younger than its call.
//!
//! ```
//! use std::sync::Arc;
//! use lock_core::lane::{self, Batch, Lane};
//! use lock_core::BackendError;
//!
//! /// Doubles numbers, many per round trip.
//! #[derive(Default)]
//! struct Doubler {
//!     doubles: Lane<Double>,
//! }
//!
//! struct Double;
//!
//! impl Batch for Double {
//!     type Host = Doubler;
//!     type Item = u32;
//!     type Answer = u32;
//!
//!     fn lane(host: &Doubler) -> &Lane<Self> {
//!         &host.doubles
//!     }
//!
//!     async fn run(_: &Doubler, items: Vec<u32>) -> Vec<Result<u32, BackendError>> {
//!         items.into_iter().map(|n| Ok(n * 2)).collect()
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BackendError> {
//! let host = Arc::new(Doubler::default());
//! assert_eq!(lane::call::<Double>(&host, 21).await?, 42);
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use crate::{BackendError, BackendErrorKind};

/// One kind of call that can go many to a batch.
pub trait Batch: Sized + Send + Sync + 'static {
    /// What a batch runs on; it holds this kind's [`Lane`].
    type Host: Send + Sync + 'static;
    /// One call's input. It is dropped only after its batch answered or
    /// failed, when it will never be sent, or when the caller of a call
    /// sent at once gave up on it midway (then whatever its batch had
    /// handed to the host's connection is ahead of what is sent later).
    type Item: Send + 'static;
    /// One call's answer.
    type Answer: Send + 'static;

    /// The most batches of this kind in flight on one host; past that,
    /// calls queue and go together.
    const IN_FLIGHT: usize = 1;
    /// The most calls one batch carries; a longer queue goes in several.
    const MAX_BATCH: usize = 1024;

    /// This kind's lane on `host`.
    fn lane(host: &Self::Host) -> &Lane<Self>;

    /// Called for a call that queues instead of being sent at once, before
    /// its caller can give up, while the lane's lock is held: a kind whose
    /// queued items can be overtaken by later calls elsewhere (a release
    /// sent while its attempt waits) registers them here. Must be short and
    /// must not call into this lane. Does nothing by default.
    fn queued(_host: &Self::Host, _item: &mut Self::Item) {}

    /// The longest a queued call waits for its answer, from when it queued
    /// (a wait for a batch in flight, then its own batch), or `None` for no
    /// bound but the batches'. Without one, a stalled host holds a queued
    /// call for two batches' time limits. A call sent at once is bounded by
    /// its batch alone. A queued call that gives up at this bound may still
    /// be sent.
    fn queued_limit(_host: &Self::Host) -> Option<Duration> {
        None
    }

    /// The error of a queued call that had no answer within
    /// [`Batch::queued_limit`].
    fn timed_out(_host: &Self::Host, limit: Duration) -> BackendError {
        BackendError::timeout(format!(
            "no answer within {limit:?}: the server is slow or unreachable; try again"
        ))
    }

    /// One batch: one answer per item, in order. A batch that answers a
    /// different number of items fails every call in it.
    fn run(
        host: &Self::Host,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Vec<Result<Self::Answer, BackendError>>> + Send;

    /// A batch of one call: [`Batch::run`] by default; a kind whose single
    /// call has a form of its own (a single-key command) sends that.
    fn run_one(
        host: &Self::Host,
        item: Self::Item,
    ) -> impl Future<Output = Result<Self::Answer, BackendError>> + Send {
        async move { one(Self::run(host, vec![item]).await) }
    }
}

/// One answer per item from a batch that succeeds or fails as a whole: its
/// error, copied, for each of the `len` items.
pub fn each<T>(result: Result<Vec<T>, BackendError>, len: usize) -> Vec<Result<T, BackendError>> {
    match result {
        Ok(answers) => answers.into_iter().map(Ok).collect(),
        Err(e) => e.for_each(len),
    }
}

/// A new pair that tells when a call has settled: keep the [`Unsettled`]
/// in the call's item (the lane drops it once the batch answered or failed,
/// or when it will never be sent) and give the [`Settled`] to whatever must
/// not overtake the call, such as a release of the lock it attempts.
pub fn settle() -> (Unsettled, Settled) {
    let (tx, rx) = watch::channel(());
    (Unsettled { _sender: tx }, Settled(rx))
}

/// Held by a call's item until the call settles; see [`settle`].
#[derive(Debug)]
pub struct Unsettled {
    /// Dropped with it, which wakes every [`Settled::wait`].
    _sender: watch::Sender<()>,
}

/// Tells when a call has settled; see [`settle`]. Clones tell the same.
#[derive(Debug, Clone)]
pub struct Settled(watch::Receiver<()>);

impl Settled {
    /// Waits until the call has settled: from then on, a command sent on
    /// the host's connection runs after whatever the call sent. Returns at
    /// once if it already has.
    ///
    /// Cancel safe: it only waits.
    pub async fn wait(mut self) {
        // Nothing is ever sent: this returns when the sender is dropped.
        let _ = self.0.changed().await;
    }
}

type Reply<B> = oneshot::Sender<Result<<B as Batch>::Answer, BackendError>>;

/// The calls of one kind on one host: those queued, and how many flushing
/// tasks send them.
pub struct Lane<B: Batch> {
    state: Mutex<LaneState<B>>,
}

struct LaneState<B: Batch> {
    queued: Vec<(B::Item, Reply<B>)>,
    /// Slots taken: by calls sent at once (a [`Slot`]) and by lane tasks
    /// (a [`Flusher`]).
    flushers: usize,
}

impl<B: Batch> Default for Lane<B> {
    fn default() -> Self {
        Self {
            state: Mutex::new(LaneState {
                queued: Vec::new(),
                flushers: 0,
            }),
        }
    }
}

impl<B: Batch> std::fmt::Debug for Lane<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Lane")
            .field("queued", &state.queued.len())
            .field("flushers", &state.flushers)
            .finish()
    }
}

impl<B: Batch> Lane<B> {
    fn state(&self) -> MutexGuard<'_, LaneState<B>> {
        // Each critical section leaves the state whole: poison carries no half-state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many calls wait for a batch (not counting those in flight).
    pub fn queued(&self) -> usize {
        self.state().queued.len()
    }

    /// How many batches are in flight or about to be sent: calls run in
    /// their caller's task and lane tasks, each one batch at a time (at
    /// most [`Batch::IN_FLIGHT`]; 0 when the lane is idle).
    pub fn in_flight(&self) -> usize {
        self.state().flushers
    }
}

/// Sends `item` in `B`'s next batch on `host` and waits for its answer: at
/// once, as a batch of one run in this task, when fewer than
/// [`Batch::IN_FLIGHT`] batches are in flight and none is queued; else
/// queued, to go with the others in the next batch a lane task sends, and
/// waited for at most [`Batch::queued_limit`].
///
/// Cancel safe in that a caller who gives up stops nobody else's call: a
/// batch of several runs in the lane's own task, and a caller's own batch
/// holds only its call. Whether the dropped call's item was sent is then
/// unknown (each kind says what that leaves behind). Must be called inside a
/// Tokio runtime.
pub async fn call<B: Batch>(host: &Arc<B::Host>, item: B::Item) -> Result<B::Answer, BackendError> {
    let route = {
        let mut state = B::lane(host).state();
        let room = state.flushers < B::IN_FLIGHT.max(1);
        if room {
            state.flushers += 1;
        }
        if room && state.queued.is_empty() {
            Ok(item)
        } else {
            let mut item = item;
            B::queued(host, &mut item);
            let (reply, answer) = oneshot::channel();
            state.queued.push((item, reply));
            Err((answer, room))
        }
    };
    let (answer, start) = match route {
        Ok(item) => {
            // A batch of one in this task, in the slot taken above.
            let slot = Slot::<B> { host };
            let answer = B::run_one(host, item).await;
            drop(slot);
            return answer;
        }
        Err(queued) => queued,
    };
    if start {
        tokio::spawn(Flusher::<B>::new(host).run());
    }
    let answer = match B::queued_limit(host) {
        Some(limit) => match tokio::time::timeout(limit, answer).await {
            Ok(answer) => answer,
            Err(_) => return Err(B::timed_out(host, limit)),
        },
        None => answer.await,
    };
    answer.unwrap_or_else(|_| {
        Err(BackendError::new(
            BackendErrorKind::Other,
            "the batch ended without an answer (the runtime is shutting down); try again",
        ))
    })
}

/// The one answer of a batch of one call.
fn one<T>(answers: Vec<Result<T, BackendError>>) -> Result<T, BackendError> {
    fit(answers, 1)
        .pop()
        .unwrap_or_else(|| Err(BackendError::new(BackendErrorKind::Protocol, "no answer")))
}

/// `answers` if there is one per call of a batch of `calls`, else an error
/// for each call: no call may take another's answer.
fn fit<T>(answers: Vec<Result<T, BackendError>>, calls: usize) -> Vec<Result<T, BackendError>> {
    if answers.len() == calls {
        return answers;
    }
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("{} answers to a batch of {calls} calls", answers.len()),
    )
    .for_each(calls)
}

/// A lane slot held by a batch of one running in its caller's task. Given
/// back when the batch answered or its caller gave up: to a new lane task
/// when calls queued meanwhile, so they go at once, else to the lane.
struct Slot<'a, B: Batch> {
    host: &'a Arc<B::Host>,
}

impl<B: Batch> Drop for Slot<'_, B> {
    fn drop(&mut self) {
        {
            let mut state = B::lane(self.host).state();
            if state.queued.is_empty() {
                state.flushers = state.flushers.saturating_sub(1);
                return;
            }
        }
        let flusher = Flusher::<B>::new(self.host);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(flusher.run())),
            // Dropped, the flusher leaves the lane as one that never ran.
            Err(_) => drop(flusher),
        }
    }
}

/// Sends a lane's queued calls, batch after batch, until none is left;
/// dropped midway (a panicking batch, the runtime going away), it leaves the
/// lane, and the last one to leave drops the queued calls, which get an
/// error (fail closed).
struct Flusher<B: Batch> {
    host: Arc<B::Host>,
    /// Set once it found the queue empty and left the lane itself.
    done: bool,
}

impl<B: Batch> Flusher<B> {
    /// A flusher that holds a lane slot already taken for it.
    fn new(host: &Arc<B::Host>) -> Self {
        Self {
            host: Arc::clone(host),
            done: false,
        }
    }

    async fn run(mut self) {
        // Ends when the queue is empty; every round answers at least one
        // queued call, and calls only queue while their callers wait.
        loop {
            let batch: Vec<(B::Item, Reply<B>)> = {
                let mut state = B::lane(&self.host).state();
                if state.queued.is_empty() {
                    state.flushers = state.flushers.saturating_sub(1);
                    self.done = true;
                    return;
                }
                let take = state.queued.len().min(B::MAX_BATCH.max(1));
                state.queued.drain(..take).collect()
            };
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let answers = if items.len() == 1 {
                let mut answers = Vec::with_capacity(1);
                for item in items {
                    answers.push(B::run_one(&self.host, item).await);
                }
                answers
            } else {
                fit(B::run(&self.host, items).await, replies.len())
            };
            for (reply, answer) in replies.into_iter().zip(answers) {
                // A caller that gave up no longer listens.
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
        // Dropped before the queue emptied: leave the lane so the next call
        // starts a flusher; with none left, the queued calls are never sent.
        let mut state = B::lane(&self.host).state();
        state.flushers = state.flushers.saturating_sub(1);
        if state.flushers == 0 {
            state.queued.clear();
        }
    }
}

#[cfg(test)]
mod tests;
