//! Limiter defaults from the environment, and stores named by URL.

use std::num::NonZeroU32;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::limiter::{Limiter, LimiterBuilder, DEFAULT_PREFIX};
use crate::policy::OnStoreError;
use crate::store::{MemoryStore, Store};

/// The variable naming the rate-limit store's URL (any form
/// [`store_from_url`] reads, e.g.
/// `redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/limits`);
/// without it, [`LOCK_URL`] is used, so one shared server serves locks and
/// limits.
pub const RATE_LIMIT_URL: &str = "RATE_LIMIT_URL";
/// The variable the locks take their backend from (`distlock::LOCK_URL`).
pub const LOCK_URL: &str = "LOCK_URL";
/// `true` (the default) or `false`: whether a limiter keeps admitting
/// through a per-process fallback while its store is down, or refuses.
pub const RATE_LIMIT_REDIS_FAIL_OPEN: &str = "RATE_LIMIT_REDIS_FAIL_OPEN";
/// The key prefix (default [`DEFAULT_PREFIX`]); each limiter appends its name.
pub const RATE_LIMIT_REDIS_PREFIX: &str = "RATE_LIMIT_REDIS_PREFIX";
/// The number of replicas that share each limit while failing open (default
/// 1): each admits its share of a limit from its own memory.
pub const RATE_LIMIT_FALLBACK_REPLICAS: &str = "RATE_LIMIT_FALLBACK_REPLICAS";

/// The store, key prefix and store-failure policy every limiter of a
/// service starts from, as the environment sets them:
///
/// | variables | limits are kept | when the store fails |
/// |---|---|---|
/// | neither [`RATE_LIMIT_URL`] nor [`LOCK_URL`] | in this process (warned once at start) | – |
/// | a URL, `RATE_LIMIT_REDIS_FAIL_OPEN` unset or `true` | in the store the URL names | per-process fallback at 1/[`RATE_LIMIT_FALLBACK_REPLICAS`] of each limit |
/// | a URL, `RATE_LIMIT_REDIS_FAIL_OPEN=false` | in the store | refused (`503`) |
#[derive(Clone)]
pub struct RateLimitConfig {
    store: Arc<dyn Store>,
    prefix: String,
    on_store_error: OnStoreError,
}

impl std::fmt::Debug for RateLimitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitConfig")
            .field("store", &self.store.kind())
            .field("prefix", &self.prefix)
            .field("on_store_error", &self.on_store_error)
            .finish()
    }
}

impl RateLimitConfig {
    /// Reads the variables of the table above from the process environment.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a value that is not valid Unicode, a
    /// `RATE_LIMIT_REDIS_FAIL_OPEN` other than `true`/`false`, a replica count
    /// that is not a positive integer, or a URL [`store_from_url`] refuses.
    pub fn from_env() -> Result<Self> {
        Self::from_values(|name| std::env::var_os(name).map(|v| v.into_string()))
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`
    /// (`None` for unset, `Some(Err)` for a value that is not Unicode).
    ///
    /// # Errors
    ///
    /// As [`from_env`](Self::from_env).
    pub fn from_values(
        get: impl Fn(&str) -> Option<std::result::Result<String, std::ffi::OsString>>,
    ) -> Result<Self> {
        let read = |name: &str| -> Result<Option<String>> {
            match get(name) {
                None => Ok(None),
                Some(Ok(v)) if v.trim().is_empty() => Ok(None),
                Some(Ok(v)) => Ok(Some(v.trim().to_owned())),
                Some(Err(_)) => Err(Error::Config(format!("{name} is not valid Unicode"))),
            }
        };
        let fail_open = match read(RATE_LIMIT_REDIS_FAIL_OPEN)?.as_deref() {
            None | Some("true") => true,
            Some("false") => false,
            Some(_) => {
                return Err(Error::Config(format!(
                    "{RATE_LIMIT_REDIS_FAIL_OPEN} must be true or false"
                )))
            }
        };
        let replicas = match read(RATE_LIMIT_FALLBACK_REPLICAS)? {
            None => NonZeroU32::MIN,
            Some(v) => v.parse().map_err(|_| {
                Error::Config(format!(
                    "{RATE_LIMIT_FALLBACK_REPLICAS} must be a positive integer"
                ))
            })?,
        };
        let prefix = read(RATE_LIMIT_REDIS_PREFIX)?.unwrap_or_else(|| DEFAULT_PREFIX.to_owned());
        let url = match read(RATE_LIMIT_URL)? {
            Some(url) => Some(url),
            None => read(LOCK_URL)?,
        };
        let store = match url {
            Some(url) => store_from_url(&url)?,
            None => {
                tracing::warn!(
                    "neither {RATE_LIMIT_URL} nor {LOCK_URL} is set: rate limits are kept in this \
                     process only, so each replica enforces its own copy of every limit"
                );
                Arc::new(MemoryStore::new())
            }
        };
        Ok(Self {
            store,
            prefix,
            on_store_error: if fail_open {
                OnStoreError::Fallback { replicas }
            } else {
                OnStoreError::Deny
            },
        })
    }

    /// The store the environment named.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The store-failure policy the environment set.
    #[must_use]
    pub fn on_store_error(&self) -> OnStoreError {
        self.on_store_error
    }

    /// A limiter builder with this store, prefix and policy; add limits and
    /// override anything with its `with_*` methods.
    pub fn limiter(&self, name: impl Into<String>) -> LimiterBuilder {
        Limiter::builder(name)
            .with_store(Arc::clone(&self.store))
            .with_key_prefix(self.prefix.clone())
            .with_on_store_error(self.on_store_error)
    }
}

/// The store a URL names: `memory://`; `redis://`, `rediss://`,
/// `redis+sentinel://` (the primary the sentinels name, found again after a
/// failover: `RedisStore::connect_sentinel`), `redis+cluster://` (feature
/// `redis`); `postgres://`, `postgresql://` (feature `postgres`, table
/// `store::DEFAULT_TABLE`). Server stores connect at
/// their first decision.
///
/// # Errors
///
/// [`Error::Unsupported`] for etcd (every decision would be a raft write:
/// a consensus round and a disk sync per request); [`Error::Config`] for another scheme or a
/// store whose feature is off; [`Error::Store`] for a malformed URL. No
/// message repeats a password.
pub fn store_from_url(url: &str) -> Result<Arc<dyn Store>> {
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    match scheme {
        "memory" => Ok(Arc::new(MemoryStore::new())),
        "etcd" | "etcds" => Err(Error::Unsupported(
            "etcd cannot hold rate limits: every decision would be a raft write (a consensus \
             round and a disk sync per request); set RATE_LIMIT_URL to a Redis or Postgres URL, \
             or leave it unset for in-process limits"
                .into(),
        )),
        #[cfg(feature = "redis")]
        "redis+sentinel" => Ok(Arc::new(crate::store::RedisStore::connect_sentinel(url)?)),
        #[cfg(feature = "redis")]
        "redis+cluster" => Ok(Arc::new(crate::store::RedisStore::connect_cluster(url)?)),
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(crate::store::RedisStore::connect(url)?)),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(crate::store::PostgresStore::connect(
            url,
            crate::store::DEFAULT_TABLE,
        )?)),
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redis+cluster" | "redis+sentinel" => Err(Error::Config(format!(
            "{scheme}:// needs the distlock-ratelimit feature redis"
        ))),
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(Error::Config(format!(
            "{scheme}:// needs the distlock-ratelimit feature postgres"
        ))),
        _ => Err(Error::Config(format!(
            "no rate-limit store for the URL {}; use memory://, redis://, rediss://, \
             redis+sentinel://, redis+cluster://, postgres:// or postgresql://",
            lock_core::redact::redact_url(url)
        ))),
    }
}
