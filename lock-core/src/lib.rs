//! Backend-independent distributed locking.
//!
//! A [`LockBackend`] makes single attempts against one lock service (Redis,
//! Postgres, etcd, or the in-process memory backend). Everything that loops or
//! waits lives here, once: the [`Locker`] acquires (once, or waiting with
//! timeout and cancellation), a heartbeat renews every held lease at
//! `ttl / 3`, a watchdog ends leases at their `max_hold`, and every outcome is
//! counted in Prometheus metrics.
//!
//! # What a lease promises
//!
//! - **Mutual exclusion** while the backend's lease is valid, and **owner-only
//!   renewal and release** by a 128-bit [`OwnerToken`].
//! - **Local validity.** A lease is valid locally until
//!   `request_sent_at + ttl - drift`, counted on the monotonic clock from when
//!   the last successful acquire or renew request was *sent*.
//!   [`LeaseHandle::assert_held`] fails after that instant even if the
//!   heartbeat never ran, so a paused or starved process does not trust a stale
//!   flag.
//! - **Fail closed.** Losing a lease (stolen, expired, backend down past the
//!   deadline, `max_hold` reached) fires the lease's cancellation token, makes
//!   `assert_held` fail, and aborts a [`Locker::with_lock`] job; a backend
//!   that cannot be reached at acquire time means the job does not run.
//! - **Fencing tokens** where the backend issues them: pass
//!   [`LeaseHandle::fencing_token`] to the protected resource and have it
//!   reject lower tokens. A lease cannot stop a paused process from believing
//!   it is still inside its critical section; a fencing token can stop its
//!   writes from landing.
//!
//! # Examples
//!
//! See [`Locker`].
#![forbid(unsafe_code)]

mod admin;
pub mod backend;
mod background;
pub mod detach;
mod error;
mod heartbeat;
pub mod inspect;
pub mod lane;
mod lease;
mod local;
mod local_ticks;
mod locker;
mod loss_feed;
mod metrics;
mod name;
mod options;
mod outcome;
pub mod redact;
mod start_check;
pub mod tick_record;
mod ticks;
mod token;
mod wait;

pub(crate) use backend::{
    AcquireAttempt, Expiry, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest,
};
pub use backend::{Capabilities, LockBackend};
pub use error::{BackendError, BackendErrorKind, Error, LossReason, Result};
pub use inspect::{ForceOutcome, Holder, HolderPage, Identity};
pub use lease::{LeaseHandle, LockGuard};
pub use locker::{Locker, LockerBuilder};
pub use metrics::{AcquireOutcome, LockMetrics, RenewalOutcome};

/// Registering a set of metrics once per registry: what [`LockMetrics`] and
/// the scheduler's metrics use so that every user of one registry shares one
/// set of series. For crates that add metrics of their own beside these.
pub mod shared_metrics {
    pub use crate::metrics::{
        in_default_registry, register_shared, MetricSet, SharedRegistrationError,
    };
}
pub use name::{LockName, MAX_NAME_LEN};
pub use options::{LockOptions, MAX_TTL};
pub use outcome::{RunError, RunOutcome, SkipReason};
pub use start_check::{StartCheck, StartVerdict};
pub use tick_record::{OnStale, TickAnswer, TickRecord, TickWrite};
pub use ticks::{start_checked_apart, write_ticks_apart, TickStore};
pub use token::OwnerToken;

/// Re-exported so backends and callers name the same `async_trait`.
pub use async_trait::async_trait;

/// The metrics library [`Locker`] registers with, so a service can pass a
/// `Registry` and expose it without a dependency (and version) of its own.
pub use prometheus;

/// The token a lease fires when it ends ([`LeaseHandle::cancellation_token`]).
pub use tokio_util::sync::CancellationToken;
