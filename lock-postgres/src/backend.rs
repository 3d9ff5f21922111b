//! [`PostgresBackend`]: the `LockBackend` implementation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use lock_core::{
    async_trait, AcquireAttempt, BackendError, BackendErrorKind, Capabilities, Expiry, Lease,
    LeaseStatus, LockBackend, LockName, OwnerToken, ReleaseOutcome, ReleaseSignal, RenewRequest,
};
use tokio_postgres::types::Type;
use tracing::warn;

use crate::error::{config, protocol};
use crate::notify::{payload, ReleaseListener, CHANNEL};
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresConfig};

const TRY_LOCK: &str = "SELECT pg_backend_pid(), \
     CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock($1, $2) END";

/// The lock attempt and, only when it succeeded, the fencing token, in one
/// round trip. The subquery holds a volatile call, so the planner keeps it
/// apart and `pg_try_advisory_lock` runs once per execution.
const TRY_LOCK_FENCED: &str = "SELECT s.pid, s.got, \
     CASE WHEN s.got THEN nextval($4::text::regclass) END \
     FROM (SELECT pg_backend_pid() AS pid, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock($1, $2) END AS got) s";

const UNLOCK: &str = "SELECT pg_backend_pid(), \
     CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END";

/// The unlock and, only when it freed the lock, the release announcement, in
/// one round trip (the notification leaves when the statement commits).
const UNLOCK_NOTIFY: &str = "SELECT s.pid, s.freed, \
     CASE WHEN s.freed THEN pg_notify($4, $5)::text END \
     FROM (SELECT pg_backend_pid() AS pid, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END AS freed) s";

/// For each key (as unsigned `oid`s): whether this session holds it, and
/// whether any other session does. `objsubid = 2` is the two-`int4` key space.
const PROBE: &str = "SELECT pg_backend_pid(), k.i::int4, \
     EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
       AND l.database = d.oid AND l.classid::int8 = k.c AND l.objid::int8 = k.o \
       AND l.objsubid = 2 AND l.pid = pg_backend_pid()), \
     EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
       AND l.database = d.oid AND l.classid::int8 = k.c AND l.objid::int8 = k.o \
       AND l.objsubid = 2 AND l.pid <> pg_backend_pid()) \
     FROM unnest($1::int8[], $2::int8[]) WITH ORDINALITY AS k(c, o, i), \
       (SELECT oid FROM pg_database WHERE datname = current_database()) d \
     ORDER BY k.i";

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
    held: Mutex<HashMap<AdvisoryKey, Holding>>,
    pub(crate) listener: ReleaseListener,
    /// Set once the fencing sequence is known to exist: acquisitions then
    /// draw the token in the lock statement itself.
    fence_ready: AtomicBool,
}

/// A lock this backend holds, or is acquiring, on one session.
#[derive(Debug, Clone)]
struct Holding {
    owner: OwnerToken,
    session: Arc<LockSession>,
}

/// What a probe found for one key.
#[derive(Debug, Clone, Copy)]
struct Probe {
    mine: bool,
    other: bool,
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

    fn held(&self) -> MutexGuard<'_, HashMap<AdvisoryKey, Holding>> {
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

    async fn probe(
        &self,
        session: &LockSession,
        keys: &[AdvisoryKey],
    ) -> Result<Vec<Probe>, BackendError> {
        let classids: Vec<i64> = keys.iter().map(|k| k.classid()).collect();
        let objids: Vec<i64> = keys.iter().map(|k| k.objid()).collect();
        let rows = session
            .query(
                "checking pg_locks",
                PROBE,
                &[(&classids, Type::INT8_ARRAY), (&objids, Type::INT8_ARRAY)],
            )
            .await?;
        if rows.len() != keys.len() {
            return Err(protocol(format!(
                "pg_locks probe returned {} rows for {} keys",
                rows.len(),
                keys.len()
            )));
        }
        rows.iter()
            .map(|row| {
                session.check_pid(row)?;
                Ok(Probe {
                    mine: row.try_get(2).map_err(|e| protocol(e.to_string()))?,
                    other: row.try_get(3).map_err(|e| protocol(e.to_string()))?,
                })
            })
            .collect()
    }

    /// Status of keys this backend no longer holds (for the given owners):
    /// `Stolen` if any session holds them now, `Expired` if none does.
    async fn status_elsewhere(&self, keys: &[AdvisoryKey]) -> Vec<LeaseStatus> {
        if keys.is_empty() {
            return Vec::new();
        }
        let answer = match self.session().await {
            Ok(session) => self.probe(&session, keys).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(probes) => probes
                .into_iter()
                .map(|p| {
                    if p.mine || p.other {
                        LeaseStatus::Stolen
                    } else {
                        LeaseStatus::Expired
                    }
                })
                .collect(),
            Err(e) => {
                // Our lease is gone either way (its session ended); only who
                // holds the name now is unknown.
                warn!(error = %e, "could not tell whether a lost lock was taken over; reporting it expired");
                vec![LeaseStatus::Expired; keys.len()]
            }
        }
    }

    /// Unlocks `key` on `session`; with `announce`, the same statement tells
    /// waiters (best effort: a waiter that misses it finds the lock free at
    /// its next poll).
    async fn unlock(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
        announce: bool,
    ) -> Result<bool, BackendError> {
        let pid = session.pid();
        let text = payload(key);
        let rows = if announce {
            session
                .query_prepared(
                    "releasing an advisory lock",
                    UNLOCK_NOTIFY,
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                        (&CHANNEL, Type::TEXT),
                        (&text.as_str(), Type::TEXT),
                    ],
                )
                .await?
        } else {
            session
                .query_prepared(
                    "releasing an advisory lock",
                    UNLOCK,
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                    ],
                )
                .await?
        };
        let row = rows
            .first()
            .ok_or_else(|| protocol("pg_advisory_unlock returned no row"))?;
        session.check_pid(row)?;
        row.try_get::<_, Option<bool>>(1)
            .map_err(|e| protocol(e.to_string()))
            .map(|v| v.unwrap_or(false))
    }

    /// Reads a lock attempt's row: whether the lock was granted. When it was
    /// not (or the session is not the one the statement was meant for, whose
    /// guard then kept the lock from being taken), the holding recorded for
    /// `owner` is dropped.
    fn granted(
        &self,
        session: &LockSession,
        row: &tokio_postgres::Row,
        key: AdvisoryKey,
        owner: &OwnerToken,
    ) -> Result<bool, BackendError> {
        if let Err(e) = session.check_pid(row) {
            self.take_holding(key, owner);
            return Err(e);
        }
        let got: Option<bool> = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
        if got != Some(true) {
            self.take_holding(key, owner);
        }
        Ok(got == Some(true))
    }

    /// Gives back a lock taken without its fencing token (the lease is
    /// unusable); ends the session if even that fails.
    async fn give_back(&self, session: &LockSession, key: AdvisoryKey, owner: &OwnerToken) {
        if self.take_holding(key, owner).is_some() {
            if let Err(unlock) = self.unlock(session, key, false).await {
                warn!(error = %unlock, "could not unlock after a fencing failure; ending the session");
                session.terminate();
            }
        }
    }

    /// One round trip: the lock attempt and, if it succeeded, the fencing
    /// token. The caller has recorded the holding for `owner`.
    async fn try_lock_fenced(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
        owner: &OwnerToken,
    ) -> Result<AcquireAttempt, BackendError> {
        let cfg = &self.inner.config;
        let seq = cfg.qualified(&cfg.fence_sequence);
        let pid = session.pid();
        let rows = session
            .query_prepared(
                "pg_try_advisory_lock with a fencing token",
                TRY_LOCK_FENCED,
                &[
                    (&key.key1, Type::INT4),
                    (&key.key2, Type::INT4),
                    (&pid, Type::INT4),
                    (&seq.as_str(), Type::TEXT),
                ],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| protocol("pg_try_advisory_lock returned no row"))?;
        if !self.granted(session, row, key, owner)? {
            return Ok(AcquireAttempt::Held);
        }
        let token: Option<i64> = row.try_get(2).map_err(|e| protocol(e.to_string()))?;
        let token = token
            .and_then(|t| u64::try_from(t).ok())
            .ok_or_else(|| protocol(format!("the fencing sequence returned {token:?}")));
        match token {
            Ok(t) => Ok(AcquireAttempt::Acquired(Lease::new(Some(t)))),
            Err(e) => {
                self.give_back(session, key, owner).await;
                Err(e)
            }
        }
    }

    /// Forgets `key` if `owner` is its holder here; returns the holding.
    fn take_holding(&self, key: AdvisoryKey, owner: &OwnerToken) -> Option<Holding> {
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
        let cfg = &self.inner.config;
        if ttl > cfg.max_ttl {
            return Err(config(format!(
                "TTL {ttl:?} is above this backend's max_ttl of {:?}: the server could free the \
                 lock of a vanished holder before the holder's TTL ran out; raise max_ttl",
                cfg.max_ttl
            )));
        }
        let key = cfg.key_for(name);
        let session = self.session().await?;
        {
            let mut held = self.held();
            if let Some(h) = held.get(&key) {
                // Advisory locks are re-entrant per session: the server would
                // grant this, so the exclusion between owners sharing the
                // session is enforced here.
                if h.session.is_alive() {
                    return Ok(AcquireAttempt::Held);
                }
            }
            // Recorded before the statement leaves, so a release for this
            // owner after a dropped or failed attempt unlocks what the
            // statement may have taken.
            held.insert(
                key,
                Holding {
                    owner: *owner,
                    session: Arc::clone(&session),
                },
            );
        }
        if cfg.fencing && self.inner.fence_ready.load(Ordering::Relaxed) {
            match self.try_lock_fenced(&session, key, owner).await {
                Err(e) if e.message().contains("42P01") => {
                    // The sequence was dropped since: the lock may have been
                    // taken before nextval failed (session locks ignore the
                    // statement's failure). Give it back and take the path
                    // that creates the sequence.
                    self.inner.fence_ready.store(false, Ordering::Relaxed);
                    if let Err(unlock) = self.unlock(&session, key, false).await {
                        warn!(error = %unlock, "could not unlock after a missing fencing sequence; ending the session");
                        session.terminate();
                        self.take_holding(key, owner);
                        return Err(unlock);
                    }
                }
                other => return other,
            }
        }
        let pid = session.pid();
        let rows = session
            .query_prepared(
                "pg_try_advisory_lock",
                TRY_LOCK,
                &[
                    (&key.key1, Type::INT4),
                    (&key.key2, Type::INT4),
                    (&pid, Type::INT4),
                ],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| protocol("pg_try_advisory_lock returned no row"))?;
        if !self.granted(&session, row, key, owner)? {
            return Ok(AcquireAttempt::Held);
        }
        if !cfg.fencing {
            return Ok(AcquireAttempt::Acquired(Lease::new(None)));
        }
        match self.fencing_token(&session).await {
            Ok(token) => {
                self.inner.fence_ready.store(true, Ordering::Relaxed);
                Ok(AcquireAttempt::Acquired(Lease::new(Some(token))))
            }
            Err(e) => {
                self.give_back(&session, key, owner).await;
                Err(e)
            }
        }
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
        let key = self.inner.config.key_for(name);
        let Some(holding) = self.take_holding(key, owner) else {
            warn!(lock = %name, "release of a lock this backend does not hold for this owner; nothing unlocked");
            return Ok(ReleaseOutcome::NotHeld);
        };
        if !holding.session.is_alive() {
            // The lock ended with its session.
            return Ok(ReleaseOutcome::NotHeld);
        }
        let announce = self.inner.config.release_notify;
        match self.unlock(&holding.session, key, announce).await {
            Ok(true) => Ok(ReleaseOutcome::Released),
            Ok(false) => {
                warn!(lock = %name, "pg_advisory_unlock found nothing to unlock on this session");
                Ok(ReleaseOutcome::NotHeld)
            }
            Err(e) => {
                // Whether the unlock ran is unknown, so this session's lock
                // count is too; ending the session frees everything it holds
                // instead of leaving a lock behind (its other leases are then
                // reported lost at their next renewal).
                warn!(lock = %name, error = %e, "release failed; ending the lock session");
                holding.session.terminate();
                Err(e)
            }
        }
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
        let keys: Vec<AdvisoryKey> = requests
            .iter()
            .map(|r| self.inner.config.key_for(&r.name))
            .collect();
        // Group the leases by the live session that holds them; the rest
        // were lost (dead session, or another owner's now).
        let mut by_session: Vec<(Arc<LockSession>, Vec<usize>)> = Vec::new();
        let mut lost = Vec::new();
        {
            let mut held = self.held();
            for (i, (r, key)) in requests.iter().zip(&keys).enumerate() {
                match held.get(key) {
                    Some(h) if h.owner == r.owner && h.session.is_alive() => {
                        let s = Arc::clone(&h.session);
                        match by_session.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &s)) {
                            Some((_, idx)) => idx.push(i),
                            None => by_session.push((s, vec![i])),
                        }
                    }
                    Some(h) if h.owner == r.owner => {
                        held.remove(key);
                        lost.push(i);
                    }
                    _ => lost.push(i),
                }
            }
        }
        let mut out = vec![LeaseStatus::Expired; requests.len()];
        for (session, idx) in by_session {
            let batch: Vec<AdvisoryKey> = idx.iter().map(|i| keys[*i]).collect();
            match self.probe(&session, &batch).await {
                Ok(probes) => {
                    for (i, p) in idx.into_iter().zip(probes) {
                        if p.mine {
                            out[i] = LeaseStatus::Held;
                        } else {
                            self.take_holding(keys[i], &requests[i].owner);
                            out[i] = if p.other {
                                LeaseStatus::Stolen
                            } else {
                                LeaseStatus::Expired
                            };
                        }
                    }
                }
                // A pooler error also ends the session, but must reach the caller.
                Err(e) if !session.is_alive() && e.kind() != BackendErrorKind::Config => {
                    warn!(error = %e, pid = session.pid(), "the lock session ended; its locks are gone");
                    for i in idx {
                        self.take_holding(keys[i], &requests[i].owner);
                        lost.push(i);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let lost_keys: Vec<AdvisoryKey> = lost.iter().map(|i| keys[*i]).collect();
        let statuses = self.status_elsewhere(&lost_keys).await;
        for (i, status) in lost.into_iter().zip(statuses) {
            out[i] = status;
        }
        Ok(out)
    }
}
