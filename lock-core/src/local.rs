//! The in-process guard: names held or being acquired through one `Locker`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::LockName;

/// Names claimed through one `Locker`, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct LocalClaims {
    names: Mutex<HashSet<LockName, foldhash::fast::RandomState>>,
    freed: Notify,
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

    /// Resolves after some claim is dropped. Create it before checking, so a
    /// release in between is not missed.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
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
        self.claims.freed.notify_waiters();
    }
}
