//! Building a backend from a URL.

use std::fmt;
use std::sync::Arc;

use lock_core::redact::redact_url;
use lock_core::{LockBackend, Locker, TickStore};
use prometheus::Registry;

use crate::{Error, Result};

/// A lock backend and the tick store on the same server, as [`connect`] makes them.
#[derive(Clone)]
pub struct Backend {
    locks: Arc<dyn LockBackend>,
    ticks: Arc<dyn TickStore>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("locks", &self.locks)
            .finish()
    }
}

impl Backend {
    /// Pairs a lock backend with the tick store on the same server.
    pub fn new(locks: Arc<dyn LockBackend>, ticks: Arc<dyn TickStore>) -> Self {
        Self { locks, ticks }
    }

    /// The lock backend.
    pub fn lock_backend(&self) -> Arc<dyn LockBackend> {
        Arc::clone(&self.locks)
    }

    /// The tick store.
    pub fn tick_store(&self) -> Arc<dyn TickStore> {
        Arc::clone(&self.ticks)
    }

    /// A [`Locker`] over this backend reporting into `registry`. Build one per
    /// process (or per simulated replica) and clone it.
    ///
    /// # Errors
    ///
    /// [`Error::Lock`] if the lock metrics cannot be registered in `registry`.
    pub fn locker(&self, registry: &Registry) -> Result<Locker> {
        Ok(Locker::builder()
            .backend_arc(self.lock_backend())
            .registry(registry)
            .build()?)
    }
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
/// rejected or its server cannot be reached. Every error shows the URL with
/// its credentials masked ([`lock_core::redact::redact_url`]).
///
/// # Cancel safety
///
/// Cancel safe: a dropped call leaves no connection behind.
pub async fn connect(url: &str) -> Result<Backend> {
    let (scheme, rest) = split_scheme(url)?;
    match scheme.as_str() {
        #[cfg(feature = "memory")]
        "memory" => memory::connect(url, rest),
        #[cfg(not(feature = "memory"))]
        "memory" => not_compiled("memory"),
        #[cfg(feature = "redis")]
        "redis" | "rediss" => servers::redis(url).await,
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" => not_compiled("redis"),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => servers::postgres(url).await,
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => not_compiled("postgres"),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => servers::etcd(url).await,
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => not_compiled("etcd"),
        _ => Err(Error::UnknownScheme { scheme }),
    }
}

#[cfg(any(feature = "redis", feature = "postgres", feature = "etcd"))]
mod servers {
    use std::sync::Arc;

    use lock_core::{BackendError, LockBackend, TickStore};

    use super::Backend;
    use crate::{Error, Result};

    /// One connection serves both the locks and the tick store.
    fn both<T: LockBackend + TickStore + 'static>(backend: T) -> Backend {
        let shared = Arc::new(backend);
        Backend::new(Arc::clone(&shared) as Arc<dyn LockBackend>, shared)
    }

    fn failed(backend: &'static str) -> impl Fn(BackendError) -> Error {
        move |source| Error::Connect { backend, source }
    }

    #[cfg(feature = "redis")]
    pub(super) async fn redis(url: &str) -> Result<Backend> {
        let backend = lock_redis::RedisConfig::from_url(url)
            .map_err(failed("redis"))?
            .connect()
            .await
            .map_err(failed("redis"))?;
        Ok(both(backend))
    }

    #[cfg(feature = "postgres")]
    pub(super) async fn postgres(url: &str) -> Result<Backend> {
        let config = lock_postgres::PostgresConfigBuilder::from_url(url)
            .and_then(lock_postgres::PostgresConfigBuilder::build)
            .map_err(failed("postgres"))?;
        let backend = lock_postgres::PostgresBackend::connect(config)
            .await
            .map_err(failed("postgres"))?;
        Ok(both(backend))
    }

    #[cfg(feature = "etcd")]
    pub(super) async fn etcd(url: &str) -> Result<Backend> {
        let backend = lock_etcd::EtcdBuilder::from_url(url)
            .map_err(failed("etcd"))?
            .connect()
            .await
            .map_err(failed("etcd"))?;
        Ok(both(backend))
    }
}

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
fn split_scheme(url: &str) -> Result<(String, &str)> {
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
mod memory {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock, PoisonError};

    use lock_memory::MemoryBackend;

    use lock_core::redact::redact_url;

    use super::Backend;
    use crate::{Error, Result};

    /// Named in-process backends, so that every `connect("memory://NAME")`
    /// in a process reaches the same locks, as connections to one server do.
    fn named() -> &'static Mutex<HashMap<String, MemoryBackend>> {
        static NAMED: OnceLock<Mutex<HashMap<String, MemoryBackend>>> = OnceLock::new();
        NAMED.get_or_init(Mutex::default)
    }

    pub(super) fn connect(url: &str, rest: &str) -> Result<Backend> {
        let name = rest.trim_end_matches('/');
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(Error::InvalidUrl {
                url: redact_url(url),
                reason:
                    "a memory URL is memory:// or memory://NAME, NAME of letters, digits, - _ ."
                        .into(),
            });
        }
        let backend = if name.is_empty() {
            MemoryBackend::new()
        } else {
            named()
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(name.to_owned())
                .or_default()
                .clone()
        };
        Ok(Backend::new(Arc::new(backend.clone()), Arc::new(backend)))
    }
}

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
