//! Distributed locks and a leader-elected cron scheduler for Rust services.
//!
//! This is the crate a service adds. Pick backends with cargo features and
//! name one by URL at run time:
//!
//! | feature | adds | URL |
//! |---|---|---|
//! | `memory` (default) | `distlock::memory`: in-process; one replica, tests | `memory://`, `memory://NAME` |
//! | `redis` | `distlock::redis`: `SET NX PX` with a fencing counter | `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://` |
//! | `postgres` | `distlock::postgres`: session-scoped advisory locks | `postgres://`, `postgresql://` |
//! | `etcd` | `distlock::etcd`: one shared lease per instance and TTL (builds with `protoc`) | `etcd://`, `etcds://` |
//! | `scheduler` | `distlock::scheduler`: cron jobs run once across replicas | |
//! | `metrics-http` | `distlock::metrics_http`: `GET /metrics` with an optional bearer token | |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock::Result<()> {
//! use std::time::Duration;
//! use distlock::{LockName, LockOptions};
//!
//! // From the environment in a service: LOCK_URL=redis://cache:6379, say.
//! let locks = distlock::connect("memory://").await?;
//! let locker = locks.locker()?; // one per process; clone it freely
//! let name = LockName::new("billing/nightly-report")?;
//! let guard = locker.try_lock(&name, &LockOptions::new(Duration::from_secs(30))).await?;
//! guard.assert_held()?; // before every write the lock protects
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! A service takes its backend from the environment with [`from_env`]:
//! [`LOCK_URL`] names it; without it, locks are granted behind the
//! in-process guard only (one replica; warned and counted `unlocked`),
//! unless [`SCHEDULER_LOCK_REQUIRED`] is true, which refuses to start. A
//! server that is down at start does not stop the service: every attempt
//! fails closed until the server answers. [`Policy`] has the whole table.
//!
//! Every `Locker` and `Scheduler` in a process may report into the same
//! Prometheus registry (the default one unless told otherwise): metrics
//! registered there already are shared, never refused.
//!
//! The items at the top level are the lock API of `lock-core`; the modules
//! are the backend crates and the scheduler, whole, for their builders and
//! anything beyond a URL.
#![forbid(unsafe_code)]

mod locks;

#[cfg(feature = "metrics-http")]
pub mod metrics_http;

pub use locks::{connect, from_env, from_policy, Locks};

/// The availability policy [`from_env`] reads: which variables, and what
/// each combination does.
pub use lock_scheduler::{LockMode, Policy, LOCK_URL, SCHEDULER_LOCK_REQUIRED};

pub use lock_core::CancellationToken;
pub use lock_core::{
    AcquireOutcome, BackendError, BackendErrorKind, Capabilities, Error, ForceOutcome, Holder,
    HolderPage, Identity, LeaseHandle, LockBackend, LockGuard, LockMetrics, LockName, LockOptions,
    Locker, LockerBuilder, LossReason, RenewalOutcome, Result, RunError, RunOutcome, SkipReason,
    TickStore, MAX_NAME_LEN,
};

/// What a backend implements (`LockBackend` and the types it speaks in),
/// for writing a backend or a wrapper around one.
pub use lock_core::backend;

/// Coalescing concurrent calls of one kind into batches (one round trip for
/// many calls), as the Postgres backend and the scheduler's tick store do;
/// for writing a backend.
pub use lock_core::lane;

/// The metrics library the lock and scheduler metrics register with, so a
/// service can pass a `Registry` and expose it without a dependency of its own.
pub use prometheus;

#[cfg(feature = "memory")]
pub use lock_memory::{self as memory, MemoryBackend};

#[cfg(feature = "redis")]
pub use lock_redis::{self as redis, RedisBackend, RedisBuilder};

#[cfg(feature = "postgres")]
pub use lock_postgres::{self as postgres, PostgresBackend, PostgresBuilder};

#[cfg(feature = "etcd")]
pub use lock_etcd::{self as etcd, EtcdBackend, EtcdBuilder};

#[cfg(feature = "scheduler")]
pub use lock_scheduler as scheduler;

#[cfg(feature = "ratelimit")]
pub use distlock_ratelimit as ratelimit;

/// README.md's code blocks, compiled and run as doctests so the README cannot rot.
#[cfg(all(doctest, feature = "scheduler"))]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
