//! An acquire whose caller stops waiting still runs to its answer, and a
//! key it put is then deleted.
//!
//! Dropping the future of a sent transaction does not take it back: etcd
//! may apply the put after the caller has gone, and after the release the
//! caller's `Locker` sends to clean up (two calls on one channel are
//! separate streams, proposed to raft in whatever order the server's
//! goroutines reach it). Such a key sits on the shared lease, which every
//! other lock of the TTL keeps alive: held by nobody, for as long as this
//! process holds any lock. So the acquire is polled in its caller's task
//! while the caller waits (no task, no hand-over, as nearly all calls end
//! that way), and handed to a task of its own if the caller's future is
//! dropped first; that task deletes the key if the acquire took it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use lock_core::{backend::AcquireAttempt, BackendError, LockBackend, LockName, OwnerToken};
use tokio::runtime::Handle;
use tracing::{debug, warn};

use crate::connection::Connected;

type Run = Pin<Box<dyn Future<Output = Result<AcquireAttempt, BackendError>> + Send>>;

/// An acquire of `name` for `owner` that ends even if its caller goes.
pub(crate) struct Acquiring {
    /// `None` once it has answered.
    run: Option<Run>,
    /// Where the rest runs if the caller goes (its future may be dropped on
    /// any thread), and what it undoes then.
    runtime: Option<Handle>,
    backend: Connected,
    name: LockName,
    owner: OwnerToken,
}

impl Acquiring {
    pub(crate) fn new(backend: &Connected, name: &LockName, owner: OwnerToken, run: Run) -> Self {
        Self {
            run: Some(run),
            runtime: Handle::try_current().ok(),
            backend: backend.clone(),
            name: name.clone(),
            owner,
        }
    }
}

impl Future for Acquiring {
    type Output = Result<AcquireAttempt, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Every field is `Unpin`: the acquire itself is boxed.
        let this = self.get_mut();
        let Some(run) = this.run.as_mut() else {
            return Poll::Ready(Err(BackendError::new(
                lock_core::BackendErrorKind::Other,
                "acquire polled after it answered",
            )));
        };
        let answer = run.as_mut().poll(cx);
        if answer.is_ready() {
            this.run = None;
        }
        answer
    }
}

impl Drop for Acquiring {
    fn drop(&mut self) {
        let Some(run) = self.run.take() else {
            return;
        };
        let (backend, name, owner) = (self.backend.clone(), self.name.clone(), self.owner);
        let Some(runtime) = self.runtime.take() else {
            // Not reached: it is made on the first poll of `try_acquire`,
            // inside the runtime whose drivers its calls use.
            warn!(lock = %name, "an acquire was abandoned outside a tokio runtime; a key it put goes with its shared lease");
            return;
        };
        drop(runtime.spawn(async move {
            // An error was handled inside (a put whose answer is lost is
            // kept to delete); only a granted lock is left to undo.
            if let Ok(AcquireAttempt::Acquired(_)) = run.await {
                match LockBackend::release(&backend, &name, &owner).await {
                    Ok(_) => {
                        debug!(lock = %name, "deleted the key an acquire put after its caller had gone");
                    }
                    Err(e) => {
                        warn!(lock = %name, error = %e, "an acquire answered after its caller had gone and its key could not be deleted; it is kept to delete");
                    }
                }
            }
        }));
    }
}
