//! Test hook: the memory backend with some of its calls changed, for tests
//! that need a backend which stalls, counts, refuses or shortens something.
//! A test writes only the calls it changes; every other one is the memory
//! backend's own.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use lock_core::backend::{
    AcquireAttempt, LeaseStatus, LossFeed, ReleaseOutcome, ReleaseSignal, RenewRequest,
};
use lock_core::{
    async_trait, BackendError, Capabilities, ForceOutcome, Holder, HolderPage, Identity,
    LockBackend, LockName, OwnerToken,
};

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
