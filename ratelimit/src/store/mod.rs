//! Where buckets live: the [`Store`] contract and its implementations.

use async_trait::async_trait;

use crate::error::StoreError;
use crate::gcra::Cell;

mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod sentinel;
#[cfg(feature = "test-util")]
mod switch;

pub(crate) use memory::SubjectHasher;
pub use memory::{MemoryStore, DEFAULT_MAX_KEYS};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresStore, DEFAULT_TABLE};
#[cfg(feature = "redis")]
pub use redis::RedisStore;
#[cfg(feature = "test-util")]
pub use switch::SwitchStore;

/// One request as a store receives it: the keys of its limits (all of one
/// subject), each limit's parameters, and the cost.
#[derive(Debug, Clone, Copy)]
pub struct StoreRequest<'a> {
    /// The hashed subject (hex), shared by every key; it is the key's hash
    /// tag on Redis Cluster and picks the shard in memory.
    pub subject: &'a str,
    /// One store key per limit, in the limiter's order.
    pub keys: &'a [String],
    /// One cell per key.
    pub cells: &'a [Cell],
    /// The units this request takes from every limit.
    pub cost: u64,
}

/// A store's answer, computed on the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreDecision {
    /// Admitted by every limit, and charged to every limit.
    pub allowed: bool,
    /// Units left over the tightest limit.
    pub remaining: u64,
    /// Microseconds until the request could be admitted (0 when it was).
    pub retry_after_us: u64,
    /// Microseconds until the bucket of the limit at `limiting` is full
    /// again.
    pub reset_after_us: u64,
    /// The index of the limit that decided `remaining` or `retry_after_us`.
    pub limiting: usize,
    /// The store's clock at the decision, in microseconds (epoch on servers,
    /// since creation in memory).
    pub now_us: u64,
}

/// A place that holds the theoretical arrival time of each key and decides
/// requests against it.
///
/// Implementations MUST decide a request atomically over all its keys (every
/// limit charged or none), MUST read the time from one clock shared by every
/// replica that uses the store (the server's), MUST give every key they write
/// an expiry no later than the instant its bucket is full again, and SHOULD
/// answer in one round trip.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// Decides `request` per [`gcra::decide`](crate::gcra::decide) and
    /// stores the new arrival times when admitted.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the store cannot be reached or answers with an
    /// error; the limiter's policy then decides.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the request charged or not; never half.
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError>;

    /// The store's kind, for logs (`memory`, `redis`, `postgres`).
    fn kind(&self) -> &'static str;

    /// This store as an in-process [`MemoryStore`], when it is one; `None`
    /// (the default) otherwise.
    ///
    /// A [`Limiter`](crate::Limiter) on an in-process store decides by
    /// calling the store directly, without the timeout,
    /// circuit breaker and `rate_limit_store_duration_seconds` sample that
    /// only a store that can wait or fail needs. A store that wraps another
    /// to change its behaviour (to inject failures or delays) keeps the
    /// default, so its limiter takes the general path.
    fn in_process(&self) -> Option<&MemoryStore> {
        None
    }
}

impl From<(crate::gcra::Verdict, u64)> for StoreDecision {
    fn from((v, now_us): (crate::gcra::Verdict, u64)) -> Self {
        Self {
            allowed: v.allowed,
            remaining: v.remaining,
            retry_after_us: v.retry_after,
            reset_after_us: v.reset_after,
            limiting: v.limiting,
            now_us,
        }
    }
}
