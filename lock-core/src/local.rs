//! The in-process guard: names held or being acquired through one `Locker`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::LockName;

/// Names claimed through one `Locker`, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct LocalClaims {
    names: Mutex<HashSet<LockName, foldhash::fast::RandomState>>,
    freed: Notify,
    /// Acquires waiting for some local claim to go: a claim dropped while
    /// this is 0 wakes no one, and skips [`Notify::notify_waiters`].
    waiting: AtomicUsize,
}

impl LocalClaims {
    fn names(&self) -> MutexGuard<'_, HashSet<LockName, foldhash::fast::RandomState>> {
        // A panic while holding this lock cannot leave the set half-updated
        // (each operation is one insert or remove), so poisoning is ignored.
        self.names.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `name` for this process, or returns `None` if it is already claimed.
    pub(crate) fn claim(self: &Arc<Self>, name: &LockName) -> Option<LocalClaim> {
        self.names().insert(name.clone()).then(|| LocalClaim {
            claims: Arc::clone(self),
            name: name.clone(),
        })
    }

    /// Counts one waiting acquire until the returned guard is dropped. Take
    /// it before the first attempt to claim: a claim dropped after that
    /// attempt found the name taken then sees the count (the set's lock
    /// orders the two), so the wake-up cannot be skipped.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting { claims: self }
    }

    /// Resolves after some claim is dropped while a [`Waiting`] guard is
    /// held. Create it before checking, so a release in between is not missed.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }
}

/// One acquire waiting for local claims to be dropped.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    claims: &'a LocalClaims,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.claims.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A claimed name; dropping it frees the name and wakes local waiters.
#[derive(Debug)]
pub(crate) struct LocalClaim {
    claims: Arc<LocalClaims>,
    name: LockName,
}

impl Drop for LocalClaim {
    fn drop(&mut self) {
        self.claims.names().remove(&self.name);
        if self.claims.waiting.load(Ordering::SeqCst) > 0 {
            self.claims.freed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn name(text: &str) -> LockName {
        LockName::new(text).expect("a valid name")
    }

    #[test]
    fn a_dropped_claim_wakes_only_while_someone_waits() {
        let claims = Arc::new(LocalClaims::default());
        let mut cx = Context::from_waker(Waker::noop());

        let unwatched = claims.claim(&name("a")).expect("free");
        let mut missed = pin!(claims.freed());
        missed.as_mut().enable();
        drop(unwatched);
        assert_eq!(
            missed.as_mut().poll(&mut cx),
            Poll::Pending,
            "no one counted as waiting, so no wake-up was sent"
        );

        let held = claims.claim(&name("a")).expect("free again");
        let waiting = claims.waiting();
        let mut freed = pin!(claims.freed());
        freed.as_mut().enable();
        assert!(claims.claim(&name("a")).is_none(), "claimed twice");
        drop(held);
        assert_eq!(freed.as_mut().poll(&mut cx), Poll::Ready(()));
        drop(waiting);
        assert_eq!(claims.waiting.load(Ordering::SeqCst), 0);
    }
}
