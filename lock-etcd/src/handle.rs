//! [`EtcdBackend`]: the public backend, connected now or on first use.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    async_trait,
    backend::{AcquireAttempt, LeaseStatus, LossFeed, ReleaseOutcome, ReleaseSignal, RenewRequest},
    BackendError, Capabilities, ForceOutcome, Holder, HolderPage, Identity, LockBackend, LockName,
    OwnerToken, StartCheck, StartVerdict, TickAnswer, TickRecord, TickStore, TickWrite,
};

use crate::connection::{key_in, Connected};
use crate::deferred::Deferred;
use crate::EtcdBuilder;

/// A lock backend over an etcd v3 cluster: one lease per TTL shared by the
/// instance's locks, a put-if-absent transaction to acquire, the key's create revision as the
/// fencing token. Cloning is cheap and clones share the connection.
///
/// Made by [`EtcdBuilder::connect`] (connected and measured now) or
/// [`EtcdBuilder::build`] (connects when the cluster first answers; every
/// call fails closed as `unavailable` until then). See the
/// [crate documentation](crate) for the guarantees and limits.
///
/// # Examples
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use lock_core::{LockName, LockOptions, Locker};
/// use lock_etcd::EtcdBuilder;
///
/// let backend = EtcdBuilder::from_env()?.connect().await?;
/// let locker = Locker::new(backend)?;
/// let opts = LockOptions::new(Duration::from_secs(10));
/// let guard = locker.try_lock(&LockName::new("reports/daily")?, &opts).await?;
/// // … write with guard.fencing_token() …
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Ready(Connected),
    Deferred(Arc<Deferred>),
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Ready(c) => c.fmt(f),
            Kind::Deferred(d) => d.fmt(f),
        }
    }
}

impl EtcdBackend {
    /// A builder; see [`EtcdBuilder`].
    pub fn builder() -> EtcdBuilder {
        EtcdBuilder::new()
    }

    pub(crate) fn ready(connected: Connected) -> Self {
        Self {
            kind: Kind::Ready(connected),
        }
    }

    pub(crate) fn deferred(deferred: Deferred) -> Self {
        Self {
            kind: Kind::Deferred(Arc::new(deferred)),
        }
    }

    /// The connected backend, if the cluster has answered.
    fn connected(&self) -> Option<&Connected> {
        match &self.kind {
            Kind::Ready(c) => Some(c),
            Kind::Deferred(d) => d.connected(),
        }
    }

    /// The connected backend, connecting a deferred one if it may try now
    /// (else an `unavailable` error: calls fail closed until the cluster
    /// answers). Cancel safe.
    async fn backend(&self) -> Result<&Connected, BackendError> {
        match &self.kind {
            Kind::Ready(c) => Ok(c),
            Kind::Deferred(d) => d.backend().await,
        }
    }

    /// The shortest TTL this backend accepts: the cluster's minimum lease
    /// TTL in whole seconds, measured by [`EtcdBuilder::connect`], or the
    /// declared one (else 2 s) for a backend made by [`EtcdBuilder::build`],
    /// before and after it connects.
    pub fn min_ttl(&self) -> Duration {
        match &self.kind {
            Kind::Ready(c) => c.min_ttl(),
            Kind::Deferred(d) => d.capabilities().min_ttl,
        }
    }

    /// The etcd key that holds the lock `name`.
    pub fn key_for(&self, name: &LockName) -> String {
        match &self.kind {
            Kind::Ready(c) => c.key_for(name),
            Kind::Deferred(d) => key_in(&d.builder().prefix, name),
        }
    }

    /// Test hook: the next renewal of this instance (single or batch) that
    /// has sent its keep-alives stops before it reads the keys, until the
    /// returned pause is resumed or dropped. `None` while a backend made by
    /// [`EtcdBuilder::build`] has not connected yet.
    #[cfg(feature = "test-util")]
    pub fn pause_next_renewal_before_read(&self) -> Option<crate::Pause> {
        self.connected()
            .map(Connected::pause_next_renewal_before_read)
    }

    /// Test hook (feature `test-util`): the next acquire of `name` on this
    /// instance that has put its key and proven its shared lease alive
    /// stops before it records the hold and answers, until the returned
    /// pause is resumed or dropped. `None` while a backend made by
    /// [`EtcdBuilder::build`] has not connected yet.
    #[cfg(feature = "test-util")]
    pub fn pause_next_acquire_before_record(&self, name: &LockName) -> Option<crate::Pause> {
        self.connected()
            .map(|c| c.pause_next_acquire_before_record(name))
    }

    /// Test hook (feature `test-util`): the next acquire of `name` on this
    /// instance that has recorded its hold stops before it looks at its
    /// shared lease again and answers, until the returned pause is resumed
    /// or dropped. `None` while a backend made by [`EtcdBuilder::build`] has
    /// not connected yet.
    #[cfg(feature = "test-util")]
    pub fn pause_next_acquire_after_record(&self, name: &LockName) -> Option<crate::Pause> {
        self.connected()
            .map(|c| c.pause_next_acquire_after_record(name))
    }

    /// Test hook (feature `test-util`): the put of the next acquire of
    /// `name` reaches the server `by` later, even if the acquire's caller
    /// has gone by then, as a request already sent does. Returns false if
    /// the backend has not connected yet.
    #[cfg(feature = "test-util")]
    pub fn delay_next_put(&self, name: &LockName, by: std::time::Duration) -> bool {
        self.connected()
            .map(|c| c.delay_next_put(name, by))
            .is_some()
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl LockBackend for EtcdBackend {
    fn capabilities(&self) -> Capabilities {
        match &self.kind {
            Kind::Ready(c) => c.capabilities(),
            Kind::Deferred(d) => d.capabilities(),
        }
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
        match self.connected() {
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

    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.backend()
            .await?
            .try_acquire_as(name, owner, ttl, holder)
            .await
    }

    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        self.backend().await?.describe(name).await
    }

    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        self.backend().await?.list(prefix, cursor, limit).await
    }

    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        self.backend()
            .await?
            .force_release(name, expected_token)
            .await
    }

    fn loss_feed(&self) -> Option<LossFeed> {
        // Read once, when a `Locker` is built: a deferred backend's feed
        // exists before its connection, which reports through it.
        Some(match &self.kind {
            Kind::Ready(c) => c.feed(),
            Kind::Deferred(d) => d.feed(),
        })
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl TickStore for EtcdBackend {
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

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        self.backend()
            .await?
            .write_tick(job, tick, write, keep)
            .await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        self.backend().await?.tick_record(job, tick).await
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        match self.backend().await {
            Ok(b) => b.write_ticks_many(writes, keep).await,
            Err(e) => e.for_each(writes.len()),
        }
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        self.backend().await?.server_time().await
    }

    /// `false`, as the connected store says: etcd's tick store reads the
    /// checks apart (the answer is needed before any connection exists).
    fn checks_starts_in_one_step(&self) -> bool {
        false
    }

    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        match self.backend().await {
            Ok(b) => b.start_checked_many(starts, keep).await,
            Err(e) => e.for_each(starts.len()),
        }
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        match self.backend().await {
            Ok(b) => b.last_completed_many(jobs).await,
            Err(e) => e.for_each(jobs.len()),
        }
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        match self.backend().await {
            Ok(b) => b.is_completed_many(ticks).await,
            Err(e) => e.for_each(ticks.len()),
        }
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        match self.backend().await {
            Ok(b) => b.record_completed_many(ticks, keep).await,
            Err(e) => e.for_each(ticks.len()),
        }
    }
}
