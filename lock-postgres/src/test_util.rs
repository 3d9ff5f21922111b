//! Hooks for the conformance suite, behind the `test-util` feature: what a
//! test must see or steer that the public API rightly hides.

use crate::PostgresBackend;

impl PostgresBackend {
    /// How many lock keys have release waiters registered on this backend's
    /// listening connection: it must stay O(live waiters), however many
    /// waits timed out or were cancelled.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn release_waiter_keys(&self) -> usize {
        self.inner.listener.waiting_keys().await
    }
}
