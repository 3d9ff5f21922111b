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

use tokio::sync::oneshot;

use crate::{BackendError, BackendErrorKind};

/// One kind of call that can go many to a batch.
pub trait Batch: Sized + Send + Sync + 'static {
    /// What a batch runs on; it holds this kind's [`Lane`].
    type Host: Send + Sync + 'static;
    /// One call's input. It is dropped only after its batch answered or
    /// failed (or when it was never sent).
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

    /// One batch: one answer per item, in order. A batch that answers a
    /// different number of items fails every call in it.
    fn run(
        host: &Self::Host,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Vec<Result<Self::Answer, BackendError>>> + Send;
}

/// One answer per item from a batch that succeeds or fails as a whole: its
/// error, copied, for each of the `len` items.
pub fn each<T>(result: Result<Vec<T>, BackendError>, len: usize) -> Vec<Result<T, BackendError>> {
    match result {
        Ok(answers) => answers.into_iter().map(Ok).collect(),
        Err(e) => e.for_each(len),
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

    /// How many tasks send this lane's batches, each one batch at a time
    /// (at most [`Batch::IN_FLIGHT`]; 0 when the lane is idle).
    pub fn in_flight(&self) -> usize {
        self.state().flushers
    }
}

/// Queues `item` in `B`'s lane on `host` and waits for its answer; starts a
/// flushing task if fewer than [`Batch::IN_FLIGHT`] run.
///
/// Cancel safe in that a caller who gives up stops nobody else's call: the
/// batches run in their own task. Whether the dropped call's item was sent
/// is then unknown (each kind says what that leaves behind). Must be called
/// inside a Tokio runtime.
pub async fn call<B: Batch>(host: &Arc<B::Host>, item: B::Item) -> Result<B::Answer, BackendError> {
    let (reply, answer) = oneshot::channel();
    let start = {
        let mut state = B::lane(host).state();
        state.queued.push((item, reply));
        let start = state.flushers < B::IN_FLIGHT.max(1);
        if start {
            state.flushers += 1;
        }
        start
    };
    if start {
        let flusher = Flusher::<B> {
            host: Arc::clone(host),
            done: false,
        };
        tokio::spawn(flusher.run());
    }
    answer.await.unwrap_or_else(|_| {
        Err(BackendError::new(
            BackendErrorKind::Other,
            "the batch ended without an answer (the runtime is shutting down); try again",
        ))
    })
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
            let answers = B::run(&self.host, items).await;
            let answers = if answers.len() == replies.len() {
                answers
            } else {
                BackendError::new(
                    BackendErrorKind::Protocol,
                    format!(
                        "{} answers to a batch of {} calls",
                        answers.len(),
                        replies.len()
                    ),
                )
                .for_each(replies.len())
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
