//! A pass-through backend that records every renewal call, so the benchmark
//! can count round trips per heartbeat sweep.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{
    AcquireAttempt, BackendError, Capabilities, LeaseStatus, LockBackend, LockName, OwnerToken,
    ReleaseOutcome, ReleaseSignal, RenewRequest,
};
use tokio::time::Instant;

/// One renewal round trip: when it started and ended, and how many leases it carried.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewCall {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    pub(crate) leases: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct CountingBackend {
    inner: Arc<dyn LockBackend>,
    calls: Arc<Mutex<Vec<RenewCall>>>,
}

impl CountingBackend {
    pub(crate) fn new(inner: Arc<dyn LockBackend>) -> Self {
        Self {
            inner,
            calls: Arc::default(),
        }
    }

    pub(crate) fn renew_calls(&self) -> Vec<RenewCall> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }

    fn record(&self, start: Instant, leases: usize) {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(RenewCall {
                start,
                end: Instant::now(),
                leases,
            });
        }
    }
}

#[async_trait]
impl LockBackend for CountingBackend {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.inner.try_acquire(name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let start = Instant::now();
        let r = self.inner.renew(name, owner, ttl).await;
        self.record(start, 1);
        r
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        self.inner.check(name, owner).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.inner.release(name, owner).await
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let start = Instant::now();
        let r = self.inner.renew_many(requests).await;
        self.record(start, requests.len());
        r
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        self.inner.subscribe_release(name).await
    }
}
