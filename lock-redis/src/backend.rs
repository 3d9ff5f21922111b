//! [`RedisBackend`]: the [`LockBackend`] implementation.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use lock_core::{
    async_trait,
    backend::{AcquireAttempt, Expiry, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest},
    BackendError, BackendErrorKind, Capabilities, ForceOutcome, Holder, HolderPage, Identity,
    LockBackend, LockName, OwnerToken,
};

use tracing::{debug, warn};

use crate::ack::{self, ReplicaAck};
use crate::attempts::{self, Attempts};
use crate::cluster;
use crate::connection::{Connection, Source};
use crate::error::{config, protocol};
use crate::inspect;
use crate::notify::ReleaseNotifier;
use crate::scripts::{KeySpace, CHECK, RELEASE, RENEW, RENEW_MANY};
use crate::unfenced::SetGetRefused;
use crate::RedisBuilder;

/// Locks in one Redis primary (fixed, or found through Sentinel) or in a
/// Redis Cluster. Cheap to clone; clones share connections.
///
/// Build it with [`RedisBuilder`]. Each value holds one command connection and,
/// once a waiter needs it, one subscriber connection; separate processes (or
/// tests simulating them) build separate backends.
///
/// # Examples
///
/// ```no_run
/// # async fn demo() -> lock_core::Result<()> {
/// use std::time::Duration;
/// use lock_core::{Locker, LockName, LockOptions};
/// use lock_redis::RedisBuilder;
///
/// let backend = RedisBuilder::from_env()?.connect().await?;
/// let locker = Locker::new(backend)?;
/// let guard = locker
///     .try_lock(&LockName::new("reports/nightly")?, &LockOptions::new(Duration::from_secs(30)))
///     .await?;
/// let token = guard.fencing_token(); // pass it to the resource you write to
/// guard.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) conn: Connection,
    notifier: ReleaseNotifier,
    pub(crate) keys: KeySpace,
    warned_no_pubsub: AtomicBool,
    pub(crate) replica_ack: Option<ReplicaAck>,
    /// Whether acquires draw fencing tokens.
    pub(crate) fencing: bool,
    pub(crate) set_get_refused: SetGetRefused,
    /// Lock attempts coalesced while others are in flight (not in cluster
    /// mode, nor with replica acknowledgement).
    pub(crate) attempts: Attempts,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("server", &self.shared.conn.target())
            .field("keys", &self.shared.keys)
            .field("replica_ack", &self.shared.replica_ack)
            .field("fencing", &self.shared.fencing)
            .finish()
    }
}

impl RedisBackend {
    /// A batch's statuses, with each lease found gone or taken checked for
    /// a forced-release mark (one read per lost lease, all sent together, so
    /// a batch that lost many leases at once, after a restart say, answers
    /// in one more round trip rather than one per lease; none in the usual
    /// batch where every lease was renewed).
    async fn unless_forced_many(
        &self,
        requests: &[RenewRequest],
        found: Vec<LeaseStatus>,
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        join_all(
            requests
                .iter()
                .zip(found)
                .map(|(r, st)| inspect::unless_forced(&self.shared, &r.name, &r.owner, st)),
        )
        .await
        .into_iter()
        .collect()
    }

    pub(crate) fn from_parts(
        config: RedisBuilder,
        source: Source,
        replica_ack: Option<ReplicaAck>,
    ) -> Self {
        let target = config.target();
        // A call may queue behind another's WAIT on the shared connection.
        let op_timeout = config
            .operation_timeout()
            .saturating_add(replica_ack.map_or(Duration::ZERO, |a| a.timeout()));
        let conn = Connection::new(
            source.clone(),
            target.clone(),
            config.connect_timeout(),
            op_timeout,
        );
        let notifier = ReleaseNotifier::new(
            source,
            target,
            config.connect_timeout(),
            config.operation_timeout(),
        );
        Self {
            shared: Arc::new(Shared {
                conn,
                notifier,
                keys: if config.is_cluster() {
                    KeySpace::cluster(config.key_prefix())
                } else {
                    KeySpace::new(config.key_prefix())
                },
                warned_no_pubsub: AtomicBool::new(false),
                replica_ack,
                fencing: config.fencing_tokens(),
                set_get_refused: SetGetRefused::default(),
                attempts: Attempts::default(),
            }),
        }
    }

    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// Checks that the server answers and accepts the credentials.
    ///
    /// # Errors
    ///
    /// `Unavailable`/`Timeout` when it cannot be reached in time, `Auth` when
    /// it refuses the login, `Config` on a TLS mismatch.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn ping(&self) -> Result<(), BackendError> {
        let conn = &self.shared.conn;
        // A first call also opens the connection, so it gets both budgets.
        let limit = conn.connect_timeout() + conn.op_timeout();
        let answer = conn
            .run_within("ping", limit, |mut c| async move {
                redis::cmd("PING").query_async::<String>(&mut c).await
            })
            .await;
        match answer {
            Err(e) if e.kind() == BackendErrorKind::Timeout && conn.target().starts_with("rediss://") => {
                Err(BackendError::timeout(format!(
                    "{} (a server that is not TLS-enabled on this port never answers the TLS handshake: check the port, or use redis://)",
                    e.message()
                )))
            }
            other => other.map(|_| ()),
        }
    }

    /// The key that holds `name`'s owner token, for operators and tests.
    pub fn key_for(&self, name: &LockName) -> String {
        self.shared.keys.lock(name)
    }

    /// The key of the fencing counter shared by every name under the prefix
    /// (single server and Sentinel; a cluster has one per slot, see
    /// [`RedisBackend::fence_key_for`]).
    pub fn fence_key(&self) -> String {
        self.shared.keys.fence()
    }

    /// The key of the fencing counter `name`'s acquire increments: the
    /// shared one, or in cluster mode the one of the lock key's slot.
    pub fn fence_key_for(&self, name: &LockName) -> String {
        self.shared.keys.fence_for(name)
    }

    /// The replica acknowledgement every acquire and renewal waits for, if on.
    pub fn replica_ack(&self) -> Option<ReplicaAck> {
        self.shared.replica_ack
    }

    /// Whether a failover can never hand out a fencing token that is not
    /// above every token handed out before it, in a deployment whose primary
    /// has `replicas_in_deployment` replicas: true when fencing tokens are on
    /// (false without tokens), acknowledgement is on and asks for every one of them (and there is at least one), since
    /// then the counter's increment is on every replica, so on any promoted
    /// one, before its token is handed out.
    ///
    /// This relies on the replicas keeping what they acknowledged: a replica
    /// restarted without persistence, or one that resynchronised from a
    /// primary that lacked the write, can lose it (`WAIT` does not make Redis
    /// strongly consistent). With fewer replicas asked for, a failover
    /// usually promotes one that acknowledged (Sentinel prefers the highest
    /// replication offset after the priority), but that is likely, not
    /// certain, and this returns false.
    pub fn tokens_survive_failover(&self, replicas_in_deployment: usize) -> bool {
        self.shared.fencing
            && self.shared.replica_ack.is_some_and(|a| {
                replicas_in_deployment > 0 && usize::from(a.replicas()) >= replicas_in_deployment
            })
    }
}

impl RedisBackend {
    /// One acquire attempt, through the path the deployment uses, storing
    /// `holder` in the holder record.
    async fn acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: Option<&Identity>,
    ) -> Result<AcquireAttempt, BackendError> {
        let ms = ttl_ms(ttl)?;
        if let Some(a) = &self.shared.replica_ack {
            return ack::acquire(&self.shared, a, name, owner, ms, holder).await;
        }
        if self.shared.keys.is_cluster() {
            // A script's keys must share a slot: one attempt per command.
            return attempts::alone(&self.shared, name, owner, ms, holder).await;
        }
        attempts::acquire(&self.shared, name, owner, ms, holder).await
    }
}

/// TTL in whole milliseconds, rounded up so a lease never ends early.
fn ttl_ms(ttl: Duration) -> Result<u64, BackendError> {
    let ms = ttl.as_nanos().div_ceil(1_000_000);
    match u64::try_from(ms) {
        Ok(ms) if ms >= 1 && ms <= i64::MAX as u64 / 2 => Ok(ms),
        _ => Err(config(format!(
            "a TTL of {ttl:?} is outside what Redis accepts"
        ))),
    }
}

pub(crate) fn status(code: i64, op: &str, target: &str) -> Result<LeaseStatus, BackendError> {
    match code {
        1 => Ok(LeaseStatus::Held),
        0 => Ok(LeaseStatus::Expired),
        2 => Ok(LeaseStatus::Stolen),
        3 => Ok(LeaseStatus::Forced),
        other => Err(protocol(op, target, other)),
    }
}

#[async_trait]
impl LockBackend for RedisBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(Expiry::Ttl)
            .with_fencing(self.shared.fencing)
            .with_batch_renew(true)
            // A cluster broadcasts PUBLISH to every node; its waiters poll.
            .with_release_notify(!self.shared.keys.is_cluster())
    }

    /// Takes the lock and writes a holder record beside it without an
    /// identity (with fencing tokens; without them, `SET NX PX GET` alone):
    /// inspections show the holder with no identity.
    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, None).await
    }

    /// Takes the lock and writes the holder record (owner, fencing token,
    /// the server's time, TTL and `holder`) in the same script, in the lock
    /// key's slot.
    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire(name, owner, ttl, Some(holder)).await
    }

    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        inspect::describe(&self.shared, name).await
    }

    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        inspect::list(&self.shared, prefix, cursor, limit).await
    }

    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        inspect::force_release(&self.shared, name, expected_token).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let ms = ttl_ms(ttl)?;
        if let Some(a) = &self.shared.replica_ack {
            return ack::renew(&self.shared, a, name, owner, ms).await;
        }
        let keys = &self.shared.keys;
        let lease = [keys.lock(name), keys.meta(name)];
        let token = owner.to_hex();
        let conn = &self.shared.conn;
        let code: i64 = conn
            .run("renew", |mut c| async move {
                RENEW.run(&mut c, &lease, &[token, ms.to_string()]).await
            })
            .await?;
        let found = status(code, "renew", conn.target())?;
        inspect::unless_forced(&self.shared, name, owner, found).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        let keys = [self.shared.keys.lock(name)];
        let token = owner.to_hex();
        let conn = &self.shared.conn;
        let code: i64 = conn
            .run("check", |mut c| async move {
                CHECK.run(&mut c, &keys, &[token]).await
            })
            .await?;
        let found = status(code, "check", conn.target())?;
        inspect::unless_forced(&self.shared, name, owner, found).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        // An attempt of this owner still queued must not take the lock
        // after this release (see `attempts`).
        self.shared.attempts.settled(owner).await;
        let keys = &self.shared.keys;
        let lease = [keys.lock(name), keys.meta(name)];
        let (channel, token) = (keys.channel(name), owner.to_hex());
        let conn = &self.shared.conn;
        let code: i64 = conn
            .run("release", |mut c| async move {
                RELEASE.run(&mut c, &lease, &[token, channel]).await
            })
            .await?;
        match code {
            1 => Ok(ReleaseOutcome::Released),
            0 => Ok(ReleaseOutcome::NotHeld),
            other => Err(protocol("release", conn.target(), other)),
        }
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        if self.shared.keys.is_cluster() {
            let keys = &self.shared.keys;
            let (keys, args) = cluster::split_requests(
                requests,
                |r| [keys.lock(&r.name), keys.meta(&r.name)],
                ttl_ms,
            )?;
            let target = self.shared.conn.target();
            let found = cluster::renew_by_slot(&self.shared.conn, keys, args, |c| {
                status(c, "renew batch", target)
            })
            .await?;
            return self.unless_forced_many(requests, found).await;
        }
        let mut keys = Vec::with_capacity(requests.len() * 2);
        let mut args = Vec::with_capacity(requests.len() * 2);
        for r in requests {
            keys.push(self.shared.keys.lock(&r.name));
            keys.push(self.shared.keys.meta(&r.name));
            args.push(r.owner.to_hex());
            args.push(ttl_ms(r.ttl)?.to_string());
        }
        let conn = &self.shared.conn;
        let codes: Vec<i64> = match &self.shared.replica_ack {
            Some(a) => ack::renew_many(conn, a, &keys, &args).await?,
            None => {
                conn.run("renew batch", |mut c| async move {
                    RENEW_MANY.run(&mut c, &keys, &args).await
                })
                .await?
            }
        };
        if codes.len() != requests.len() {
            return Err(protocol(
                "renew batch",
                conn.target(),
                format!("{} statuses for {} leases", codes.len(), requests.len()),
            ));
        }
        let found = codes
            .into_iter()
            .map(|c| status(c, "renew batch", conn.target()))
            .collect::<Result<Vec<_>, _>>()?;
        self.unless_forced_many(requests, found).await
    }

    /// Subscribes on the name's channel. When pub/sub cannot be had (the
    /// server is unreachable, or an ACL user lacks `subscribe` or the channel)
    /// it returns `Ok(None)` and the caller polls instead.
    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let shared = &self.shared;
        if shared.keys.is_cluster() {
            return Ok(None);
        }
        let limit = shared.conn.op_timeout();
        let subscribe = shared.notifier.subscribe(shared.keys.channel(name));
        let Ok(outcome) = tokio::time::timeout(limit, subscribe).await else {
            debug!(lock = %name, "release subscription did not complete within {limit:?}; polling");
            return Ok(None);
        };
        match outcome {
            Ok(signal) => Ok(Some(signal)),
            Err(e) if e.kind() == BackendErrorKind::Auth => {
                if !shared.warned_no_pubsub.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "release notification refused; waiting acquires poll instead (grant subscribe and the &<prefix>* channels)");
                }
                Ok(None)
            }
            Err(e) => {
                debug!(error = %e, "release notification unavailable; polling");
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_and_rejects_the_absurd() {
        assert_eq!(ttl_ms(Duration::from_micros(1)).ok(), Some(1));
        assert_eq!(ttl_ms(Duration::from_micros(1500)).ok(), Some(2));
        assert_eq!(ttl_ms(Duration::from_secs(3)).ok(), Some(3000));
        assert!(ttl_ms(Duration::ZERO).is_err());
        assert!(ttl_ms(Duration::MAX).is_err());
    }
}
