//! Hooks for the conformance suite, behind the `test-util` feature: what a
//! test must see or steer that the public API rightly hides.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, LockName};

use crate::{AdvisoryKey, PostgresBackend};

/// Faults armed per key, consumed by the unlocks they hit.
#[derive(Debug, Default)]
pub(crate) struct Faults(Mutex<HashMap<AdvisoryKey, Armed>>);

#[derive(Debug, Default, Clone, Copy)]
struct Armed {
    /// The next release's caller stops waiting for the unlock at once.
    stall_release: bool,
    /// How many unlock statements fail before reaching the server.
    failing_unlocks: usize,
    /// How long the next unlock statement waits before it is sent.
    unlock_delay: Option<Duration>,
}

impl Faults {
    fn map(&self) -> MutexGuard<'_, HashMap<AdvisoryKey, Armed>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long the caller of a release of `key` waits for its unlock:
    /// `limit`, or zero once if a stall is armed.
    pub(crate) fn release_wait(&self, key: AdvisoryKey, limit: Duration) -> Duration {
        match self.map().get_mut(&key) {
            Some(a) if a.stall_release => {
                a.stall_release = false;
                Duration::ZERO
            }
            _ => limit,
        }
    }

    /// How long the next unlock of `key` waits before it is sent, consumed.
    pub(crate) fn unlock_delay(&self, key: AdvisoryKey) -> Option<Duration> {
        self.map().get_mut(&key)?.unlock_delay.take()
    }

    /// The error an armed unlock of `key` fails with, consuming one.
    pub(crate) fn unlock_error(&self, key: AdvisoryKey) -> Option<BackendError> {
        let mut map = self.map();
        let a = map.get_mut(&key)?;
        if a.failing_unlocks == 0 {
            return None;
        }
        a.failing_unlocks -= 1;
        Some(BackendError::new(
            lock_core::BackendErrorKind::Other,
            "releasing an advisory lock: failure injected by the test-util hook",
        ))
    }
}

impl PostgresBackend {
    /// The `bigint` advisory lock this backend's listener holds shared
    /// while it waits for `name` (releases announce only while one is held).
    pub fn release_wait_marker(&self, name: &LockName) -> i64 {
        crate::notify::wait_marker(self.inner.config.key_for(name))
    }

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

    /// The next release of `name` through this backend stops waiting for
    /// its unlock at once and reports the client-side timeout a slow server
    /// causes, while the unlock statement itself still goes to the server.
    pub fn stall_next_release(&self, name: &LockName) {
        let key = self.inner.config.key_for(name);
        self.inner
            .faults
            .map()
            .entry(key)
            .or_default()
            .stall_release = true;
    }

    /// The next unlock statement for `name` waits `by` before it is sent,
    /// as on a slow server.
    pub fn delay_next_unlock(&self, name: &LockName, by: Duration) {
        let key = self.inner.config.key_for(name);
        self.inner.faults.map().entry(key).or_default().unlock_delay = Some(by);
    }

    /// The next `attempts` unlock statements for `name` fail without
    /// reaching the server.
    pub fn fail_next_unlocks(&self, name: &LockName, attempts: usize) {
        let key = self.inner.config.key_for(name);
        self.inner
            .faults
            .map()
            .entry(key)
            .or_default()
            .failing_unlocks = attempts;
    }
}
