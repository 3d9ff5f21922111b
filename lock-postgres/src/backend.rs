//! [`PostgresBackend`]: the `LockBackend` implementation.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use lock_core::{
    async_trait,
    backend::{
        AcquireAttempt, Expiry, LeaseStatus, LossFeed, ReleaseOutcome, ReleaseSignal, RenewRequest,
    },
    lane::{Settled, Unsettled},
    BackendError, Capabilities, ForceOutcome, Holder, HolderPage, Identity, LockBackend, LockName,
    LossReason, OwnerToken,
};
use tracing::{debug, warn};

use crate::error::protocol;
use crate::holders::HolderSql;
use crate::lifeline::{Lifeline, OnEnd};
use crate::notify::ReleaseListener;
use crate::session::LockSession;
use crate::sessions::SessionSet;
use crate::{AdvisoryKey, PostgresConfig};

/// The shortest TTL accepted: renewal needs a round trip every `ttl / 3`.
const MIN_TTL: Duration = Duration::from_millis(100);

/// A Postgres lock backend: session-scoped advisory locks, spread over a
/// few dedicated lock sessions by the hash of each key.
///
/// Clones share the sessions and the table of held locks, so two
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
    /// The lock sessions, each key on the one its hash picks.
    sessions: SessionSet,
    pub(crate) held: Mutex<HashMap<AdvisoryKey, Holding>>,
    pub(crate) listener: ReleaseListener,
    /// Set once the fencing sequence is known to exist: acquisitions then
    /// draw the token in the lock statement itself.
    pub(crate) fence_ready: AtomicBool,
    /// Where the end of a session is reported, for every lease on it.
    feed: LossFeed,
    /// The holder table's statements (see `holders`).
    pub(crate) holders: Arc<HolderSql>,
    /// Owners whose leases an operator freed, and when this backend learnt
    /// it: their renewals and checks answer `Forced` while kept.
    forced: Mutex<HashMap<OwnerToken, Instant>>,
    /// Faults armed by the conformance suite.
    #[cfg(feature = "test-util")]
    pub(crate) faults: crate::test_util::Faults,
}

/// A lock this backend holds, or is acquiring or releasing, on one session.
///
/// The entry reserves its key on that session: no other owner of this
/// backend takes it until the entry goes, which a release does only once
/// its unlock is known to have run (or the session ended).
#[derive(Debug)]
pub(crate) struct Holding {
    pub(crate) owner: OwnerToken,
    pub(crate) session: Arc<LockSession>,
    /// An unlock of it is in flight; a second release must not start another.
    pub(crate) releasing: bool,
    /// For a second release of it while its unlock is in flight: closes
    /// when this entry goes (the unlock has run, or the session ended).
    /// Made only when such a release comes.
    pub(crate) gone: Option<(Unsettled, Settled)>,
    /// Closes once the attempt that took it can no longer take it after an
    /// unlock sent now (see `attempts`); an unlock waits for it.
    pub(crate) attempt: Settled,
}

impl Inner {
    fn forced(&self) -> MutexGuard<'_, HashMap<OwnerToken, Instant>> {
        self.forced.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn held(&self) -> MutexGuard<'_, HashMap<AdvisoryKey, Holding>> {
        // Every critical section is short and leaves the map whole; poison
        // carries no half-state.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A session of this backend ended: the server freed every lock on it,
    /// so every lease on it is marked lost now, in every `Locker`.
    fn session_ended(&self, line: &Lifeline, reason: LossReason) {
        let id = line.id();
        let (owners, pid): (Vec<OwnerToken>, Option<i32>) = {
            let held = self.held();
            let mine = held.values().filter(|h| h.session.id() == id);
            let pid = mine.clone().next().map(|h| h.session.pid());
            let collected = (mine.map(|h| h.owner).collect(), pid);
            // Dead from here on, with every lease on it collected: whoever
            // sees it dead now and forgets a holding forgets a reported one.
            line.mark_ended();
            collected
        };
        if owners.is_empty() {
            debug!(session = id, %reason, "a lock session holding no lock ended");
            return;
        }
        // Outside the map's lock: ending leases wakes their holders.
        let ended = self.feed.leases_ended(&owners, reason);
        warn!(
            pid,
            locks = owners.len(),
            leases_ended = ended,
            %reason,
            "the lock session ended and the server freed its locks; every lease on it is lost"
        );
    }
}

impl PostgresBackend {
    /// A builder; see [`PostgresBuilder`](crate::PostgresBuilder).
    pub fn builder() -> crate::PostgresBuilder {
        crate::PostgresBuilder::new()
    }

    /// A backend that connects its lock session on first use (as
    /// [`PostgresBuilder::build`](crate::PostgresBuilder::build)).
    pub fn new(config: PostgresConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                sessions: SessionSet::new(config.lock_sessions),
                held: Mutex::new(HashMap::new()),
                listener: ReleaseListener::default(),
                fence_ready: AtomicBool::new(false),
                feed: LossFeed::new(),
                holders: Arc::new(HolderSql::new(&config)),
                forced: Mutex::new(HashMap::new()),
                config,
                #[cfg(feature = "test-util")]
                faults: crate::test_util::Faults::default(),
            }),
        }
    }

    /// A backend whose first lock session is connected now (the others
    /// connect on first use), so that a wrong URL,
    /// wrong credentials or an unreachable server show up here (as
    /// [`PostgresBuilder::connect`](crate::PostgresBuilder::connect)).
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

    /// The server pid of the first lock session, connecting it if needed
    /// (what `pg_locks.pid` and `pg_stat_activity.pid` show). It also runs
    /// the tick store's statements. With one lock session
    /// ([`PostgresBuilder::with_lock_sessions`](crate::PostgresBuilder::with_lock_sessions))
    /// it holds every lock; otherwise see [`PostgresBackend::lock_session_pid`].
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

    /// The server pid of the lock session that takes (or would take) the
    /// lock `name`, connecting it if needed.
    ///
    /// # Errors
    ///
    /// As [`PostgresBackend::connect`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn lock_session_pid(&self, name: &LockName) -> Result<i32, BackendError> {
        let key = self.inner.config.key_for(name);
        Ok(self.session_for(key).await?.pid())
    }

    pub(crate) fn held(&self) -> MutexGuard<'_, HashMap<AdvisoryKey, Holding>> {
        self.inner.held()
    }

    /// What a session of this backend does when it ends. Weak, so that a
    /// session never keeps its backend alive.
    fn on_session_end(&self) -> OnEnd {
        let inner = Arc::downgrade(&self.inner);
        Arc::new(move |line: &Lifeline, reason| {
            if let Some(inner) = inner.upgrade() {
                inner.session_ended(line, reason);
            }
        })
    }

    /// The first live session (ticks, probes of keys no longer held),
    /// connecting a new one if there is none or it died.
    pub(crate) async fn session(&self) -> Result<Arc<LockSession>, BackendError> {
        self.session_at(0).await
    }

    /// The live session that holds `key`, connecting it if needed.
    pub(crate) async fn session_for(
        &self,
        key: AdvisoryKey,
    ) -> Result<Arc<LockSession>, BackendError> {
        self.session_at(self.inner.sessions.index_for(key)).await
    }

    async fn session_at(&self, i: usize) -> Result<Arc<LockSession>, BackendError> {
        self.inner
            .sessions
            .get(
                i,
                &self.inner.config,
                || self.on_session_end(),
                &self.inner.holders,
            )
            .await
    }

    /// Forgets `key` if `owner` is its holder here; returns the holding.
    pub(crate) fn take_holding(&self, key: AdvisoryKey, owner: &OwnerToken) -> Option<Holding> {
        let mut held = self.held();
        match held.get(&key) {
            Some(h) if h.owner == *owner => held.remove(&key),
            _ => None,
        }
    }
    /// An operator marked `keys` on `session` for a forced release (its
    /// renewal read the marks): their leases are marked lost (`forced`) in
    /// every `Locker` first, then unlocked on the session, in the
    /// background, as a release would (which deletes their holder rows and
    /// wakes waiters).
    pub(crate) async fn forced_on(&self, session: &Arc<LockSession>, keys: &[AdvisoryKey]) {
        let ended: Vec<(AdvisoryKey, OwnerToken)> = {
            let held = self.held();
            keys.iter()
                .filter_map(|k| {
                    held.get(k)
                        .filter(|h| Arc::ptr_eq(&h.session, session) && !h.releasing)
                        .map(|h| (*k, h.owner))
                })
                .collect()
        };
        if ended.is_empty() {
            return;
        }
        {
            let keep = self.forced_kept();
            let mut forced = self.inner.forced();
            forced.retain(|_, at| at.elapsed() < keep);
            for (_, owner) in &ended {
                forced.insert(*owner, Instant::now());
            }
        }
        let owners: Vec<OwnerToken> = ended.iter().map(|(_, o)| *o).collect();
        let told = self.inner.feed.leases_ended(&owners, LossReason::Forced);
        warn!(
            pid = session.pid(),
            locks = ended.len(),
            leases_ended = told,
            "an operator released locks of this process by force; their leases are lost (forced) and the locks are given back"
        );
        let notify = self.inner.config.release_notify;
        for (key, owner) in ended {
            if let Ok(releasing) = self.begin_release(key, &owner) {
                // Dropped at once: it runs to its end in a task of its own.
                drop(self.start_unlock(releasing, key, owner, notify));
            }
        }
    }

    /// Whether an operator freed `owner`'s lease, recently enough that its
    /// renewals still answer `Forced`.
    pub(crate) fn was_forced(&self, owner: &OwnerToken) -> bool {
        let keep = self.forced_kept();
        self.inner
            .forced()
            .get(owner)
            .is_some_and(|at| at.elapsed() < keep)
    }

    /// How long a forced release is remembered: well past the longest TTL
    /// a renewal can ask for.
    fn forced_kept(&self) -> Duration {
        self.inner.config.max_ttl.saturating_mul(4)
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
            .with_loss_push(true)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, None).await
    }

    /// As `try_acquire`, and the lock statement writes the holder row (see
    /// the crate docs, "Inspection and forced release").
    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, Some(holder)).await
    }

    /// Reads `pg_locks` for the name's key, joined with its holder row:
    /// held by a session that wrote no row (another program, an older
    /// version), it is an unknown holder. `expires_at` is `None`: the lock
    /// lives as long as its session. Needs `SELECT` on the holder tables
    /// (or none, before they exist); `pg_locks` is readable by every role.
    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        self.describe_lock(name).await
    }

    /// Lists the holder rows under `prefix` whose session holds their key
    /// per `pg_locks`, by name. Locks held by programs that write no holder
    /// row cannot be listed (no name is known for a key); `describe` finds
    /// them by name. Needs `SELECT` on the holder tables.
    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        self.list_locks(prefix, cursor, limit).await
    }

    /// Marks the holder row for a forced release if its token is
    /// `expected_token` and its session holds the key; the holder's next
    /// renewal (at most a third of its TTL later) reads the mark, reports
    /// the lease lost (`forced`) and unlocks the key on its own session,
    /// which no other session can do. Other leases on that session are
    /// untouched. A holder that does not renew (a stopped process) keeps
    /// the lock until its session ends. Needs `SELECT` and `UPDATE` on the
    /// holder table.
    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        self.force_release_lock(name, expected_token).await
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

    /// Every lease on a session is marked lost the moment the session is
    /// known to have ended: `expired` when the server or the network ended
    /// it (the lock vanished on the server, as a renewal would find), and
    /// `backend_error` when this backend ends it because its lock state
    /// became unknown (a release whose unlock failed twice, a pooler) —
    /// before it closes the socket.
    fn loss_feed(&self) -> Option<LossFeed> {
        Some(self.inner.feed.clone())
    }
}
