//! A fault-injecting wrapper backend: counts calls, fails or stalls on demand.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{
    backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest},
    BackendError, Capabilities, LockBackend, LockName, OwnerToken,
};
use tokio::time::Instant;

/// What the wrapper does with each call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Pass calls through.
    None = 0,
    /// Fail every call at once with an `Unavailable` error (connection refused).
    Down = 1,
    /// Let acquires through, but stall renewals until `stall` passes and then
    /// time out, as a paused server behind an operation timeout would.
    StallRenewals = 2,
    /// Let acquires through, but refuse renewals and checks with a
    /// configuration error (as a detected pooler or a revoked ACL would).
    RefuseRenewals = 3,
    /// Let everything through, but hold each release for `stall` first, as
    /// a slow server would.
    StallReleases = 4,
    /// Let everything through, but answer every check with `Expired`
    /// without asking the server, as if the lease had just ended there.
    ChecksExpire = 5,
    /// Let everything through, but answer every renewal with `Expired`
    /// without asking the server, as a server that lost the lease's record
    /// (a failover, a stale replica) would, while the key may still be there.
    RenewalsExpire = 6,
}

/// One renewal round trip: when it started and ended, and how many leases it carried.
#[derive(Debug, Clone, Copy)]
pub struct RenewCall {
    /// When the call was made.
    pub start: Instant,
    /// When it returned.
    pub end: Instant,
    /// How many leases it renewed.
    pub leases: usize,
}

/// Which kind of backend call, for [`FaultyBackend::calls_of`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `try_acquire`.
    Acquire = 0,
    /// `renew` and `renew_many` (one call each, however many leases).
    Renew = 1,
    /// `check`.
    Check = 2,
    /// `release`.
    Release = 3,
    /// `subscribe_release`.
    Subscribe = 4,
}

/// Wraps a backend, counting calls, logging renewals and injecting
/// [`Fault`]s. Clones share state.
#[derive(Debug, Clone)]
pub struct FaultyBackend {
    inner: Arc<dyn LockBackend>,
    fault: Arc<AtomicU8>,
    calls: Arc<AtomicU64>,
    by_kind: Arc<[AtomicU64; 5]>,
    renewals: Arc<Mutex<Vec<RenewCall>>>,
    stall: Duration,
}

impl FaultyBackend {
    /// Wraps `inner`, healthy at first; stalled renewals give up after `stall`.
    pub fn new(inner: Arc<dyn LockBackend>, stall: Duration) -> Self {
        Self {
            inner,
            fault: Arc::new(AtomicU8::new(Fault::None as u8)),
            calls: Arc::new(AtomicU64::new(0)),
            by_kind: Arc::default(),
            renewals: Arc::default(),
            stall,
        }
    }

    /// Switches the fault.
    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::SeqCst);
    }

    /// How many backend calls went through the wrapper.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// How many calls of `kind` went through the wrapper.
    pub fn calls_of(&self, kind: CallKind) -> u64 {
        self.by_kind[kind as usize].load(Ordering::SeqCst)
    }

    /// Every renewal round trip so far (`renew` and `renew_many`).
    pub fn renew_calls(&self) -> Vec<RenewCall> {
        self.renewals.lock().map(|c| c.clone()).unwrap_or_default()
    }

    fn log_renewal(&self, start: Instant, leases: usize) {
        if let Ok(mut log) = self.renewals.lock() {
            log.push(RenewCall {
                start,
                end: Instant::now(),
                leases,
            });
        }
    }

    fn fault(&self) -> Fault {
        match self.fault.load(Ordering::SeqCst) {
            1 => Fault::Down,
            2 => Fault::StallRenewals,
            3 => Fault::RefuseRenewals,
            4 => Fault::StallReleases,
            5 => Fault::ChecksExpire,
            6 => Fault::RenewalsExpire,
            _ => Fault::None,
        }
    }

    async fn gate(&self, kind: CallKind) -> Result<(), BackendError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.by_kind[kind as usize].fetch_add(1, Ordering::SeqCst);
        // Checks read the lease as renewals do, so renewal faults hit them too.
        let is_renewal = matches!(kind, CallKind::Renew | CallKind::Check);
        match self.fault() {
            Fault::None => Ok(()),
            Fault::Down => Err(BackendError::unavailable("injected: connection refused")),
            Fault::StallRenewals if is_renewal => {
                tokio::time::sleep(self.stall).await;
                Err(BackendError::timeout(
                    "injected: no answer within the operation timeout",
                ))
            }
            Fault::StallRenewals | Fault::RefuseRenewals | Fault::StallReleases if !is_renewal => {
                Ok(())
            }
            Fault::RefuseRenewals => Err(BackendError::new(
                lock_core::BackendErrorKind::Config,
                "injected: the server refuses this session",
            )),
            Fault::StallRenewals
            | Fault::StallReleases
            | Fault::ChecksExpire
            | Fault::RenewalsExpire => Ok(()),
        }
    }
}

#[async_trait]
impl LockBackend for FaultyBackend {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.gate(CallKind::Acquire).await?;
        self.inner.try_acquire(name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let start = Instant::now();
        self.gate(CallKind::Renew).await?;
        if self.fault() == Fault::RenewalsExpire {
            return Ok(LeaseStatus::Expired);
        }
        let answer = self.inner.renew(name, owner, ttl).await;
        self.log_renewal(start, 1);
        answer
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        self.gate(CallKind::Check).await?;
        if self.fault() == Fault::ChecksExpire {
            return Ok(LeaseStatus::Expired);
        }
        self.inner.check(name, owner).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.gate(CallKind::Release).await?;
        if self.fault() == Fault::StallReleases {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.release(name, owner).await
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let start = Instant::now();
        self.gate(CallKind::Renew).await?;
        if self.fault() == Fault::RenewalsExpire {
            return Ok(vec![LeaseStatus::Expired; requests.len()]);
        }
        let answer = self.inner.renew_many(requests).await;
        self.log_renewal(start, requests.len());
        answer
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        self.gate(CallKind::Subscribe).await?;
        self.inner.subscribe_release(name).await
    }

    fn loss_feed(&self) -> Option<lock_core::backend::LossFeed> {
        self.inner.loss_feed()
    }
}
