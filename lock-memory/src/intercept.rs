//! Test hook: the memory backend with some of its calls changed, for tests
//! that need a backend which stalls, counts, refuses or shortens something.
//! A test writes only the calls it changes; every other one is the memory
//! backend's own.

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::backend::{
    AcquireAttempt, LeaseStatus, LossFeed, ReleaseOutcome, ReleaseSignal, RenewRequest,
};
use lock_core::{
    async_trait, BackendError, BackendErrorKind, Capabilities, ForceOutcome, Holder, HolderPage,
    Identity, LockBackend, LockName, OwnerToken,
};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::MemoryBackend;

/// The calls of a [`LockBackend`] that a test may change, each given the
/// memory backend underneath. Every method defaults to that backend's own
/// answer, so an implementation overrides only what its test is about.
#[async_trait]
pub trait Intercept: fmt::Debug + Send + Sync + 'static {
    /// As [`LockBackend::capabilities`].
    fn capabilities(&self, inner: &MemoryBackend) -> Capabilities {
        inner.capabilities()
    }

    /// Awaited before each acquire, renewal, check, release and batch
    /// renewal, ahead of that call's own hook: for a test that holds every
    /// call to the server alike, as a frozen process's are held. Returns at
    /// once by default.
    async fn before_call(&self) {}

    /// As [`LockBackend::try_acquire`].
    async fn try_acquire(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        inner.try_acquire(name, owner, ttl).await
    }

    /// As [`LockBackend::renew`].
    async fn renew(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        inner.renew(name, owner, ttl).await
    }

    /// As [`LockBackend::check`].
    async fn check(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        inner.check(name, owner).await
    }

    /// As [`LockBackend::release`].
    async fn release(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        inner.release(name, owner).await
    }

    /// As [`LockBackend::renew_many`].
    async fn renew_many(
        &self,
        inner: &MemoryBackend,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        inner.renew_many(requests).await
    }

    /// As [`LockBackend::subscribe_release`].
    async fn subscribe_release(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        inner.subscribe_release(name).await
    }

    /// As [`LockBackend::loss_feed`].
    fn loss_feed(&self, inner: &MemoryBackend) -> Option<LossFeed> {
        inner.loss_feed()
    }
}

/// A [`MemoryBackend`] whose calls go through `H` first. Clones share the
/// locks and the hooks; it dereferences to the hooks, so a test reads its
/// counters and flips its switches on the backend it handed out.
#[derive(Debug, Default)]
pub struct Intercepted<H> {
    inner: MemoryBackend,
    hooks: Arc<H>,
}

impl<H> Clone for Intercepted<H> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            hooks: Arc::clone(&self.hooks),
        }
    }
}

impl<H: Intercept> Intercepted<H> {
    /// A fresh memory backend behind `hooks`.
    pub fn new(hooks: H) -> Self {
        Self::over(MemoryBackend::default(), hooks)
    }

    /// `inner` (and every clone of it) behind `hooks`.
    pub fn over(inner: MemoryBackend, hooks: H) -> Self {
        Self {
            inner,
            hooks: Arc::new(hooks),
        }
    }

    /// The memory backend underneath, unchanged by the hooks.
    pub fn memory(&self) -> &MemoryBackend {
        &self.inner
    }
}

impl<H> Deref for Intercepted<H> {
    type Target = H;

    fn deref(&self) -> &H {
        &self.hooks
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<H: Intercept> LockBackend for Intercepted<H> {
    fn capabilities(&self) -> Capabilities {
        self.hooks.capabilities(&self.inner)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.hooks.before_call().await;
        self.hooks.try_acquire(&self.inner, name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.hooks.before_call().await;
        self.hooks.renew(&self.inner, name, owner, ttl).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        self.hooks.before_call().await;
        self.hooks.check(&self.inner, name, owner).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.hooks.before_call().await;
        self.hooks.release(&self.inner, name, owner).await
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        self.hooks.before_call().await;
        self.hooks.renew_many(&self.inner, requests).await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        self.hooks.subscribe_release(&self.inner, name).await
    }

    fn loss_feed(&self) -> Option<LossFeed> {
        self.hooks.loss_feed(&self.inner)
    }
    /// Goes through the hooks' `try_acquire`, so every interceptor sees
    /// every acquire; the holder's identity is not stored.
    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        _holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.try_acquire(name, owner, ttl).await
    }

    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        self.hooks.before_call().await;
        self.inner.describe(name).await
    }

    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        self.hooks.before_call().await;
        self.inner.list(prefix, cursor, limit).await
    }

    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        self.hooks.before_call().await;
        self.inner.force_release(name, expected_token).await
    }
}

/// Counts the renewals and releases that reach the memory backend, logging
/// each renewal call, and changes chosen calls as the test sets it:
/// renewals refused, renewals of one TTL stalled until answered, one lock's
/// release slowed, every grant kept for less than its TTL, or TTLs below a
/// minimum refused; with none set it only counts. The lock-core and
/// scheduler tests share this one hook, so a case says which of these it
/// wants instead of writing an [`Intercept`] of its own.
#[derive(Debug, Default)]
pub struct Counting {
    renewals: Mutex<Vec<Renewal>>,
    releases: AtomicUsize,
    refuse_renewals: AtomicBool,
    /// The TTL whose renewals wait for [`Counting::answer_stalled`].
    stall: Mutex<Option<Duration>>,
    stalled: Notify,
    answer: Notify,
    min_ttl: Option<Duration>,
    grants_last: Option<Duration>,
    slow_release: Option<(LockName, Duration)>,
}

/// One renewal call that reached a [`Counting`] hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renewal {
    /// When it was made, on tokio's clock.
    pub at: Instant,
    /// The TTL asked for each lease in it: one for a single `renew`.
    pub ttls: Vec<Duration>,
    /// Whether it was a `renew_many` batch (the heartbeat's) rather than a
    /// single `renew` (a handle's, or a retained hold's).
    pub batch: bool,
}

/// The guarded value even if a panicking test poisoned its lock: a count
/// is still worth reading.
fn unpoisoned<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Counting {
    /// Refuses every acquire or renewal asking for less than `min` with a
    /// configuration error, and says `min` is its minimum TTL, as etcd's
    /// whole seconds do.
    pub fn with_min_ttl(mut self, min: Duration) -> Self {
        self.min_ttl = Some(min);
        self
    }

    /// Reports every grant as kept by the server for only `lasts`
    /// (`Lease::with_lasts_at_least`), as a backend whose locks share one
    /// server-side lease does.
    pub fn with_grants_lasting(mut self, lasts: Duration) -> Self {
        self.grants_last = Some(lasts);
        self
    }

    /// Makes each release of `name` take `delay` first: a backend slow to
    /// answer.
    pub fn with_slow_release(mut self, name: LockName, delay: Duration) -> Self {
        self.slow_release = Some((name, delay));
        self
    }

    /// The leases renewed so far: one per single renewal, one per request
    /// of a batch.
    pub fn renewals(&self) -> usize {
        unpoisoned(&self.renewals)
            .iter()
            .map(|r| r.ttls.len())
            .sum()
    }

    /// Every renewal call so far, in the order made.
    pub fn renewal_calls(&self) -> Vec<Renewal> {
        unpoisoned(&self.renewals).clone()
    }

    /// The size of each batch renewal so far, in the order made.
    pub fn batches(&self) -> Vec<usize> {
        unpoisoned(&self.renewals)
            .iter()
            .filter(|r| r.batch)
            .map(|r| r.ttls.len())
            .collect()
    }

    /// The releases so far.
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }

    /// From now on every renewal, single or batch, fails with a timeout
    /// (`refuse`), or none does.
    pub fn refuse_renewals(&self, refuse: bool) {
        self.refuse_renewals.store(refuse, Ordering::SeqCst);
    }

    /// From now on a renewal with a lease of TTL `ttl` waits until
    /// [`Counting::answer_stalled`]: a request on its way, not yet answered.
    pub fn stall_renewals(&self, ttl: Duration) {
        *unpoisoned(&self.stall) = Some(ttl);
    }

    /// Resolves once a renewal stalls. Take it before starting the call
    /// that is to stall.
    pub fn renewal_stalled(&self) -> Notified<'_> {
        self.stalled.notified()
    }

    /// Stops stalling renewals, and lets every stalled one through to the
    /// memory backend.
    pub fn answer_stalled(&self) {
        *unpoisoned(&self.stall) = None;
        self.answer.notify_waiters();
    }

    /// Logs a renewal call, then fails it if renewals are refused or a TTL
    /// in it is below the minimum, else holds it while it is stalled.
    async fn renewal(&self, ttls: Vec<Duration>, batch: bool) -> Result<(), BackendError> {
        let stalls = unpoisoned(&self.stall).is_some_and(|s| ttls.contains(&s));
        let refused = ttls.iter().try_for_each(|&ttl| self.refuse_below_min(ttl));
        unpoisoned(&self.renewals).push(Renewal {
            at: Instant::now(),
            ttls,
            batch,
        });
        if self.refuse_renewals.load(Ordering::SeqCst) {
            return Err(BackendError::new(
                BackendErrorKind::Timeout,
                "renewal timed out (injected)",
            ));
        }
        refused?;
        if stalls {
            // Taken before `stalled` is told, so an answer right after it
            // cannot be missed.
            let answer = self.answer.notified();
            self.stalled.notify_one();
            answer.await;
        }
        Ok(())
    }

    fn refuse_below_min(&self, ttl: Duration) -> Result<(), BackendError> {
        match self.min_ttl {
            Some(min) if ttl < min => Err(BackendError::new(
                BackendErrorKind::Config,
                format!("a TTL of {ttl:?} is below this backend's minimum of {min:?}"),
            )),
            _ => Ok(()),
        }
    }
}

#[async_trait]
impl Intercept for Counting {
    fn capabilities(&self, inner: &MemoryBackend) -> Capabilities {
        match self.min_ttl {
            Some(min) => inner.capabilities().with_min_ttl(min),
            None => inner.capabilities(),
        }
    }

    async fn try_acquire(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.refuse_below_min(ttl)?;
        Ok(
            match (inner.try_acquire(name, owner, ttl).await?, self.grants_last) {
                (AcquireAttempt::Acquired(lease), Some(lasts)) => {
                    AcquireAttempt::Acquired(lease.with_lasts_at_least(lasts))
                }
                (attempt, _) => attempt,
            },
        )
    }

    async fn renew(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.renewal(vec![ttl], false).await?;
        inner.renew(name, owner, ttl).await
    }

    async fn renew_many(
        &self,
        inner: &MemoryBackend,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        self.renewal(requests.iter().map(|r| r.ttl).collect(), true)
            .await?;
        inner.renew_many(requests).await
    }

    async fn release(
        &self,
        inner: &MemoryBackend,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if let Some((slow, delay)) = &self.slow_release {
            if slow == name {
                tokio::time::sleep(*delay).await;
            }
        }
        inner.release(name, owner).await
    }
}
