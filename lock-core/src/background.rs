//! A `Locker`'s background work, tracked so that shutdown can wait for it.

use std::future::Future;
use std::time::Duration;

use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::lease::deadline_after;

/// Every task a `Locker` spawns (its heartbeat, background releases, the ends
/// of retained holds) and the signal that shutdown has begun.
#[derive(Clone, Debug, Default)]
pub(crate) struct Background {
    tasks: TaskTracker,
    closing: CancellationToken,
}

impl Background {
    /// Runs `work` on the current runtime as one of this `Locker`'s tasks.
    pub(crate) fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(work);
    }

    /// Runs `work` on `runtime` as one of this `Locker`'s tasks (from `Drop`,
    /// where the caller has checked that a runtime exists).
    pub(crate) fn spawn_on(
        &self,
        work: impl Future<Output = ()> + Send + 'static,
        runtime: &tokio::runtime::Handle,
    ) {
        self.tasks.spawn_on(work, runtime);
    }

    /// Whether shutdown has begun.
    pub(crate) fn is_closing(&self) -> bool {
        self.closing.is_cancelled()
    }

    /// Completes when shutdown begins.
    pub(crate) async fn closing(&self) {
        self.closing.cancelled().await;
    }

    /// Begins shutdown and waits up to `deadline` for every task to end.
    /// Returns how many were still running then (0: all done).
    pub(crate) async fn close(&self, deadline: Duration) -> usize {
        self.closing.cancel();
        self.tasks.close();
        let wait = self.tasks.wait();
        match deadline_after(Instant::now(), deadline) {
            Some(at) => match timeout_at(at, wait).await {
                Ok(()) => 0,
                Err(_) => self.tasks.len().max(1),
            },
            None => {
                wait.await;
                0
            }
        }
    }
}
