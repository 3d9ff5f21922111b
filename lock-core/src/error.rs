//! The error types: one for callers ([`Error`]), one for backends ([`BackendError`]).

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::LockName;

/// `Result` with this crate's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a held lease stopped being valid.
///
/// The [`LossReason::as_str`] values are the `reason` label of
/// `distributed_lock_lost_total`; dashboards and alerts depend on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// Another owner holds the lock now (a renewal or check found a foreign token).
    Stolen,
    /// The lease vanished on the server, or its local validity deadline passed
    /// without a successful renewal.
    Expired,
    /// The backend kept failing until the local validity deadline passed.
    BackendError,
    /// The lease was held for its configured maximum hold time; the watchdog
    /// cancelled the job and released the lock.
    MaxHoldExceeded,
    /// An operator freed the lock with a forced release naming this lease's
    /// fencing token ([`Locker::force_release`](crate::Locker::force_release)).
    Forced,
    /// The holder released the lease, dropped its guard, or its retained hold
    /// ended. Not a loss: it is not counted in `distributed_lock_lost_total`,
    /// but handles stop reporting the lease held.
    Released,
}

impl LossReason {
    /// Every reason counted in `distributed_lock_lost_total` (all but
    /// [`LossReason::Released`]).
    pub const LOSSES: [Self; 5] = [
        Self::Stolen,
        Self::Expired,
        Self::BackendError,
        Self::MaxHoldExceeded,
        Self::Forced,
    ];

    /// The metric label value: `stolen`, `expired`, `backend_error`,
    /// `max_hold_exceeded` or `forced` (and `released`, which is never counted).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Stolen => "stolen",
            Self::Expired => "expired",
            Self::BackendError => "backend_error",
            Self::MaxHoldExceeded => "max_hold_exceeded",
            Self::Forced => "forced",
            Self::Released => "released",
        }
    }

    /// Whether the lease ended against its holder's will (everything but
    /// [`LossReason::Released`]); only these are counted as losses.
    pub const fn is_loss(self) -> bool {
        !matches!(self, Self::Released)
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything that can go wrong when using a [`Locker`](crate::Locker).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock name is empty, too long or uses characters outside `[A-Za-z0-9._:/-]`.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The rejected name (shortened if very long).
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An option or a configuration value is out of range or malformed.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Another owner holds the lock.
    #[error("lock {name} is held by another owner")]
    HeldElsewhere {
        /// The contended lock.
        name: LockName,
    },
    /// The lock is already held, or being acquired, through this same `Locker`.
    #[error("lock {name} is already held or being acquired in this process")]
    HeldLocally {
        /// The lock.
        name: LockName,
    },
    /// A waiting acquire did not get the lock before its timeout.
    #[error("timed out after {waited:?} waiting for lock {name}")]
    Timeout {
        /// The lock waited for.
        name: LockName,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The backend could not be reached or failed; nothing ran (fail closed).
    #[error("lock backend unavailable for {name}: {source}")]
    Unavailable {
        /// The lock that was being acquired.
        name: LockName,
        /// What the backend reported.
        #[source]
        source: BackendError,
    },
    /// The `Locker` has no backend and was built with `lock_required`, so it
    /// refuses to run anything unlocked. Configure a backend, or drop `lock_required`
    /// for single-replica deployments.
    #[error("lock {name} requires a backend, but this Locker has none and lock_required is set")]
    LockRequired {
        /// The lock that was requested.
        name: LockName,
    },
    /// The `Locker` was shut down ([`Locker::shutdown`](crate::Locker::shutdown));
    /// it acquires nothing more.
    #[error("lock {name} was not acquired: this Locker has been shut down")]
    ShutDown {
        /// The lock that was requested.
        name: LockName,
    },
    /// The lease is no longer valid (lost, or released by its holder); stop
    /// writing to the protected resource.
    #[error("lock {name} is no longer held ({reason}); stop before the next write")]
    LockLost {
        /// The lost lock.
        name: LockName,
        /// Why it was lost.
        reason: LossReason,
    },
    /// A backend call other than an acquire failed (release, check, renew on demand).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The operating system's random source failed; no owner token could be drawn.
    #[error("the operating system's random source failed: {0}")]
    Entropy(String),
}

impl Error {
    /// True for [`Error::LockLost`]: the job must stop and report itself aborted,
    /// not failed. Code that catches errors around guarded work should re-raise these.
    pub fn is_lock_lost(&self) -> bool {
        matches!(self, Self::LockLost { .. })
    }
}

/// What kind of failure a backend reports; guides the caller's reaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// The server could not be reached or the connection broke.
    Unavailable,
    /// The server did not answer within the configured timeout.
    Timeout,
    /// The server refused the credentials or the operation (ACL, RBAC, role).
    Auth,
    /// The backend is misconfigured (bad URL, missing TLS material, unsupported setup).
    Config,
    /// The server answered something the backend did not expect.
    Protocol,
    /// The backend does not offer this operation (an inspection or a forced
    /// release on a backend that cannot describe its locks).
    Unsupported,
    /// Anything else.
    Other,
}

impl BackendErrorKind {
    /// True for the kinds that mean "could not reach the server in time".
    pub const fn is_unavailable(self) -> bool {
        matches!(self, Self::Unavailable | Self::Timeout)
    }

    const fn as_str(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Auth => "not permitted",
            Self::Config => "misconfigured",
            Self::Protocol => "protocol error",
            Self::Unsupported => "not supported",
            Self::Other => "error",
        }
    }
}

/// An error reported by a [`LockBackend`](crate::LockBackend).
///
/// Backends keep their native client errors private and convert them into
/// this type, choosing the [`BackendErrorKind`] that tells callers what to do.
#[derive(Debug)]
pub struct BackendError {
    kind: BackendErrorKind,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl BackendError {
    /// A new error of `kind` with a message that says what failed.
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying client error.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Shorthand for an [`BackendErrorKind::Unavailable`] error.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Unavailable, message)
    }

    /// Shorthand for a [`BackendErrorKind::Timeout`] error.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Timeout, message)
    }

    /// The kind of failure.
    pub fn kind(&self) -> BackendErrorKind {
        self.kind
    }

    /// The message, without the source chain.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// A copy of this error for another caller of a call that served many
    /// (a batch): the same kind, and the message with the source chain
    /// rendered into it, since the source itself cannot be shared.
    pub fn copied(&self) -> Self {
        match &self.source {
            Some(source) => Self::new(self.kind, format!("{}: {source}", self.message)),
            None => Self::new(self.kind, self.message.clone()),
        }
    }

    /// This error as the answer of every one of a batch's `len` items
    /// (see [`BackendError::copied`]).
    pub fn for_each<T>(&self, len: usize) -> Vec<Result<T, Self>> {
        (0..len).map(|_| Err(self.copied())).collect()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
