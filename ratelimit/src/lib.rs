//! Shared rate limits for services that run on several replicas: GCRA
//! computed inside the store, on the store's clock, so every replica sees the
//! same buckets and no replica's clock matters.
//!
//! - [`Quota`] and [`Limit`]: how many per period, with what burst. A
//!   [`Limiter`] checks several limits at once ("5 a minute and 100 a day"):
//!   all admitted and charged, or none charged.
//! - Stores, in [`store`], keep the buckets. [`MemoryStore`](store::MemoryStore) (one
//!   process, bounded), `RedisStore` (feature `redis`: one Lua script on the
//!   server's `TIME`; a single server, the primary behind Sentinel (found
//!   again after a failover), or a Cluster), `PostgresStore` (feature `postgres`: one
//!   function call on `clock_timestamp()`). etcd is refused: every decision
//!   would be a raft write.
//! - An [`OnStoreError`] policy says what a limiter does while its store fails: deny
//!   (`503`), allow, or a per-process fallback at a share of each limit. A
//!   short store timeout and a circuit breaker keep an outage from adding
//!   latency to every request.
//! - [`RateLimitConfig::from_env`] reads the store and policy from
//!   `RATE_LIMIT_URL` (or `LOCK_URL`), `RATE_LIMIT_REDIS_FAIL_OPEN` and
//!   `RATE_LIMIT_REDIS_PREFIX`. The URL is `memory://`, `redis://`,
//!   `rediss://`,
//!   `redis+sentinel://[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`
//!   (sentinels on 26379 unless given; the credentials are the primary's),
//!   `redis+cluster://host1[:port1][,...]`, `postgres://` or `postgresql://`.
//! - Metrics in [`RateLimitMetrics`]: `rate_limit_decisions_total`,
//!   `rate_limit_store_fallbacks_total` and the store's errors, latency
//!   (not sampled for an in-process store, which never waits on a network)
//!   and breaker state.
//! - With the `tower` feature, `layer::RateLimitLayer`: 429 with
//!   `Retry-After` and the IETF `RateLimit` / `RateLimit-Policy` headers.
//! - [`gcra::decide`] is the algorithm as a pure function over integer
//!   microseconds, which every store implements.
#![forbid(unsafe_code)]

mod breaker;
mod env;
mod error;
pub mod gcra;
#[cfg(feature = "tower")]
pub mod layer;
mod limiter;
mod metrics;
mod policy;
mod quota;
pub mod store;

pub use breaker::BreakerConfig;
pub use env::{
    store_from_url, RateLimitConfig, LOCK_URL, RATE_LIMIT_FALLBACK_REPLICAS,
    RATE_LIMIT_REDIS_FAIL_OPEN, RATE_LIMIT_REDIS_PREFIX, RATE_LIMIT_URL,
};
pub use error::{Error, Result, StoreError, StoreErrorKind};
pub use limiter::{Decision, Limiter, LimiterBuilder, DEFAULT_PREFIX, DEFAULT_STORE_TIMEOUT};
pub use metrics::{RateLimitMetrics, Source};
pub use policy::OnStoreError;
pub use quota::{Limit, Quota, MAX_COUNT, MAX_NAME_LEN, MAX_WINDOW};

/// The longest key (subject) accepted, in bytes. Keys are hashed before they
/// reach a store, so this bounds the work per request, not the store's keys.
pub const MAX_KEY_LEN: usize = 4096;
