//! A connected etcd backend: connecting, the key layout, and the leases this instance holds.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, KeyValue, TlsOptions};
use lock_core::{
    backend::{LeaseStatus, LossFeed, RenewRequest},
    BackendError, BackendErrorKind, LockName, OwnerToken,
};
use tracing::{debug, warn};

use crate::config::EtcdBuilder;
use crate::error::{convert, is_lease_not_found};
use crate::holder::owned_by;
use crate::lease::{lease_seconds, Leases};
use crate::members::Members;
use crate::shared::SharedLeases;

/// A backend connected to its cluster: what [`EtcdBackend`](crate::EtcdBackend)
/// holds once the cluster answered. Cloning is cheap and clones share the connection.
#[derive(Clone)]
pub(crate) struct Connected {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// One client per member; every call goes through [`Members::run`].
    pub(crate) members: Arc<Members>,
    pub(crate) leases: Arc<Leases>,
    /// The shared leases, their proofs and the releases still to do.
    pub(crate) shared: SharedLeases,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) min_ttl: Duration,
    held: Mutex<HashMap<LockName, Held>>,
    /// Names whose last attempt here found them taken: the next attempt
    /// reads before it grants a lease (see [`Inner::read_first`]).
    contended: Mutex<HashSet<LockName>>,
    /// A renewal pause armed by a test (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub(crate) renewal_pause: crate::test_util::PauseSlot,
    /// An acquire pause armed by a test (feature `test-util`), before the
    /// hold is recorded.
    #[cfg(feature = "test-util")]
    pub(crate) acquire_pause: crate::test_util::PauseSlot,
    /// An acquire pause armed by a test (feature `test-util`), after the
    /// hold is recorded.
    #[cfg(feature = "test-util")]
    pub(crate) recorded_pause: crate::test_util::PauseSlot,
    /// A late put armed by a test (feature `test-util`).
    #[cfg(feature = "test-util")]
    pub(crate) late_put: crate::test_util::LatePut,
}

/// Most names remembered as contended; past it the set starts over (a
/// forgotten name costs one lease grant and revoke at its next denial).
const MAX_CONTENDED: usize = 4096;

/// etcd's default `--max-txn-ops`: the most operations one transaction (or
/// one branch of it) may carry, so the most items a batch transaction holds.
pub(crate) const MAX_TXN_OPS: usize = 128;

/// The lease a lock this instance acquired is on: the shared lease of its
/// TTL, or one of its own after `retain_for` asked for another TTL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    pub(crate) owner: OwnerToken,
    pub(crate) lease: i64,
    pub(crate) seconds: i64,
    /// The revision of the write that put the key on `lease`. Writes of one
    /// owner's key can answer out of order; the later revision is the one
    /// the key shows, so it is the one remembered.
    pub(crate) revision: i64,
}

impl fmt::Debug for Connected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connected")
            .field("prefix", &self.inner.prefix)
            .field("request_timeout", &self.inner.timeout)
            .field("min_ttl", &self.inner.min_ttl)
            .finish_non_exhaustive()
    }
}

/// Which minimum TTL a new connection accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MinTtl {
    /// The cluster's, measured at connect, and no lower than the declared
    /// one: nothing has read the backend's capabilities yet.
    Measure,
    /// This one, whatever the cluster grants: capabilities that say so were
    /// handed out before the cluster answered, and `Locker`s validate their
    /// options against them once, when they are built.
    Keep(Duration),
}

impl Connected {
    /// Connects with `b`, proving with a probe lease that the cluster
    /// answers, and accepts TTLs down to `min_ttl`; lost shared leases are
    /// reported through `feed`. Cancel safe.
    pub(crate) async fn connect(
        mut b: EtcdBuilder,
        min_ttl: MinTtl,
        feed: LossFeed,
    ) -> Result<Self, BackendError> {
        let endpoints = b.validated()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(b.connect_timeout)
            .with_require_leader(true);
        if let (Some(user), Some(password)) = (&b.username, &b.password) {
            options = options
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        if b.uses_tls() {
            let Some(pem) = &b.ca_pem else {
                return Err(BackendError::new(
                    BackendErrorKind::Config,
                    "TLS needs a CA certificate: set with_ca_file or with_ca_pem",
                ));
            };
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(pem));
            if let Some(domain) = &b.tls_domain {
                tls = tls.domain_name(domain.clone());
            }
            options = options.with_tls(tls);
        }
        let connect_limit = b.connect_timeout.saturating_add(b.request_timeout);
        let members = Arc::new(Members::new(&endpoints, options));
        let leases = Leases::default();
        let declared = b.declared_min_ttl();
        let asked = match min_ttl {
            MinTtl::Measure => declared.map_or(1, lease_seconds),
            MinTtl::Keep(kept) => lease_seconds(kept),
        };
        // A grant comes back raised to the cluster's minimum TTL, so one
        // short lease both proves the cluster answers and measures it.
        let granted = members
            .run(connect_limit, "probe the cluster", |at| {
                let leases = &leases;
                async move {
                    let (id, granted) = leases.grant(&at, asked).await?;
                    leases.revoke(&at, id).await?;
                    Ok(granted)
                }
            })
            .await?;
        let granted = secs(granted);
        let min_ttl = match min_ttl {
            MinTtl::Measure => declared.unwrap_or_default().max(granted),
            MinTtl::Keep(kept) => {
                if granted > kept {
                    // Still safe: the server keeps a shorter lock longer than
                    // asked, never shorter, so only an abandoned one frees later.
                    warn!(
                        cluster_min_ttl = ?granted,
                        min_ttl = ?kept,
                        "etcd's minimum lease TTL is above the one this backend was built with; \
                         shorter locks are kept that long on the server, so an abandoned one \
                         frees later. Declare it with EtcdBuilder::with_min_ttl"
                    );
                }
                kept
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                members,
                leases: Arc::new(leases),
                shared: SharedLeases::new(feed),
                prefix: b.prefix,
                timeout: b.request_timeout,
                min_ttl,
                held: Mutex::new(HashMap::new()),
                contended: Mutex::new(HashSet::new()),
                #[cfg(feature = "test-util")]
                renewal_pause: crate::test_util::PauseSlot::default(),
                #[cfg(feature = "test-util")]
                acquire_pause: crate::test_util::PauseSlot::default(),
                #[cfg(feature = "test-util")]
                recorded_pause: crate::test_util::PauseSlot::default(),
                #[cfg(feature = "test-util")]
                late_put: crate::test_util::LatePut::default(),
            }),
        })
    }

    /// The shortest TTL this backend accepts: the cluster's minimum lease
    /// TTL (measured at connect, or declared), in whole seconds.
    pub(crate) fn min_ttl(&self) -> Duration {
        self.inner.min_ttl
    }

    /// The etcd key that holds the lock `name`.
    pub(crate) fn key_for(&self, name: &LockName) -> String {
        self.inner.key(name)
    }

    /// The feed through which this backend reports lost shared leases.
    pub(crate) fn feed(&self) -> LossFeed {
        self.inner.shared.feed.clone()
    }
}

impl Inner {
    pub(crate) fn key(&self, name: &LockName) -> String {
        key_in(&self.prefix, name)
    }

    fn held(&self) -> MutexGuard<'_, HashMap<LockName, Held>> {
        // Each critical section is one map operation: a poisoned map is consistent.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether an attempt on `name` should read the key before granting a
    /// lease. Under contention most attempts end at that read, sparing the
    /// cluster a lease grant and revoke (two raft writes) each; uncontended,
    /// it would be one more round trip for nothing. So it is done only for
    /// names whose last attempt here was denied.
    pub(crate) fn read_first(&self, name: &LockName) -> bool {
        self.contended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(name)
    }

    /// Records whether the last attempt on `name` found it taken.
    pub(crate) fn note_contended(&self, name: &LockName, taken: bool) {
        // One set operation per critical section: a poisoned set is consistent.
        let mut set = self
            .contended
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if taken {
            if set.len() >= MAX_CONTENDED {
                set.clear();
            }
            set.insert(name.clone());
        } else {
            set.remove(name);
        }
    }

    /// Records the lease `held.owner`'s key was put on, unless a later write
    /// of that same owner's key is already recorded.
    pub(crate) fn remember(&self, name: &LockName, held: Held) {
        let mut map = self.held();
        match map.get(name) {
            Some(h) if h.owner == held.owner && h.revision > held.revision => {}
            _ => {
                map.insert(name.clone(), held);
            }
        }
    }

    /// Moves the remembered revision of `name` from `held`'s to `revision`,
    /// if the entry is still `held` (not released or moved meanwhile).
    pub(crate) fn advance_revision(&self, name: &LockName, held: &Held, revision: i64) {
        let mut map = self.held();
        if let Some(h) = map.get_mut(name) {
            if h.owner == held.owner && h.lease == held.lease && h.revision == held.revision {
                h.revision = h.revision.max(revision);
            }
        }
    }

    /// The lease this instance holds for `name` under `owner`, if any.
    pub(crate) fn lease_of(&self, name: &LockName, owner: &OwnerToken) -> Option<Held> {
        self.held().get(name).filter(|h| h.owner == *owner).copied()
    }

    /// For each of `requests`, the lease this instance holds for its name
    /// and owner, if any: one look at the map for a whole renewal sweep.
    pub(crate) fn leases_of(&self, requests: &[RenewRequest]) -> Vec<Option<Held>> {
        let map = self.held();
        requests
            .iter()
            .map(|r| map.get(&r.name).filter(|h| h.owner == r.owner).copied())
            .collect()
    }

    /// Drops the entry for `name` if it belongs to `owner`, returning it.
    pub(crate) fn forget(&self, name: &LockName, owner: &OwnerToken) -> Option<Held> {
        let mut map = self.held();
        match map.get(name) {
            Some(h) if h.owner == *owner => map.remove(name),
            _ => None,
        }
    }

    /// Drops every entry on `lease`, returning their owners: that lease ended.
    pub(crate) fn forget_all_on(&self, lease: i64) -> Vec<OwnerToken> {
        let mut map = self.held();
        let mut owners = Vec::new();
        map.retain(|_, h| {
            let on = h.lease == lease;
            if on {
                owners.push(h.owner);
            }
            !on
        });
        owners
    }

    /// Drops the entry for `name` only if it still records `owner` on
    /// `lease`; true if it did. A renewal that judged `lease` must not drop
    /// what a concurrent renewal of the same owner moved the key to.
    pub(crate) fn forget_lease(&self, name: &LockName, owner: &OwnerToken, lease: i64) -> bool {
        let mut map = self.held();
        match map.get(name) {
            Some(h) if h.owner == *owner && h.lease == lease => map.remove(name).is_some(),
            _ => false,
        }
    }

    /// Revokes a lease that guards nothing of ours any more, without making
    /// the caller wait; if it fails, the lease simply runs out.
    pub(crate) fn revoke_in_background(&self, lease: i64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let members = Arc::clone(&self.members);
        let limit = self.timeout;
        runtime.spawn(async move {
            let revoked = members
                .run(limit, "revoke an unused lease", |at| async move {
                    match at.client.lease_client().revoke(lease).await {
                        Err(e) if !is_lease_not_found(&e) => Err(convert("lease revoke", e)),
                        _ => Ok(()),
                    }
                })
                .await;
            if let Err(e) = revoked {
                debug!(lease, error = %e, "revoking an unused lease failed; it will expire");
            }
        });
    }

    /// Rejects TTLs the cluster would silently lengthen.
    pub(crate) fn check_ttl(&self, ttl: Duration) -> Result<(), BackendError> {
        if ttl < self.min_ttl {
            return Err(BackendError::new(
                BackendErrorKind::Config,
                format!(
                    "a TTL of {ttl:?} is below this etcd cluster's minimum lease TTL of {:?}",
                    self.min_ttl
                ),
            ));
        }
        Ok(())
    }
}

/// The key that holds the lock `name` under `prefix`.
pub(crate) fn key_in(prefix: &str, name: &LockName) -> String {
    // Built directly: a renewal sweep builds one per lease held.
    let mut key = String::with_capacity(prefix.len() + name.as_str().len());
    key.push_str(prefix);
    key.push_str(name.as_str());
    key
}

pub(crate) fn secs(seconds: i64) -> Duration {
    Duration::from_secs(seconds.max(1).unsigned_abs())
}

/// As [`classify`], with `mark`, the mark a forced release leaves (read in
/// the same transaction as the key): a hold lost to a forced release of
/// `owner`'s lease is [`LeaseStatus::Forced`], not expired or stolen.
pub(crate) fn classify_marked(
    kv: Option<&KeyValue>,
    mark: Option<&KeyValue>,
    owner: &OwnerToken,
    lease: i64,
    ttl: i64,
) -> LeaseStatus {
    match classify(kv, owner, lease, ttl) {
        LeaseStatus::Expired | LeaseStatus::Stolen
            if mark.is_some_and(|m| owned_by(m.value(), owner)) =>
        {
            LeaseStatus::Forced
        }
        status => status,
    }
}

/// What the key says about `owner`'s hold, after a keep-alive of `lease`
/// answered `ttl`.
///
/// The owner token in the value decides whose key it is. Our token on
/// another lease means a concurrent renewal of this same owner moved the
/// key to a new lease (`retain_for`, or a new TTL): the key is ours and that
/// renewal set its lifetime, so it is held, and `lease` no longer matters.
pub(crate) fn classify(
    kv: Option<&KeyValue>,
    owner: &OwnerToken,
    lease: i64,
    ttl: i64,
) -> LeaseStatus {
    match kv {
        None => LeaseStatus::Expired,
        Some(kv) if !owned_by(kv.value(), owner) => LeaseStatus::Stolen,
        Some(kv) if kv.lease() != lease => LeaseStatus::Held,
        Some(_) if ttl > 0 => LeaseStatus::Held,
        // Our token on the lease we kept alive, but that lease is gone.
        Some(_) => LeaseStatus::Expired,
    }
}
