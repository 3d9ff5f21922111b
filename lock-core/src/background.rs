//! A `Locker`'s background work, tracked so that shutdown can wait for it.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc::{self, UnboundedSender};
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::lease::deadline_after;
use crate::lease::retention::{self, Retained};

/// Every task a `Locker` spawns (its heartbeat, background releases, the task
/// that ends retained holds) and the signal that shutdown has begun.
///
/// Every lease keeps a clone, so a clone is one reference count (cloning a
/// cancellation token takes a lock), and asking whether shutdown has begun,
/// which every acquire does twice, reads a flag.
#[derive(Clone, Debug, Default)]
pub(crate) struct Background {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    tasks: TaskTracker,
    closing: CancellationToken,
    /// Set before `closing` is cancelled, never cleared.
    closed: AtomicBool,
    /// Hands retained leases to the task that ends their holds; `None`
    /// until the first hold.
    retained: Mutex<Option<UnboundedSender<Retained>>>,
}

impl Background {
    /// Runs `work` on the current runtime as one of this `Locker`'s tasks.
    pub(crate) fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        self.inner.tasks.spawn(work);
    }

    /// Runs `work` on `runtime` as one of this `Locker`'s tasks (from `Drop`,
    /// where the caller has checked that a runtime exists).
    pub(crate) fn spawn_on(
        &self,
        work: impl Future<Output = ()> + Send + 'static,
        runtime: &tokio::runtime::Handle,
    ) {
        self.inner.tasks.spawn_on(work, runtime);
    }

    /// Has the lease in `hold` ended when its hold is over, by this
    /// `Locker`'s retention task, started here on the first hold (or again
    /// if the runtime that ran it has gone).
    pub(crate) fn end_retained(&self, hold: Retained) {
        let mut slot = self
            .inner
            .retained
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let hold = match slot.as_ref() {
            Some(tx) => match tx.send(hold) {
                Ok(()) => return,
                Err(mpsc::error::SendError(hold)) => hold,
            },
            None => hold,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        // Cannot fail: `rx` is alive.
        let _ = tx.send(hold);
        *slot = Some(tx);
        self.spawn(retention::run(rx, self.inner.closing.clone()));
    }

    /// Whether shutdown has begun.
    #[inline]
    pub(crate) fn is_closing(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Completes when shutdown begins.
    pub(crate) async fn closing(&self) {
        self.inner.closing.cancelled().await;
    }

    /// Begins shutdown and waits up to `deadline` for every task to end.
    /// Returns how many were still running then (0: all done).
    pub(crate) async fn close(&self, deadline: Duration) -> usize {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.closing.cancel();
        self.inner.tasks.close();
        let wait = self.inner.tasks.wait();
        match deadline_after(Instant::now(), deadline) {
            Some(at) => match timeout_at(at, wait).await {
                Ok(()) => 0,
                Err(_) => self.inner.tasks.len().max(1),
            },
            None => {
                wait.await;
                0
            }
        }
    }
}
