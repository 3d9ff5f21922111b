//! An etcd backend whose cluster did not answer at start.
//!
//! An etcd client built while its only endpoint refuses connections can
//! stay unable to send anything after the endpoint comes back (its gRPC
//! channel's load balancer may drop an endpoint whose first connect
//! failed), so a lazily built client is not enough here. Instead the
//! client is built only once the cluster answers: every call until then
//! makes sure a connection exists, one attempt at a time and not more
//! often than every [`RETRY_EVERY`], and fails as `unavailable` while none
//! does. A client that connected once keeps reconnecting by itself.
//!
//! What a `Locker` reads when it is built is right from the start: the
//! capabilities are those of the same builder's backend (its minimum TTL
//! the declared or default one, as a lazy start assumes), and etcd reports
//! no losses through a loss feed, so there is none to hand over.

use std::sync::OnceLock;
use std::time::Duration;

use lock_core::{
    async_trait, AcquireAttempt, BackendError, Capabilities, LeaseStatus, LockBackend, LockName,
    LossFeed, OwnerToken, ReleaseOutcome, ReleaseSignal, RenewRequest, TickStore,
};
use lock_etcd::{EtcdBackend, EtcdBuilder};
use tokio::time::Instant;
use tracing::{info, warn};

/// The least time between two connection attempts.
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(500);

/// An etcd backend that connects when its cluster first answers.
pub(super) struct DeferredEtcd {
    builder: EtcdBuilder,
    capabilities: Capabilities,
    shown: String,
    connected: OnceLock<EtcdBackend>,
    /// When the last attempt started; held while one runs (single flight).
    attempt: tokio::sync::Mutex<Option<Instant>>,
}

impl std::fmt::Debug for DeferredEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredEtcd")
            .field("url", &self.shown)
            .field("connected", &self.connected.get())
            .finish_non_exhaustive()
    }
}

impl DeferredEtcd {
    /// Wraps `builder`, whose cluster does not answer now; `capabilities`
    /// are those of its backend, `shown` its URL with credentials masked.
    pub(super) fn new(builder: EtcdBuilder, capabilities: Capabilities, shown: String) -> Self {
        // The probing connect must not raise the minimum TTL above the
        // capabilities already handed out; a cluster whose minimum is
        // higher grants longer leases than asked, which only delays a takeover.
        let builder = builder.with_min_ttl(capabilities.min_ttl);
        Self {
            builder,
            capabilities,
            shown,
            connected: OnceLock::new(),
            attempt: tokio::sync::Mutex::new(None),
        }
    }

    fn unavailable(&self, why: &str) -> BackendError {
        BackendError::unavailable(format!(
            "etcd at {} has not answered since the start ({why}); lock calls fail closed until it does",
            self.shown
        ))
    }

    /// The connected backend, connecting it if this call may try now.
    ///
    /// Cancel safe: a dropped attempt leaves at most a probe lease, which
    /// expires on its own.
    async fn backend(&self) -> Result<&EtcdBackend, BackendError> {
        if let Some(b) = self.connected.get() {
            return Ok(b);
        }
        // Another call is connecting: fail at once rather than queue behind it.
        let Ok(mut last) = self.attempt.try_lock() else {
            return Err(self.unavailable("a connection attempt is under way"));
        };
        if let Some(b) = self.connected.get() {
            return Ok(b);
        }
        if last.is_some_and(|at| at.elapsed() < RETRY_EVERY) {
            return Err(self.unavailable("the last attempt failed moments ago"));
        }
        *last = Some(Instant::now());
        let limit = self.builder.request_timeout();
        let backend = match tokio::time::timeout(limit, self.builder.clone().connect()).await {
            Ok(Ok(backend)) => backend,
            Ok(Err(e)) => {
                if !e.kind().is_unavailable() {
                    warn!(url = %self.shown, error = %e, "etcd answered but refused the connection");
                }
                return Err(e);
            }
            Err(_) => {
                return Err(BackendError::timeout(format!(
                    "connecting to etcd at {} took over {limit:?}",
                    self.shown
                )))
            }
        };
        info!(url = %self.shown, "etcd answers; lock calls go through from now on");
        Ok(self.connected.get_or_init(|| backend))
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl LockBackend for DeferredEtcd {
    fn capabilities(&self) -> Capabilities {
        self.capabilities.clone()
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.backend().await?.try_acquire(name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.backend().await?.renew(name, owner, ttl).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        self.backend().await?.check(name, owner).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        // Nothing can be held before the first connection: an unknown
        // owner's release is a harmless `NotHeld` by the trait's contract.
        match self.connected.get() {
            Some(b) => b.release(name, owner).await,
            None => Ok(ReleaseOutcome::NotHeld),
        }
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        self.backend().await?.renew_many(requests).await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        self.backend().await?.subscribe_release(name).await
    }

    fn loss_feed(&self) -> Option<LossFeed> {
        None
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl TickStore for DeferredEtcd {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.backend().await?.last_completed(job).await
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.backend()
            .await?
            .record_completed(job, tick, keep)
            .await
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        self.backend().await?.is_completed(job, tick).await
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        self.backend().await?.server_time().await
    }
}
