//! A backend connection that can be cut, as a crashed process's is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    async_trait,
    backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest},
    BackendError, Capabilities, LockBackend, LockName, OwnerToken, TickStore,
};

/// Forwards every call until [`Severable::cut`]; after that every call
/// fails, so nothing the replica held is ever released or renewed again.
#[derive(Debug, Clone)]
pub(crate) struct Severable {
    locks: Arc<dyn LockBackend>,
    ticks: Arc<dyn TickStore>,
    cut: Arc<AtomicBool>,
}

impl Severable {
    pub(crate) fn new(locks: Arc<dyn LockBackend>, ticks: Arc<dyn TickStore>) -> Self {
        Self {
            locks,
            ticks,
            cut: Arc::default(),
        }
    }

    pub(crate) fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    fn gate(&self) -> Result<(), BackendError> {
        if self.cut.load(Ordering::SeqCst) {
            Err(BackendError::unavailable("this replica was killed"))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl LockBackend for Severable {
    fn capabilities(&self) -> Capabilities {
        self.locks.capabilities()
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.gate()?;
        self.locks.try_acquire(name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.gate()?;
        self.locks.renew(name, owner, ttl).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        self.gate()?;
        self.locks.check(name, owner).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.gate()?;
        self.locks.release(name, owner).await
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        self.gate()?;
        self.locks.renew_many(requests).await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        self.gate()?;
        self.locks.subscribe_release(name).await
    }
}

#[async_trait]
impl TickStore for Severable {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.gate()?;
        self.ticks.last_completed(job).await
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: std::time::Duration,
    ) -> Result<(), BackendError> {
        self.gate()?;
        self.ticks.record_completed(job, tick, keep).await
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        self.gate()?;
        self.ticks.is_completed(job, tick).await
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &lock_core::TickWrite,
        keep: std::time::Duration,
    ) -> Result<lock_core::TickAnswer, BackendError> {
        self.gate()?;
        self.ticks.write_tick(job, tick, write, keep).await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<lock_core::TickRecord>, BackendError> {
        self.gate()?;
        self.ticks.tick_record(job, tick).await
    }
}
