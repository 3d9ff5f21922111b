//! [`connect`] and [`from_env`]: from a URL or the environment to a lock
//! backend, and [`Locks`], what they give.

use std::sync::Arc;

use lock_core::{BackendError, Error, LockBackend, Locker, Result};
use lock_scheduler::{LockMode, Policy};
use prometheus::Registry;

/// A lock backend named by a URL, as [`connect`] makes it, or the unlocked
/// mode [`from_env`] picks without one: the source of a service's
/// [`Locker`] and, with the `scheduler` feature, of the tick store its
/// scheduler records finished ticks in. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Locks {
    backend: lock_scheduler::Backend,
}

impl Locks {
    /// Builds a [`Locker`] over this backend, reporting into the process's
    /// default Prometheus registry. Build one per process and clone it.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code took the lock metrics' names in the
    /// default registry (another `Locker` there is fine: it shares them).
    pub fn locker(&self) -> Result<Locker> {
        self.backend.locker_builder().build()
    }

    /// Builds a [`Locker`] over this backend, reporting into `registry`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code took the lock metrics' names in `registry`.
    pub fn locker_with_registry(&self, registry: &Registry) -> Result<Locker> {
        self.backend
            .locker_builder()
            .with_registry(registry)
            .build()
    }

    /// The lock backend itself, for a [`LockerBuilder`](crate::LockerBuilder)
    /// or for single attempts; `None` in [`LockMode::Unlocked`].
    pub fn lock_backend(&self) -> Option<Arc<dyn LockBackend>> {
        self.backend.lock_backend()
    }

    /// Whether jobs and locks go through a backend, or run unlocked (no
    /// [`LOCK_URL`](crate::LOCK_URL) was set).
    pub fn mode(&self) -> LockMode {
        self.backend.mode()
    }

    /// The tick store on the same server as the locks (in this process in
    /// [`LockMode::Unlocked`]), for
    /// [`Scheduler::builder`](lock_scheduler::Scheduler::builder).
    #[cfg(feature = "scheduler")]
    pub fn tick_store(&self) -> Arc<dyn lock_core::TickStore> {
        self.backend.tick_store()
    }
}

/// Connects to the lock backend a URL names.
///
/// | URL | backend | feature |
/// |---|---|---|
/// | `memory://` | a new in-process backend, private to this call | `memory` (default) |
/// | `memory://NAME` | the in-process backend `NAME`, shared by every `connect` with that name in this process | `memory` |
/// | `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://` | Redis | `redis` |
/// | `postgres://`, `postgresql://` | Postgres advisory locks | `postgres` |
/// | `etcd://`, `etcds://` | etcd leases | `etcd` |
///
/// Each backend's crate documents the rest of its URL (credentials, TLS,
/// options); a password never appears in an error.
///
/// # Errors
///
/// [`Error::Config`] for a malformed URL, a scheme no backend handles, or a
/// backend whose feature is off (the message names the feature);
/// [`Error::Backend`] when a server backend rejects its URL or cannot be
/// reached (its [`kind`](BackendError::kind) says which).
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn connect(url: &str) -> Result<Locks> {
    lock_scheduler::connect(url)
        .await
        .map(|backend| Locks { backend })
        .map_err(lock_error)
}

/// Builds [`Locks`] from the environment: the backend
/// [`LOCK_URL`](crate::LOCK_URL) names, or unlocked mode without it, as
/// [`Policy`] describes.
///
/// - No `LOCK_URL`: every lock is granted behind the in-process guard only,
///   with a warning each time, counted `unlocked` (one replica only);
///   unless `SCHEDULER_LOCK_REQUIRED=true`, which refuses to start.
/// - A `LOCK_URL` whose server is down: starts anyway; every attempt fails
///   closed as unavailable until the server answers.
///
/// # Errors
///
/// [`Error::Config`] for a bad `SCHEDULER_LOCK_REQUIRED`, a required
/// backend without a URL, a malformed URL or a backend whose feature is
/// off (each message names the variable or feature to fix);
/// [`Error::Backend`] when the server answers and refuses (a wrong
/// password, a missing database).
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn from_env() -> Result<Locks> {
    let policy = Policy::from_env().map_err(lock_error)?;
    from_policy(&policy).await
}

/// Builds [`Locks`] as `policy` says; see [`from_env`].
///
/// # Errors
///
/// As [`from_env`].
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn from_policy(policy: &Policy) -> Result<Locks> {
    policy
        .connect()
        .await
        .map(|backend| Locks { backend })
        .map_err(lock_error)
}

/// The lock layer's error for what setting up a backend reported.
fn lock_error(e: lock_scheduler::Error) -> Error {
    match e {
        lock_scheduler::Error::Connect { backend, source } => Error::Backend(
            BackendError::new(
                source.kind(),
                format!("cannot connect to the {backend} backend"),
            )
            .with_source(source),
        ),
        lock_scheduler::Error::Lock(e) => e,
        other => Error::Config(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls_without_a_backend_say_what_to_do() {
        let config = |r: Result<Locks>| match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a configuration error, got {other:?}"),
        };
        let off = [
            ("redis://localhost:6379", "redis", cfg!(feature = "redis")),
            ("postgres://db/app", "postgres", cfg!(feature = "postgres")),
            ("etcd://127.0.0.1:2379", "etcd", cfg!(feature = "etcd")),
        ];
        for (url, feature, compiled) in off {
            if !compiled {
                let message = config(connect(url).await);
                assert!(
                    message.contains(&format!("`{feature}` feature")),
                    "{message}"
                );
            }
        }
        assert!(config(connect("ftp://host").await).contains("unknown backend scheme"));
        assert!(config(connect("localhost:6379").await).contains("scheme://"));
    }

    #[cfg(feature = "memory")]
    #[tokio::test]
    async fn named_memory_urls_reach_the_same_locks() -> Result<()> {
        use std::time::Duration;

        let (a, b) = (
            connect("memory://facade-shared").await?,
            connect("memory://facade-shared").await?,
        );
        let private = connect("memory://").await?;
        let registry = Registry::new();
        let name = lock_core::LockName::new("facade/shared")?;
        let opts = lock_core::LockOptions::new(Duration::from_secs(5));
        let held = a
            .locker_with_registry(&registry)?
            .try_lock(&name, &opts)
            .await?;
        let other = b.locker_with_registry(&registry)?;
        assert!(matches!(
            other.try_lock(&name, &opts).await,
            Err(Error::HeldElsewhere { .. })
        ));
        let elsewhere = private.locker_with_registry(&registry)?;
        elsewhere.try_lock(&name, &opts).await?.release().await?;
        held.release().await?;
        other.try_lock(&name, &opts).await?.release().await?;
        Ok(())
    }
}
