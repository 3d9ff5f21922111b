//! What the lock-core integration tests share: the bound each paused-clock
//! test runs under and a locker on a registry of its own.

use std::time::Duration;

use lock_core::{LockBackend, Locker};
use prometheus::Registry;

/// A bound on each test, in the paused clock's time: a heartbeat that
/// stopped waking, or a deadline nobody watches, lets the test run out
/// instead of hanging.
pub(crate) const BOUND: Duration = Duration::from_secs(600);

/// A locker on `backend` (a clone, sharing its locks and hooks) with a fresh
/// registry, so one test's metrics never count another's.
pub(crate) fn locker<B: LockBackend + Clone + 'static>(backend: &B) -> Locker {
    Locker::builder()
        .with_backend(backend.clone())
        .with_registry(&Registry::new())
        .build()
        .expect("a fresh registry takes the metrics")
}
