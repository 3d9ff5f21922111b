//! The limiter: limits, a store, a policy for store failures, metrics.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::breaker::{Breaker, BreakerConfig, Change, Permit};
use crate::error::{Error, Result, StoreErrorKind};
use crate::gcra::Cell;
use crate::metrics::{LimiterSeries, Outcome, RateLimitMetrics, Source};
use crate::policy::OnStoreError;
use crate::quota::{check_name, Limit};
use crate::store::{MemoryStore, Store, StoreDecision, StoreRequest, SubjectHasher};
use crate::MAX_KEY_LEN;

/// The store timeout unless set: long enough for a loaded server on the same
/// network, short enough that an outage costs each request little.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(50);

/// The key prefix unless set.
pub const DEFAULT_PREFIX: &str = "distlock:rl";

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may proceed.
    pub allowed: bool,
    /// Units left over the tightest limit after this request.
    pub remaining: u64,
    /// When the request could be admitted (zero when it was).
    pub retry_after: Duration,
    /// When the bucket of [`limit`](Self::limit) is full again.
    pub reset_after: Duration,
    /// Where the decision was made.
    pub source: Source,
    /// The index, in the deciding limiter's [`limits`](Limiter::limits), of
    /// the limit that decided `remaining` (admitted) or `retry_after`
    /// (refused); [`Limiter::limit_of`] returns that limit. An index rather
    /// than a shared reference, so a decision costs no reference count.
    pub limit: usize,
}

/// Builds a [`Limiter`]: [`Limiter::builder`], then `with_*`, then
/// [`build`](Self::build).
#[derive(Debug)]
#[must_use]
pub struct LimiterBuilder {
    name: String,
    limits: Vec<Limit>,
    store: Option<Arc<dyn Store>>,
    prefix: String,
    on_store_error: OnStoreError,
    timeout: Duration,
    breaker: BreakerConfig,
    metrics: Option<RateLimitMetrics>,
}

impl LimiterBuilder {
    /// Adds a limit; a request must pass every limit.
    pub fn with_limit(mut self, limit: Limit) -> Self {
        self.limits.push(limit);
        self
    }

    /// Keeps buckets in `store` (default: a [`MemoryStore`] of this process).
    pub fn with_store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// Prefixes every store key (default [`DEFAULT_PREFIX`]); the limiter's
    /// name follows it, so limiters never share buckets.
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// What to do when the store fails (default [`OnStoreError::FALLBACK`]).
    pub fn with_on_store_error(mut self, policy: OnStoreError) -> Self {
        self.on_store_error = policy;
        self
    }

    /// How long a store call may take before it counts as failed (default
    /// [`DEFAULT_STORE_TIMEOUT`]).
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The circuit breaker's settings.
    pub fn with_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// Reports into these metrics (default: the default registry's).
    pub fn with_metrics(mut self, metrics: RateLimitMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Checks the settings and builds the limiter.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an invalid limiter name, no limits, two limits
    /// of one name, a key prefix that is empty, longer than 100 bytes or holds
    /// `{`, `}` or whitespace, a zero or over-an-hour store timeout, or
    /// metrics that cannot be registered.
    pub fn build(self) -> Result<Limiter> {
        check_name("limiter", &self.name)?;
        if self.limits.is_empty() {
            return Err(Error::Config(format!(
                "limiter {} has no limits; add one with with_limit",
                self.name
            )));
        }
        for (i, l) in self.limits.iter().enumerate() {
            if self.limits[..i].iter().any(|o| o.name() == l.name()) {
                return Err(Error::Config(format!(
                    "limiter {} has two limits named {}",
                    self.name,
                    l.name()
                )));
            }
        }
        let prefix_ok = !self.prefix.is_empty()
            && self.prefix.len() <= 100
            && !self
                .prefix
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_whitespace());
        if !prefix_ok {
            return Err(Error::Config(
                "a rate-limit key prefix must be 1 to 100 bytes without braces or whitespace \
                 (braces would change the Redis Cluster hash tag)"
                    .into(),
            ));
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(3600) {
            return Err(Error::Config(format!(
                "a store timeout of {:?} is out of range; use tens of milliseconds",
                self.timeout
            )));
        }
        let metrics = match self.metrics {
            Some(m) => m,
            None => RateLimitMetrics::default_registry()?,
        };
        let series = metrics.series(&self.name);
        let cells: Vec<Cell> = self.limits.iter().map(|l| l.quota().cell()).collect();
        let fallback = match self.on_store_error {
            OnStoreError::Fallback { replicas } => {
                let n = u64::from(replicas.get());
                let cells = self
                    .limits
                    .iter()
                    .map(|l| {
                        let burst = l.quota().burst().div_ceil(n).max(1);
                        let interval = l.quota().cell().interval.saturating_mul(n);
                        Cell {
                            interval,
                            capacity: interval.saturating_mul(burst),
                        }
                    })
                    .collect();
                Some((MemoryStore::new(), cells))
            }
            _ => None,
        };
        let store = self
            .store
            .unwrap_or_else(|| Arc::new(MemoryStore::new()) as Arc<dyn Store>);
        let key_base = format!("{}:{}", self.prefix, self.name);
        let in_process = store
            .in_process()
            .and_then(|m| m.subject_hasher(&key_base, self.limits.iter().map(Limit::name)));
        Ok(Limiter {
            inner: Arc::new(Inner {
                breaker: Breaker::new(self.breaker, self.timeout),
                store,
                in_process,
                key_base,
                name: self.name,
                limits: self.limits,
                cells,
                on_store_error: self.on_store_error,
                timeout: self.timeout,
                fallback,
                metrics,
                series,
            }),
        })
    }
}

/// Decides requests against a set of limits for one kind of request
/// (`login`, `api`), per subject (a client address, a user id). Cheap to
/// clone; clones share everything.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_ratelimit::Result<()> {
/// use distlock_ratelimit::{Limit, Limiter, Quota};
///
/// let login = Limiter::builder("login")
///     .with_limit(Limit::new("minute", Quota::per_minute(5)?)?)
///     .with_limit(Limit::new("day", Quota::per_day(100)?)?)
///     .build()?;
/// let decision = login.check("203.0.113.7").await?;
/// assert!(decision.allowed);
/// assert_eq!(decision.remaining, 4);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    key_base: String,
    limits: Vec<Limit>,
    cells: Vec<Cell>,
    store: Arc<dyn Store>,
    /// The ids of this limiter's buckets when `store` is in process
    /// ([`Store::in_process`]): it is then called directly.
    in_process: Option<SubjectHasher>,
    on_store_error: OnStoreError,
    timeout: Duration,
    breaker: Breaker,
    fallback: Option<(MemoryStore, Vec<Cell>)>,
    metrics: RateLimitMetrics,
    series: LimiterSeries,
}

impl Inner {
    /// The store key of each limit for `subject`:
    /// `{base}:{{{subject}}}:{limit}`, each in one allocation of the right
    /// size (`format!` grows its buffer as it goes).
    fn keys(&self, subject: &str) -> Vec<String> {
        self.limits
            .iter()
            .map(|l| {
                let mut k =
                    String::with_capacity(self.key_base.len() + subject.len() + l.name().len() + 4);
                k.push_str(&self.key_base);
                k.push_str(":{");
                k.push_str(subject);
                k.push_str("}:");
                k.push_str(l.name());
                k
            })
            .collect()
    }
}

impl fmt::Debug for Limiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("name", &self.inner.name)
            .field("limits", &self.inner.limits)
            .field("store", &self.inner.store.kind())
            .field("on_store_error", &self.inner.on_store_error)
            .finish_non_exhaustive()
    }
}

/// The hashed subject: 128 bits of SHA-256 in hex. Keys carry this, never the
/// caller's text, so a token used as a key never reaches the store or a log.
fn subject_hash(key: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(key.as_bytes());
    // Hex by table into one allocation: a `format!` per byte cost more than
    // the hash itself.
    let mut hex = String::with_capacity(32);
    for &b in digest.iter().take(16) {
        hex.push(char::from(HEX[usize::from(b >> 4)]));
        hex.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    hex
}

impl Limiter {
    /// Starts a limiter called `name` (1 to 64 characters of
    /// `[A-Za-z0-9._-]`; the `limiter` label and part of every key).
    pub fn builder(name: impl Into<String>) -> LimiterBuilder {
        LimiterBuilder {
            name: name.into(),
            limits: Vec::new(),
            store: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            on_store_error: OnStoreError::FALLBACK,
            timeout: DEFAULT_STORE_TIMEOUT,
            breaker: BreakerConfig::default(),
            metrics: None,
        }
    }

    /// The limiter's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The limits, in the order they were added.
    #[must_use]
    pub fn limits(&self) -> &[Limit] {
        &self.inner.limits
    }

    /// The limit that made `decision` (its [`limit`](Decision::limit)
    /// index), or `None` for a decision of another limiter with fewer
    /// limits.
    #[must_use]
    pub fn limit_of(&self, decision: &Decision) -> Option<&Limit> {
        self.inner.limits.get(decision.limit)
    }

    /// The metrics this limiter reports into.
    #[must_use]
    pub fn metrics(&self) -> &RateLimitMetrics {
        &self.inner.metrics
    }

    /// Decides a request of cost 1 from `key`; see [`check_cost`](Self::check_cost).
    ///
    /// # Errors
    ///
    /// As [`check_cost`](Self::check_cost).
    ///
    /// # Cancel safety
    ///
    /// As [`check_cost`](Self::check_cost).
    pub async fn check(&self, key: &str) -> Result<Decision> {
        self.check_cost(key, 1).await
    }

    /// Decides a request of `cost` units from `key` against every limit at
    /// once: admitted and charged to all, or refused and charged to none.
    /// Cost 0 reads the state without charging.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyKey`], [`Error::KeyTooLong`],
    /// [`Error::CostExceedsBurst`] for requests that can never be decided;
    /// [`Error::StoreUnavailable`] when the store failed and the policy is
    /// [`OnStoreError::Deny`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may leave the request charged or not (the store
    /// decides atomically either way); nothing else is left behind.
    pub async fn check_cost(&self, key: &str, cost: u64) -> Result<Decision> {
        let inner = &*self.inner;
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(Error::KeyTooLong {
                len: key.len(),
                max: MAX_KEY_LEN,
            });
        }
        if let Some(limit) = inner.limits.iter().find(|l| cost > l.quota().burst()) {
            return Err(Error::CostExceedsBurst {
                cost,
                burst: limit.quota().burst(),
                limit: limit.name().to_owned(),
            });
        }
        if let (Some(hasher), Some(memory)) = (&inner.in_process, inner.store.in_process()) {
            return Ok(self.decide_in_process(memory, hasher, key, cost));
        }
        let subject = subject_hash(key);
        let keys = inner.keys(&subject);
        let request = StoreRequest {
            subject: &subject,
            keys: &keys,
            cells: &inner.cells,
            cost,
        };
        if inner.breaker.permit() == Permit::Call {
            if let Some(decision) = self.call_store(&request).await {
                return Ok(self.finish(decision, Source::Store));
            }
        }
        self.on_failure(&request).await
    }

    /// The general path without what only a store that can fail or wait
    /// needs: an in-process store answers at once and never errs, so the
    /// breaker would never leave its closed state and the timeout would never
    /// fire, and no latency is sampled (there is no network to wait on).
    /// Decisions and the decision counters are those of the general path.
    ///
    /// The subject's 128-bit keyed hash ([`MemoryStore::subject_id`], keyed
    /// for this limiter's prefix and name) replaces the SHA-256 prefix in the
    /// bucket's id, and a keyed hash of the limit's name the rest of the
    /// key. No text of the caller's is kept either way.
    fn decide_in_process(
        &self,
        memory: &MemoryStore,
        hasher: &SubjectHasher,
        key: &str,
        cost: u64,
    ) -> Decision {
        let subject = MemoryStore::subject_id(hasher, key);
        let decision = memory.decide_subject(hasher, subject, &self.inner.cells, cost);
        self.finish(decision, Source::Store)
    }

    /// One store call under the timeout, with its latency, error count and
    /// breaker bookkeeping; `None` when it failed.
    async fn call_store(&self, request: &StoreRequest<'_>) -> Option<StoreDecision> {
        let inner = &*self.inner;
        let started = Instant::now();
        let result = tokio::time::timeout(inner.timeout, inner.store.decide(request)).await;
        inner.series.store_duration(started.elapsed().as_secs_f64());
        let error = match result {
            Ok(Ok(decision)) if decision.limiting < inner.limits.len() => {
                if inner.breaker.success() == Some(Change::Closed) {
                    inner.series.breaker(false);
                    tracing::warn!(
                        limiter = %inner.name,
                        store = inner.store.kind(),
                        "rate-limit store answers again; circuit breaker closed"
                    );
                }
                return Some(decision);
            }
            Ok(Ok(_)) => crate::error::StoreError::new(
                StoreErrorKind::Protocol,
                "the store named a limit the limiter does not have",
            ),
            Ok(Err(e)) => e,
            Err(_) => crate::error::StoreError::new(
                StoreErrorKind::Timeout,
                format!("no answer within {:?}", inner.timeout),
            ),
        };
        inner.series.store_error(error.kind);
        if inner.breaker.failure() == Some(Change::Opened) {
            inner.series.breaker(true);
            tracing::warn!(
                limiter = %inner.name,
                store = inner.store.kind(),
                error = %error,
                policy = inner.on_store_error.label(),
                "rate-limit store failing; circuit breaker open, requests follow the store-error policy"
            );
        } else {
            tracing::debug!(limiter = %inner.name, error = %error, "rate-limit store call failed");
        }
        None
    }

    async fn on_failure(&self, request: &StoreRequest<'_>) -> Result<Decision> {
        let inner = &*self.inner;
        match (&inner.on_store_error, &inner.fallback) {
            (OnStoreError::Fallback { .. }, Some((store, cells))) => {
                let local = StoreRequest { cells, ..*request };
                let decision = store.decide_now(&local);
                Ok(self.finish(decision, Source::Fallback))
            }
            (OnStoreError::Allow, _) | (OnStoreError::Fallback { .. }, None) => {
                inner.series.decision(Outcome::Allowed, Source::None);
                Ok(Decision {
                    allowed: true,
                    remaining: inner.limits.first().map_or(0, |l| l.quota().burst()),
                    retry_after: Duration::ZERO,
                    reset_after: Duration::ZERO,
                    source: Source::None,
                    limit: 0,
                })
            }
            (OnStoreError::Deny, _) => {
                inner.series.decision(Outcome::Unavailable, Source::None);
                Err(Error::StoreUnavailable {
                    limiter: inner.name.clone(),
                    retry_after: inner.breaker.retry_after().max(Duration::from_secs(1)),
                })
            }
        }
    }

    fn finish(&self, d: StoreDecision, source: Source) -> Decision {
        let inner = &*self.inner;
        let outcome = if d.allowed {
            Outcome::Allowed
        } else {
            Outcome::Limited
        };
        inner.series.decision(outcome, source);
        // A store names only a limit the limiter has (`call_store` checks
        // server answers); the first is the answer if one ever did not.
        let limit = if d.limiting < inner.limits.len() {
            d.limiting
        } else {
            0
        };
        Decision {
            allowed: d.allowed,
            remaining: d.remaining,
            retry_after: Duration::from_micros(d.retry_after_us),
            reset_after: Duration::from_micros(d.reset_after_us),
            source,
            limit,
        }
    }
}
