//! What a backend implements: the [`LockBackend`] trait (single attempts
//! against one lock service) and the types it speaks in. Services only name
//! [`LockBackend`] and [`Capabilities`], which the crate root re-exports; the
//! rest is for writing a backend or a wrapper around one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::inspect::{ForceOutcome, Holder, HolderPage, Identity};
use crate::{BackendError, BackendErrorKind, LockName};

pub use crate::local_ticks::LocalTicks;
pub use crate::loss_feed::LossFeed;
pub use crate::ticks::TickStore;
pub use crate::token::OwnerToken;
/// Re-exported so backends and callers name the same `async_trait`.
pub use async_trait::async_trait;

/// How a backend's leases end when their holder disappears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Expiry {
    /// The server forgets the lease when its TTL runs out (Redis, etcd, memory).
    Ttl,
    /// The lease lives as long as the server-side session that took it
    /// (Postgres advisory locks). The TTL is then the client's failure-detection
    /// bound: how long a lease stays valid locally without proof that the session
    /// is alive and still holds it.
    Session,
}

/// What a backend can do, so generic code and tests can adapt without
/// matching on backend names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// How leases end when the holder disappears.
    pub expiry: Expiry,
    /// Whether [`Lease::fencing_token`] is set: a `u64` strictly greater than
    /// every earlier one for the same name.
    pub fencing: bool,
    /// Whether [`LockBackend::renew_many`] renews many leases in one round trip.
    pub batch_renew: bool,
    /// Whether [`LockBackend::subscribe_release`] can report releases, so a
    /// waiting acquire wakes on release instead of polling.
    pub release_notify: bool,
    /// The shortest TTL the backend honours exactly; shorter TTLs are rejected.
    pub min_ttl: Duration,
    /// The longest TTL the backend can keep safe, if it has a limit (a session
    /// backend whose server-side dead-peer detection is configured for it).
    pub max_ttl: Option<Duration>,
    /// Whether [`LockBackend::loss_feed`] reports leases that ended on the
    /// server as soon as the backend learns of it, rather than at their next
    /// renewal.
    pub loss_push: bool,
}

impl Capabilities {
    /// Capabilities of a backend with the given expiry model and nothing optional.
    pub const fn new(expiry: Expiry) -> Self {
        Self {
            expiry,
            fencing: false,
            batch_renew: false,
            release_notify: false,
            min_ttl: Duration::from_millis(1),
            max_ttl: None,
            loss_push: false,
        }
    }

    /// Declares that the backend pushes losses through its [`LossFeed`].
    pub const fn with_loss_push(mut self, yes: bool) -> Self {
        self.loss_push = yes;
        self
    }

    /// Declares fencing-token support.
    pub const fn with_fencing(mut self, yes: bool) -> Self {
        self.fencing = yes;
        self
    }

    /// Declares one-round-trip batch renewal.
    pub const fn with_batch_renew(mut self, yes: bool) -> Self {
        self.batch_renew = yes;
        self
    }

    /// Declares release notification.
    pub const fn with_release_notify(mut self, yes: bool) -> Self {
        self.release_notify = yes;
        self
    }

    /// Declares the longest TTL the backend can keep safe.
    pub const fn with_max_ttl(mut self, max_ttl: Duration) -> Self {
        self.max_ttl = Some(max_ttl);
        self
    }

    /// Declares the shortest TTL the backend honours.
    pub const fn with_min_ttl(mut self, min_ttl: Duration) -> Self {
        self.min_ttl = min_ttl;
        self
    }
}

/// A lease granted by [`LockBackend::try_acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The fencing token, when the backend issues them.
    pub fencing_token: Option<u64>,
    /// How long the server is known to keep the lock, counted from when the
    /// attempt was sent, when that is less than the TTL asked for; `None`:
    /// the whole TTL. A backend whose locks share a server-side lease sets
    /// it when the lease's last proof of life came before the attempt: the
    /// lock is then valid locally only that long, and its first renewal
    /// comes that much earlier.
    pub lasts_at_least: Option<Duration>,
}

impl Lease {
    /// A lease with an optional fencing token, kept by the server for the
    /// whole TTL.
    pub const fn new(fencing_token: Option<u64>) -> Self {
        Self {
            fencing_token,
            lasts_at_least: None,
        }
    }

    /// The same lease, known to be kept by the server only for `d` after
    /// the attempt was sent (see [`Lease::lasts_at_least`]).
    #[must_use]
    pub const fn with_lasts_at_least(mut self, d: Duration) -> Self {
        self.lasts_at_least = Some(d);
        self
    }
}

/// The answer to one acquire attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireAttempt {
    /// The caller's token now owns the lock.
    Acquired(Lease),
    /// Another owner holds the lock; nothing was changed.
    HeldElsewhere,
}

/// What a renew or check found on the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LeaseStatus {
    /// The lease is still ours (and, for a renew, was extended).
    Held,
    /// No lease exists for the name any more.
    Expired,
    /// The name is held by a different owner token.
    Stolen,
    /// An operator's forced release freed this owner's lease (see
    /// [`LockBackend::force_release`]); reported instead of `Expired` or
    /// `Stolen` for as long as the backend keeps the mark of it.
    Forced,
}

/// The answer to a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// Our lease was deleted.
    Released,
    /// Nothing of ours was there; nothing was deleted.
    NotHeld,
}

/// One lease to renew in a [`LockBackend::renew_many`] batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewRequest {
    /// The lock.
    pub name: LockName,
    /// Its owner token.
    pub owner: OwnerToken,
    /// The TTL to extend to, counted from when the server applies it.
    pub ttl: Duration,
}

/// A future that completes when the backend observes a release of one name.
///
/// It may complete spuriously (for instance on reconnect); callers simply try
/// to acquire again. Dropping it unsubscribes.
pub struct ReleaseSignal(Pin<Box<dyn Future<Output = ()> + Send + 'static>>);

impl ReleaseSignal {
    /// Wraps a future that resolves on release.
    pub fn new(fut: impl Future<Output = ()> + Send + 'static) -> Self {
        Self(Box::pin(fut))
    }
}

impl Future for ReleaseSignal {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for ReleaseSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReleaseSignal")
    }
}

/// One lock service, spoken to in single attempts.
///
/// # Contract
///
/// - Implementations MUST only make single attempts. Waiting, retrying,
///   renewing on a timer, timeouts around the whole operation and metrics live
///   once in [`Locker`](crate::Locker), never in a backend.
/// - At most one owner token MUST hold a name at any instant (mutual exclusion).
/// - `renew`, `check` and `release` MUST compare on the owner token: they never
///   extend, report as held, or delete a lease carrying another token, and
///   `release` never re-creates a key.
/// - Where [`Capabilities::fencing`] is declared, each `Acquired` MUST carry a
///   token strictly greater than every earlier one for that name.
/// - An `Acquired` lock MUST be kept by the server for at least the TTL asked
///   for, counted from when `try_acquire` was called, or for the shorter time
///   its [`Lease::lasts_at_least`] says; the local deadline never outlasts it.
/// - Every call MUST return within the backend's configured operation timeout
///   (a paused or partitioned server yields an error of kind
///   [`BackendErrorKind::Timeout`], never a hang).
/// - Native client errors MUST be converted into [`BackendError`] with a kind
///   that says whether the server was unreachable.
///
/// # Cancel safety
///
/// Callers may drop any of these futures. A dropped `try_acquire` may have
/// taken the lock on the server; [`Locker`](crate::Locker) handles that by
/// releasing the token it used, so backends need no extra bookkeeping for it
/// beyond making `release` of an unknown token a harmless `NotHeld`.
#[async_trait]
pub trait LockBackend: fmt::Debug + Send + Sync {
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// Tries once to take `name` for `owner`, expiring after `ttl` unless renewed.
    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError>;

    /// Extends the lease of `owner` on `name` to `ttl` from now, if `owner` still holds it.
    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError>;

    /// Reports whether `owner` still holds `name`, without extending it.
    async fn check(&self, name: &LockName, owner: &OwnerToken)
        -> Result<LeaseStatus, BackendError>;

    /// Deletes the lease of `owner` on `name`, if `owner` still holds it.
    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError>;

    /// Renews many leases, returning one status per request in the same order.
    ///
    /// Backends that declare [`Capabilities::batch_renew`] SHOULD do this in one
    /// round trip. The default renews one by one.
    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            out.push(self.renew(&r.name, &r.owner, r.ttl).await?);
        }
        Ok(out)
    }

    /// Subscribes to releases of `name`, for waiters.
    ///
    /// The subscription MUST be in place when this returns, so that a release
    /// happening after the caller's next `try_acquire` is not missed. Returns
    /// `Ok(None)` when the backend cannot notify (the default); callers then poll.
    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let _ = name;
        Ok(None)
    }

    /// The feed through which this backend reports leases that ended on the
    /// server (a closed session, a revoked lease) the moment it learns of it.
    ///
    /// Backends that return one MUST declare [`Capabilities::loss_push`] and
    /// MUST call [`LossFeed::leases_ended`] before they themselves free the
    /// locks (closing a session on purpose), and as soon as they notice
    /// otherwise. The default is `None`: losses are found by renewal.
    fn loss_feed(&self) -> Option<LossFeed> {
        None
    }

    /// Tries once to take `name` for `owner` as [`LockBackend::try_acquire`]
    /// does, storing `holder` with the lease so that inspections can name
    /// who holds it. The default ignores `holder`.
    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        let _ = holder;
        self.try_acquire(name, owner, ttl).await
    }

    /// Who holds `name` now, or `None` when nobody does. Reads only: it
    /// MUST NOT take, extend or free anything. A lock held by a program that
    /// stores no holder data MUST be answered as held, by a
    /// [`Holder::unknown`]. The default answers
    /// [`BackendErrorKind::Unsupported`].
    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        let _ = name;
        Err(unsupported("describe"))
    }

    /// One page of the held locks whose names start with `prefix` (already
    /// validated: name characters only), at most `limit` of them (at least
    /// one, at most [`MAX_LIST_PAGE`](crate::inspect::MAX_LIST_PAGE)),
    /// starting where the `cursor` of the previous page said. Reads only.
    /// A lock held the whole time a listing runs MUST appear on one of its
    /// pages; one taken or freed meanwhile may or may not. The default
    /// answers [`BackendErrorKind::Unsupported`].
    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        let _ = (prefix, cursor, limit);
        Err(unsupported("list"))
    }

    /// Frees `name` if the lease holding it carries the fencing token
    /// `expected_token`: an operator's act, for a holder that cannot be
    /// stopped any other way.
    ///
    /// MUST compare on the token in the same server step that frees the lock
    /// (never free a successor), and MUST leave a mark so that the freed
    /// owner's next `renew` or `check` answers [`LeaseStatus::Forced`] for
    /// at least the TTL it last asked for. The next holder's token is higher,
    /// as for any acquire. The default answers
    /// [`BackendErrorKind::Unsupported`].
    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        let _ = (name, expected_token);
        Err(unsupported("force_release"))
    }
}

/// The error a backend answers for an operation it does not offer.
fn unsupported(what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Unsupported,
        format!("this backend does not offer {what}; inspect the server with its own tools"),
    )
}

macro_rules! forward_backend {
    ($ptr:ident) => {
        #[async_trait]
        #[deny(clippy::missing_trait_methods)]
        impl<T: LockBackend + ?Sized> LockBackend for $ptr<T> {
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            async fn try_acquire(
                &self,
                name: &LockName,
                owner: &OwnerToken,
                ttl: Duration,
            ) -> Result<AcquireAttempt, BackendError> {
                (**self).try_acquire(name, owner, ttl).await
            }
            async fn renew(
                &self,
                name: &LockName,
                owner: &OwnerToken,
                ttl: Duration,
            ) -> Result<LeaseStatus, BackendError> {
                (**self).renew(name, owner, ttl).await
            }
            async fn check(
                &self,
                name: &LockName,
                owner: &OwnerToken,
            ) -> Result<LeaseStatus, BackendError> {
                (**self).check(name, owner).await
            }
            async fn release(
                &self,
                name: &LockName,
                owner: &OwnerToken,
            ) -> Result<ReleaseOutcome, BackendError> {
                (**self).release(name, owner).await
            }
            async fn renew_many(
                &self,
                requests: &[RenewRequest],
            ) -> Result<Vec<LeaseStatus>, BackendError> {
                (**self).renew_many(requests).await
            }
            async fn subscribe_release(
                &self,
                name: &LockName,
            ) -> Result<Option<ReleaseSignal>, BackendError> {
                (**self).subscribe_release(name).await
            }
            fn loss_feed(&self) -> Option<LossFeed> {
                (**self).loss_feed()
            }

            async fn try_acquire_as(
                &self,
                name: &LockName,
                owner: &OwnerToken,
                ttl: Duration,
                holder: &Identity,
            ) -> Result<AcquireAttempt, BackendError> {
                (**self).try_acquire_as(name, owner, ttl, holder).await
            }

            async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
                (**self).describe(name).await
            }

            async fn list(
                &self,
                prefix: &str,
                cursor: Option<&str>,
                limit: usize,
            ) -> Result<HolderPage, BackendError> {
                (**self).list(prefix, cursor, limit).await
            }

            async fn force_release(
                &self,
                name: &LockName,
                expected_token: u64,
            ) -> Result<ForceOutcome, BackendError> {
                (**self).force_release(name, expected_token).await
            }
        }
    };
}

forward_backend!(Arc);
forward_backend!(Box);
