//! The limiter's Prometheus metrics.

mod decisions;

use std::fmt;
use std::sync::{Arc, OnceLock};

use lock_core::shared_metrics::{
    in_default_registry, register_shared, MetricSet, SharedRegistrationError,
};
use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use crate::error::{Error, Result, StoreErrorKind};
use decisions::{Counts, Decisions};

/// One limiter's series, resolved at build.
#[derive(Clone)]
pub(crate) struct LimiterSeries {
    decisions: Arc<Counts>,
    fallbacks: IntCounter,
    errors: [IntCounter; 4],
    duration: Histogram,
    breaker_open: IntGauge,
}

impl LimiterSeries {
    pub(crate) fn decision(&self, outcome: Outcome, source: Source) {
        self.decisions.add(outcome, source);
        if source == Source::Fallback || (source == Source::None && outcome == Outcome::Allowed) {
            self.fallbacks.inc();
        }
    }

    pub(crate) fn store_error(&self, kind: StoreErrorKind) {
        let i = StoreErrorKind::ALL
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(0);
        self.errors[i].inc();
    }

    pub(crate) fn store_duration(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    pub(crate) fn breaker(&self, open: bool) {
        self.breaker_open.set(i64::from(open));
    }
}

/// Where a decision came from, for the `source` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Source {
    /// The limiter's store (shared on Redis and Postgres).
    Store,
    /// The per-process fallback, because the store failed.
    Fallback,
    /// No limit was checked: the store failed and the policy allows or
    /// denies without one.
    None,
}

impl Source {
    /// Every source, in the order of their discriminants.
    const ALL: [Self; 3] = [Self::Store, Self::Fallback, Self::None];

    /// The label value.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::Fallback => "fallback",
            Self::None => "none",
        }
    }
}

/// What a decision was, for the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Outcome {
    Allowed,
    Limited,
    Unavailable,
}

impl Outcome {
    const ALL: [(Self, &'static str); 3] = [
        (Self::Allowed, "allowed"),
        (Self::Limited, "limited"),
        (Self::Unavailable, "unavailable"),
    ];
}

/// The rate-limit metrics of one registry, shared by every limiter that
/// reports there.
///
/// | metric | labels |
/// |---|---|
/// | `rate_limit_decisions_total` | `limiter`, `outcome` (`allowed`, `limited`, `unavailable`), `source` (`store`, `fallback`, `none`) |
/// | `rate_limit_store_fallbacks_total` | `limiter`: decisions not made by the store because it failed (policies allow and fallback) |
/// | `rate_limit_store_errors_total` | `limiter`, `kind` (`timeout`, `connection`, `server`, `protocol`) |
/// | `rate_limit_store_duration_seconds` | `limiter`: store calls, answered or failed; none for an in-process store |
/// | `rate_limit_breaker_open` | `limiter`: 1 while the circuit breaker keeps calls off the store |
///
/// Every series of a limiter is created at 0 when it is built, so
/// `increase()` in an alert sees the first fallback.
///
/// A limiter on an in-process store ([`Store::in_process`](crate::store::Store::in_process):
/// a [`MemoryStore`](crate::store::MemoryStore), however it was given or
/// named) records no `rate_limit_store_duration_seconds` sample: it never
/// waits on a network, and timing each decision would cost more than the
/// decision. Its series stays at 0; its decisions are counted as any
/// other's.
#[derive(Clone)]
pub struct RateLimitMetrics {
    decisions: Decisions,
    fallbacks: IntCounterVec,
    errors: IntCounterVec,
    duration: HistogramVec,
    breaker_open: IntGaugeVec,
}

impl fmt::Debug for RateLimitMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RateLimitMetrics")
    }
}

impl MetricSet for RateLimitMetrics {
    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.decisions,
            &self.fallbacks,
            &self.errors,
            &self.duration,
            &self.breaker_open,
        ]
    }
}

impl RateLimitMetrics {
    /// Registers the metrics in `registry`, or returns the ones already
    /// registered there by this library.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code registered metrics of these names.
    pub fn register(registry: &Registry) -> Result<Self> {
        register_shared(registry, "rate_limit_metrics_instance", Self::unregistered).map_err(|e| {
            match e {
                SharedRegistrationError::TakenByOthers => Error::Config(
                    "metrics named rate_limit_* are already registered in this registry by other \
                     code; give the rate-limit metrics a registry of their own"
                        .into(),
                ),
                e => Error::Config(format!("cannot register rate-limit metrics ({e})")),
            }
        })
    }

    /// The metrics in the process-wide default registry.
    ///
    /// # Errors
    ///
    /// As [`register`](Self::register).
    pub fn default_registry() -> Result<Self> {
        static DEFAULT: OnceLock<RateLimitMetrics> = OnceLock::new();
        in_default_registry(&DEFAULT, Self::register)
    }

    fn unregistered() -> prometheus::Result<Self> {
        Ok(Self {
            decisions: Decisions::new(IntCounterVec::new(
                Opts::new(
                    "rate_limit_decisions_total",
                    "Rate-limit decisions by outcome and by where they were made.",
                ),
                &["limiter", "outcome", "source"],
            )?),
            fallbacks: IntCounterVec::new(
                Opts::new(
                    "rate_limit_store_fallbacks_total",
                    "Requests decided without the shared store because it failed.",
                ),
                &["limiter"],
            )?,
            errors: IntCounterVec::new(
                Opts::new(
                    "rate_limit_store_errors_total",
                    "Failed rate-limit store calls by kind.",
                ),
                &["limiter", "kind"],
            )?,
            duration: HistogramVec::new(
                HistogramOpts::new(
                    "rate_limit_store_duration_seconds",
                    "Rate-limit store call latency, answered or failed.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
                ]),
                &["limiter"],
            )?,
            breaker_open: IntGaugeVec::new(
                Opts::new(
                    "rate_limit_breaker_open",
                    "1 while the circuit breaker keeps a limiter's calls off its store.",
                ),
                &["limiter"],
            )?,
        })
    }

    /// Creates every series of `limiter` at 0 and resolves them once, so a
    /// decision costs no label lookup.
    pub(crate) fn series(&self, limiter: &str) -> LimiterSeries {
        LimiterSeries {
            decisions: self.decisions.counts(limiter),
            fallbacks: self.fallbacks.with_label_values(&[limiter]),
            errors: StoreErrorKind::ALL
                .map(|kind| self.errors.with_label_values(&[limiter, kind.as_str()])),
            duration: self.duration.with_label_values(&[limiter]),
            breaker_open: {
                let g = self.breaker_open.with_label_values(&[limiter]);
                g.set(0);
                g
            },
        }
    }

    /// The decisions counted for `limiter` with this outcome label and
    /// source, every decision made before the call included.
    #[must_use]
    pub fn decisions(&self, limiter: &str, outcome: &str, source: Source) -> u64 {
        self.decisions.get(limiter, outcome, source)
    }

    /// The fallbacks counted for `limiter`.
    #[must_use]
    pub fn fallbacks(&self, limiter: &str) -> u64 {
        self.fallbacks.with_label_values(&[limiter]).get()
    }

    /// The store errors counted for `limiter` of `kind`.
    #[must_use]
    pub fn store_errors(&self, limiter: &str, kind: StoreErrorKind) -> u64 {
        self.errors
            .with_label_values(&[limiter, kind.as_str()])
            .get()
    }

    /// Whether `limiter`'s breaker is open now.
    #[must_use]
    pub fn breaker_open(&self, limiter: &str) -> bool {
        self.breaker_open.with_label_values(&[limiter]).get() == 1
    }
}
