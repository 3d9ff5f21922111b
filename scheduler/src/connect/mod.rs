//! Building a backend from a URL.

use std::fmt;
use std::sync::Arc;

use lock_core::redact::redact_url;
use lock_core::{LockBackend, Locker, LockerBuilder, TickStore};
use prometheus::Registry;

use crate::{Error, Result};
use lock_core::backend::LocalTicks;

/// Whether jobs run under distributed locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// Under a lock backend: a tick runs on one replica, and not at all
    /// while the backend cannot be reached (counted `unavailable`).
    Locked,
    /// No backend was configured: every run goes ahead behind the
    /// in-process guard only, with a warning, counted `unlocked`. Safe for
    /// a single replica only.
    Unlocked,
}

/// A lock backend and the tick store on the same server, as [`connect`]
/// makes them; or, in [`LockMode::Unlocked`], no backend and an in-process
/// tick store. Cheap to clone.
#[derive(Clone)]
pub struct Backend {
    locks: Option<Arc<dyn LockBackend>>,
    ticks: Arc<dyn TickStore>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("mode", &self.mode())
            .field("locks", &self.locks)
            .finish()
    }
}

impl Backend {
    /// Pairs a lock backend with the tick store on the same server.
    pub fn new(locks: Arc<dyn LockBackend>, ticks: Arc<dyn TickStore>) -> Self {
        Self {
            locks: Some(locks),
            ticks,
        }
    }

    /// No lock backend, for a single replica: its [`Backend::locker`] runs
    /// every job unlocked (warning on each run), and its tick store lives in
    /// this process.
    pub fn unlocked() -> Self {
        Self {
            locks: None,
            ticks: Arc::new(LocalTicks::default()),
        }
    }

    /// Whether jobs run under distributed locks.
    pub fn mode(&self) -> LockMode {
        if self.locks.is_some() {
            LockMode::Locked
        } else {
            LockMode::Unlocked
        }
    }

    /// The lock backend; `None` in [`LockMode::Unlocked`].
    pub fn lock_backend(&self) -> Option<Arc<dyn LockBackend>> {
        self.locks.clone()
    }

    /// The tick store.
    pub fn tick_store(&self) -> Arc<dyn TickStore> {
        Arc::clone(&self.ticks)
    }

    /// A [`Locker`] over this backend reporting into `registry`, unlocked in
    /// [`LockMode::Unlocked`]. Build one per process (or per simulated
    /// replica) and clone it.
    ///
    /// # Errors
    ///
    /// [`Error::Lock`] if the lock metrics cannot be registered in `registry`.
    pub fn locker(&self, registry: &Registry) -> Result<Locker> {
        Ok(self.locker_builder().with_registry(registry).build()?)
    }

    /// A [`LockerBuilder`] over this backend (none in
    /// [`LockMode::Unlocked`]), for settings [`Backend::locker`] leaves at
    /// their defaults.
    pub fn locker_builder(&self) -> LockerBuilder {
        match &self.locks {
            Some(locks) => Locker::builder().with_backend_arc(Arc::clone(locks)),
            None => Locker::builder(),
        }
    }
}

/// How a server that does not answer at start is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// It fails the call ([`connect`]).
    Verified,
    /// The backend is returned anyway and connects when the server answers
    /// ([`Policy::connect`](crate::Policy::connect)).
    Deferred,
}

/// Builds the backend a URL names.
///
/// | URL | backend |
/// |---|---|
/// | `memory://` | a new in-process backend (feature `memory`, on by default) |
/// | `memory://NAME` | the in-process backend `NAME`, shared by every `connect` with that name in this process |
/// | `redis://`, `rediss://` | Redis (feature `redis`) |
/// | `postgres://`, `postgresql://` | Postgres advisory locks (feature `postgres`) |
/// | `etcd://` | etcd leases (feature `etcd`) |
///
/// # Errors
///
/// [`Error::InvalidUrl`] for a malformed URL, [`Error::UnknownScheme`] for a
/// scheme no backend handles, [`Error::BackendNotCompiled`] for a backend
/// this build leaves out, [`Error::Connect`] when a server backend's URL is
/// rejected or its server cannot be reached ([`Policy::connect`](crate::Policy::connect)
/// starts anyway instead). Every error shows the URL with
/// its credentials masked ([`lock_core::redact::redact_url`]).
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn connect(url: &str) -> Result<Backend> {
    connect_with(url, Start::Verified).await
}

/// [`connect`], with `start` deciding what a server that does not answer does.
pub(crate) async fn connect_with(url: &str, start: Start) -> Result<Backend> {
    // Only server backends can be unreachable.
    #[cfg(not(any(feature = "redis", feature = "postgres", feature = "etcd")))]
    let _ = start;
    let (scheme, rest) = split_scheme(url)?;
    // Only the memory backend reads past the scheme.
    #[cfg(not(feature = "memory"))]
    let _ = rest;
    match scheme.as_str() {
        #[cfg(feature = "memory")]
        "memory" => memory::connect(url, rest),
        #[cfg(not(feature = "memory"))]
        "memory" => not_compiled("memory"),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" => servers::redis(url, start).await,
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" => not_compiled("redis"),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => servers::postgres(url, start).await,
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => not_compiled("postgres"),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => servers::etcd(url, start).await,
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => not_compiled("etcd"),
        _ => Err(Error::UnknownScheme { scheme }),
    }
}

#[cfg(any(feature = "redis", feature = "postgres", feature = "etcd"))]
mod servers;

#[cfg(not(all(
    feature = "memory",
    feature = "redis",
    feature = "postgres",
    feature = "etcd"
)))]
fn not_compiled(backend: &'static str) -> Result<Backend> {
    Err(Error::BackendNotCompiled {
        backend,
        feature: backend,
    })
}

/// Splits `scheme://rest`, checking the scheme as RFC 3986 defines it.
pub(crate) fn split_scheme(url: &str) -> Result<(String, &str)> {
    let invalid = |reason: &str| Error::InvalidUrl {
        url: redact_url(url),
        reason: reason.to_owned(),
    };
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| invalid("expected scheme://..., such as memory:// or redis://host:6379"))?;
    let mut chars = scheme.chars();
    let starts_alpha = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    if !starts_alpha || !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) {
        return Err(invalid(
            "the scheme must be a letter followed by letters, digits, + - or .",
        ));
    }
    Ok((scheme.to_ascii_lowercase(), rest))
}

#[cfg(feature = "memory")]
mod memory;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn schemes_map_to_backends_or_clear_errors() {
        for (url, feature, compiled) in [
            ("redis://localhost:6379", "redis", cfg!(feature = "redis")),
            ("rediss://u:secret@host", "redis", cfg!(feature = "redis")),
            ("postgres://db/app", "postgres", cfg!(feature = "postgres")),
            (
                "postgresql://db/app",
                "postgres",
                cfg!(feature = "postgres"),
            ),
            ("etcd://127.0.0.1:2379", "etcd", cfg!(feature = "etcd")),
        ] {
            if compiled {
                // Connecting for real is tested against live servers in conformance-tests.
                continue;
            }
            let err = connect(url).await.expect_err(url);
            assert!(
                matches!(err, Error::BackendNotCompiled { feature: f, .. } if f == feature),
                "{url}: {err:?}"
            );
            assert_eq!(
                err.to_string(),
                format!("backend `{feature}` is not compiled in; enable the `{feature}` feature")
            );
        }
        assert!(
            matches!(connect("ftp://x").await, Err(Error::UnknownScheme { scheme }) if scheme == "ftp")
        );
        for bad in [
            "",
            "localhost:6379",
            "://x",
            "1redis://x",
            "re dis://x",
            "memory://a/b",
        ] {
            assert!(
                matches!(connect(bad).await, Err(Error::InvalidUrl { .. })),
                "{bad:?}"
            );
        }
        let err = connect("memory://has@secret/../x")
            .await
            .expect_err("bad memory name");
        assert!(!err.to_string().contains("has@"), "{err}");
        for bad in [
            "u:s3cret@h:6379",
            "host=h password=s3cret",
            "memory://u:ab/s3cret@x",
        ] {
            let err = connect(bad).await.expect_err(bad);
            assert!(matches!(err, Error::InvalidUrl { .. }), "{bad}: {err:?}");
            assert!(!format!("{err} {err:?}").contains("s3cret"), "{bad}: {err}");
        }
    }

    #[tokio::test]
    async fn named_memory_urls_share_locks_and_ticks() -> Result<()> {
        let (a, b) = (
            connect("memory://shared-test").await?,
            connect("memory://Shared-test/").await?,
        );
        let c = connect("memory://").await?;
        let job = lock_core::LockName::new("job")?;
        a.tick_store()
            .record_completed(&job, 42, std::time::Duration::from_secs(60))
            .await
            .map_err(lock_core::Error::from)?;
        assert_eq!(
            b.tick_store()
                .last_completed(&job)
                .await
                .map_err(lock_core::Error::from)?,
            None,
            "names are case-sensitive"
        );
        let b = connect("memory://shared-test/").await?;
        assert_eq!(
            b.tick_store()
                .last_completed(&job)
                .await
                .map_err(lock_core::Error::from)?,
            Some(42)
        );
        assert_eq!(
            c.tick_store()
                .last_completed(&job)
                .await
                .map_err(lock_core::Error::from)?,
            None,
            "memory:// is private"
        );
        Ok(())
    }
}
