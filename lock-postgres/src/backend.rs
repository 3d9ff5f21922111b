//! [`PostgresBackend`]: the `LockBackend` implementation.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait, AcquireAttempt, BackendError, Capabilities, Expiry, LeaseStatus, LockBackend,
    LockName, OwnerToken, ReleaseOutcome, ReleaseSignal, RenewRequest,
};

use crate::error::protocol;
use crate::notify::ReleaseListener;
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresConfig};

/// The shortest TTL accepted: renewal needs a round trip every `ttl / 3`.
const MIN_TTL: Duration = Duration::from_millis(100);

/// A Postgres lock backend: session-scoped advisory locks on one dedicated session.
///
/// Clones share the session and the table of held locks, so two
/// [`Locker`](lock_core::Locker)s over clones still exclude each other (the
/// server alone would let one session take its own lock twice). See the
/// crate docs for the session model.
#[derive(Debug, Clone)]
pub struct PostgresBackend {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: PostgresConfig,
    session: tokio::sync::Mutex<Option<Arc<LockSession>>>,
    pub(crate) held: Mutex<HashMap<AdvisoryKey, Holding>>,
    pub(crate) listener: ReleaseListener,
    /// Set once the fencing sequence is known to exist: acquisitions then
    /// draw the token in the lock statement itself.
    pub(crate) fence_ready: AtomicBool,
}

/// A lock this backend holds, or is acquiring, on one session.
#[derive(Debug, Clone)]
pub(crate) struct Holding {
    pub(crate) owner: OwnerToken,
    pub(crate) session: Arc<LockSession>,
}

impl PostgresBackend {
    /// A backend that connects its lock session on first use.
    pub fn new(config: PostgresConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                session: tokio::sync::Mutex::new(None),
                held: Mutex::new(HashMap::new()),
                listener: ReleaseListener::default(),
                fence_ready: AtomicBool::new(false),
            }),
        }
    }

    /// A backend whose lock session is connected now, so that a wrong URL,
    /// wrong credentials or an unreachable server show up here.
    ///
    /// # Errors
    ///
    /// `Unavailable` or `Timeout` if the server cannot be reached within the
    /// connect timeout, `Auth` for refused credentials, `Config` for a
    /// missing database, a bad TLS setup or a transaction-mode pooler.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future leaves nothing behind.
    pub async fn connect(config: PostgresConfig) -> Result<Self, BackendError> {
        let backend = Self::new(config);
        backend.session().await?;
        Ok(backend)
    }

    /// The configuration.
    pub fn config(&self) -> &PostgresConfig {
        &self.inner.config
    }

    /// The server pid of the current lock session, connecting it if needed
    /// (what `pg_locks.pid` and `pg_stat_activity.pid` show).
    ///
    /// # Errors
    ///
    /// As [`PostgresBackend::connect`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn session_pid(&self) -> Result<i32, BackendError> {
        Ok(self.session().await?.pid())
    }

    pub(crate) fn held(&self) -> MutexGuard<'_, HashMap<AdvisoryKey, Holding>> {
        // Every critical section is one map operation; poison carries no half-state.
        self.inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The live session, connecting a new one if there is none or it died.
    pub(crate) async fn session(&self) -> Result<Arc<LockSession>, BackendError> {
        let mut slot = self.inner.session.lock().await;
        if let Some(s) = slot.as_ref() {
            if s.is_alive() {
                return Ok(Arc::clone(s));
            }
        }
        *slot = None;
        let fresh = Arc::new(LockSession::connect(&self.inner.config).await?);
        *slot = Some(Arc::clone(&fresh));
        Ok(fresh)
    }

    /// Forgets `key` if `owner` is its holder here; returns the holding.
    pub(crate) fn take_holding(&self, key: AdvisoryKey, owner: &OwnerToken) -> Option<Holding> {
        let mut held = self.held();
        match held.get(&key) {
            Some(h) if h.owner == *owner => held.remove(&key),
            _ => None,
        }
    }
}

#[async_trait]
impl LockBackend for PostgresBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(Expiry::Session)
            .with_fencing(self.inner.config.fencing)
            .with_batch_renew(true)
            .with_release_notify(self.inner.config.release_notify)
            .with_min_ttl(MIN_TTL)
            .with_max_ttl(self.inner.config.max_ttl)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let request = RenewRequest {
            name: name.clone(),
            owner: *owner,
            ttl,
        };
        let mut statuses = self.renew_many(std::slice::from_ref(&request)).await?;
        statuses
            .pop()
            .ok_or_else(|| protocol("renewal returned no status"))
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        // Nothing expires by time on the server: a check is a renew.
        self.renew(name, owner, Duration::ZERO).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        self.release_lock(name, owner).await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let cfg = &self.inner.config;
        if !cfg.release_notify {
            return Ok(None);
        }
        let signal = self
            .inner
            .listener
            .subscribe(cfg, cfg.key_for(name))
            .await?;
        Ok(Some(signal))
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        self.renew_batch(requests).await
    }
}
