//! [`Detachable`]: a backend call that runs to its end even if its caller
//! stops waiting, for backend implementations.
//!
//! Dropping the future of a call already sent does not take the call back:
//! the server may still act on it. A backend whose next step must know the
//! outcome (an unlock that ends a key's reservation, a put that would leave
//! a lock held by nobody) wraps the call in a [`Detachable`]. It is polled
//! in its caller's task while the caller waits, which costs no task and no
//! hand-over between threads when the call answers in time, as nearly all
//! do; if it is dropped before its end, the rest of the call goes on as a
//! task on the runtime it was made on, then the clean-up given with
//! [`Detachable::on_orphaned`] gets its outcome.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::runtime::Handle;
use tracing::warn;

type Run<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Orphaned<T> = Box<dyn FnOnce(T) -> Run<()> + Send>;

/// A call that runs to its end whether or not it is awaited to its end;
/// see the [module docs](self).
///
/// Awaiting it gives the call's outcome. Polled again after that, it stays
/// pending.
pub struct Detachable<T: Send + 'static> {
    /// `None` once it has answered.
    run: Option<Run<T>>,
    /// Where the rest runs if it is dropped first (it may be dropped on
    /// any thread, and the call uses this runtime's drivers).
    runtime: Option<Handle>,
    orphaned: Option<Orphaned<T>>,
    /// What the call was, for the warning if it is given up outside any
    /// runtime.
    what: &'static str,
}

impl<T: Send + 'static> Detachable<T> {
    /// Wraps `call`, described by `what` (for example "an unlock"), on the
    /// current runtime. Made outside any runtime, it cannot go on once
    /// dropped: it then warns, naming `what`.
    pub fn new(what: &'static str, call: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            run: Some(Box::pin(call)),
            runtime: Handle::try_current().ok(),
            orphaned: None,
            what,
        }
    }

    /// Runs `then` with the outcome if the call ends after it was dropped
    /// (only then: an awaited outcome goes to the caller).
    pub fn on_orphaned<F, Fut>(mut self, then: F) -> Self
    where
        F: FnOnce(T) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.orphaned = Some(Box::new(move |outcome| Box::pin(then(outcome))));
        self
    }
}

impl<T: Send + 'static> Future for Detachable<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // Every field is `Unpin`: the call itself is boxed.
        let this = self.get_mut();
        let Some(run) = this.run.as_mut() else {
            return Poll::Pending;
        };
        let outcome = run.as_mut().poll(cx);
        if outcome.is_ready() {
            this.run = None;
        }
        outcome
    }
}

impl<T: Send + 'static> Drop for Detachable<T> {
    fn drop(&mut self) {
        let Some(run) = self.run.take() else {
            return;
        };
        let Some(runtime) = self.runtime.take() else {
            warn!(
                call = self.what,
                "a call was given up outside a tokio runtime and cannot go on to its end"
            );
            return;
        };
        let orphaned = self.orphaned.take();
        drop(runtime.spawn(async move {
            let outcome = run.await;
            if let Some(then) = orphaned {
                then(outcome).await;
            }
        }));
    }
}

impl<T: Send + 'static> fmt::Debug for Detachable<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detachable")
            .field("what", &self.what)
            .field("ended", &self.run.is_none())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{oneshot, Notify};

    use super::*;

    /// Awaited to its end, it answers in place and its clean-up never runs.
    #[tokio::test]
    async fn awaited_call_answers_and_skips_the_clean_up() {
        let (tx, mut rx) = oneshot::channel::<u32>();
        let call = Detachable::new("a test call", async { 7 }).on_orphaned(move |n| async move {
            let _ = tx.send(n);
        });
        assert_eq!(call.await, 7);
        assert!(
            rx.try_recv().is_err(),
            "the clean-up ran for an awaited call"
        );
    }

    /// Dropped before its end, it goes on and its clean-up gets the outcome.
    #[tokio::test]
    async fn dropped_call_goes_on_and_its_clean_up_gets_the_outcome() {
        let gate = Arc::new(Notify::new());
        let open = Arc::clone(&gate);
        let (tx, rx) = oneshot::channel::<u32>();
        let mut call = Detachable::new("a test call", async move {
            open.notified().await;
            9
        })
        .on_orphaned(move |n| async move {
            let _ = tx.send(n);
        });
        let polled = futures_poll_once(&mut call).await;
        assert!(polled.is_none(), "the call answered before its gate opened");
        drop(call);
        gate.notify_one();
        assert_eq!(rx.await.ok(), Some(9));
    }

    /// Polls `f` once; `Some` if it answered.
    async fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            Poll::Ready(match Pin::new(&mut *f).poll(cx) {
                Poll::Ready(v) => Some(v),
                Poll::Pending => None,
            })
        })
        .await
    }
}
