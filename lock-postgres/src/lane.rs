//! Lanes: the calls of one kind on one lock session are sent at once while
//! fewer than [`IN_FLIGHT`] statements of that kind are in flight; past
//! that they wait, and go together as one statement as soon as one answers.
//!
//! Why: the end of every statement walks all the locks its session holds
//! (see `sessions`), so a thousand calls sent one statement each pay that
//! walk a thousand times. A few statements in flight keep a lightly loaded
//! session pipelined, so a lone call waits for nothing. There is no linger
//! timer: the batch size follows the load.
//!
//! A call is answered by a statement sent after the call was made, never
//! by one already in flight: a liveness proof must be younger than the
//! renewal that asked for it.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{BackendError, BackendErrorKind};
use tokio::sync::oneshot;

use crate::session::LockSession;

/// The most calls one statement carries; a longer queue goes in several.
const MAX_BATCH: usize = 1000;

/// The most statements of one kind in flight on one session.
pub(crate) const IN_FLIGHT: usize = 4;

/// One kind of call that can go many to a statement.
pub(crate) trait Batch: Sized + Send + Sync + 'static {
    /// One call's input. It is dropped only after its statement answered
    /// or failed (or when it was never sent).
    type Item: Send + 'static;
    /// One call's answer.
    type Answer: Send + 'static;

    /// This kind's lane on `session`.
    fn lane(session: &LockSession) -> &Lane<Self>;

    /// One statement for `items`: one answer per item, in order.
    fn run(
        session: &LockSession,
        items: &[Self::Item],
    ) -> impl Future<Output = Result<Vec<Self::Answer>, BackendError>> + Send;
}

type Reply<B> = oneshot::Sender<Result<<B as Batch>::Answer, BackendError>>;

/// The calls of one kind on one session: those queued, and how many
/// flushers send them.
pub(crate) struct Lane<B: Batch> {
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
}

/// Queues `item` in `B`'s lane on `session` and waits for its answer;
/// starts a flushing task if fewer than [`IN_FLIGHT`] run.
///
/// Not cancel safe in general: the statement goes on without a caller that
/// gives up (each kind says what that leaves behind).
pub(crate) async fn call<B: Batch>(
    session: &Arc<LockSession>,
    item: B::Item,
) -> Result<B::Answer, BackendError> {
    let (reply, answer) = oneshot::channel();
    let start = {
        let mut state = B::lane(session).state();
        state.queued.push((item, reply));
        let start = state.flushers < IN_FLIGHT;
        if start {
            state.flushers += 1;
        }
        start
    };
    if start {
        let flusher = Flusher::<B> {
            session: Arc::clone(session),
            kind: PhantomData,
            done: false,
        };
        // Its own task: a caller that gives up does not stop the others'.
        tokio::spawn(flusher.run());
    }
    answer.await.unwrap_or_else(|_| {
        Err(BackendError::new(
            BackendErrorKind::Other,
            "the statement ended without an answer; try again",
        ))
    })
}

/// Sends a lane's queued calls, statement after statement, until none is
/// left; dropped midway (the runtime going away), it leaves the lane, and
/// the last one to leave drops the queued calls, which get an error.
struct Flusher<B: Batch> {
    session: Arc<LockSession>,
    kind: PhantomData<B>,
    /// Set once it found the queue empty and left the lane itself.
    done: bool,
}

impl<B: Batch> Flusher<B> {
    async fn run(mut self) {
        // Ends when the queue is empty; every round answers at least one
        // queued call, and calls only queue while their callers wait.
        loop {
            let batch: Vec<(B::Item, Reply<B>)> = {
                let mut state = B::lane(&self.session).state();
                if state.queued.is_empty() {
                    state.flushers = state.flushers.saturating_sub(1);
                    self.done = true;
                    return;
                }
                let take = state.queued.len().min(MAX_BATCH);
                state.queued.drain(..take).collect()
            };
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let answers = B::run(&self.session, &items).await;
            // The items go only now that their statement has answered.
            drop(items);
            let mut answers = match answers {
                Ok(all) if all.len() == replies.len() => all.into_iter().map(Ok).collect(),
                Ok(all) => BackendError::new(
                    BackendErrorKind::Protocol,
                    format!(
                        "{} answers to a statement of {} calls",
                        all.len(),
                        replies.len()
                    ),
                )
                .for_each(replies.len()),
                Err(e) => e.for_each(replies.len()),
            }
            .into_iter();
            for reply in replies {
                if let Some(answer) = answers.next() {
                    // A caller that gave up no longer listens.
                    let _ = reply.send(answer);
                }
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
        let mut state = B::lane(&self.session).state();
        state.flushers = state.flushers.saturating_sub(1);
        if state.flushers == 0 {
            state.queued.clear();
        }
    }
}
