//! Prometheus metrics, with the names dashboards and alerts already use.

use std::fmt;
use std::sync::OnceLock;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::{Error, LossReason};

/// The outcome label of `distributed_lock_acquisitions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AcquireOutcome {
    /// This process now holds the lock.
    Acquired,
    /// Another owner holds it.
    Denied,
    /// It is already held or being acquired in this process.
    DeniedLocal,
    /// The backend could not be reached, or no backend is configured while one is
    /// required; nothing ran.
    Unavailable,
    /// No backend is configured; the job ran behind the in-process guard only.
    Unlocked,
    /// The backend answered with an error other than unavailability (ACL, protocol).
    Error,
}

impl AcquireOutcome {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Denied => "denied",
            Self::DeniedLocal => "denied_local",
            Self::Unavailable => "unavailable",
            Self::Unlocked => "unlocked",
            Self::Error => "error",
        }
    }
}

/// The outcome label of `distributed_lock_renewals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RenewalOutcome {
    /// The lease was extended.
    Renewed,
    /// Another owner holds the lock.
    Stolen,
    /// The lease was gone.
    Expired,
    /// The backend failed; the renewal will be retried while the lease is valid.
    Error,
}

impl RenewalOutcome {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Renewed => "renewed",
            Self::Stolen => "stolen",
            Self::Expired => "expired",
            Self::Error => "error",
        }
    }
}

/// The lock metrics, registered once per registry and shared by every
/// [`Locker`](crate::Locker) that reports into it. Cheap to clone.
///
/// | metric | labels |
/// |---|---|
/// | `distributed_lock_acquisitions_total` | `lock`, `outcome` |
/// | `distributed_lock_renewals_total` | `lock`, `outcome` |
/// | `distributed_lock_lost_total` | `lock`, `reason` |
/// | `distributed_locks_held` | `lock` |
/// | `distributed_lock_held_seconds` | `lock` |
#[derive(Clone)]
pub struct LockMetrics {
    acquisitions: IntCounterVec,
    renewals: IntCounterVec,
    lost: IntCounterVec,
    held: IntGaugeVec,
    held_seconds: HistogramVec,
}

impl fmt::Debug for LockMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LockMetrics")
    }
}

impl LockMetrics {
    /// Creates the metrics and registers them in `registry`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the registry already has metrics of these names
    /// (register once, then clone the `LockMetrics` into every `Locker`).
    pub fn register(registry: &Registry) -> Result<Self, Error> {
        let metrics = Self::unregistered()?;
        let collectors: [Box<dyn prometheus::core::Collector>; 5] = [
            Box::new(metrics.acquisitions.clone()),
            Box::new(metrics.renewals.clone()),
            Box::new(metrics.lost.clone()),
            Box::new(metrics.held.clone()),
            Box::new(metrics.held_seconds.clone()),
        ];
        for c in collectors {
            registry.register(c).map_err(|e| {
                Error::Config(format!(
                    "cannot register lock metrics ({e}); register LockMetrics once per registry and share it"
                ))
            })?;
        }
        Ok(metrics)
    }

    /// The metrics in the process-wide default registry, registered on first use.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code already registered metrics of these names there.
    pub fn default_registry() -> Result<Self, Error> {
        static DEFAULT: OnceLock<Result<LockMetrics, String>> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                Self::register(prometheus::default_registry()).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Config)
    }

    fn unregistered() -> Result<Self, Error> {
        let build = |e: prometheus::Error| Error::Config(format!("invalid metric definition: {e}"));
        Ok(Self {
            acquisitions: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_acquisitions_total",
                    "Lock acquisition attempts by outcome.",
                ),
                &["lock", "outcome"],
            )
            .map_err(build)?,
            renewals: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_renewals_total",
                    "Lease renewals by outcome.",
                ),
                &["lock", "outcome"],
            )
            .map_err(build)?,
            lost: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_lost_total",
                    "Held leases lost, by reason.",
                ),
                &["lock", "reason"],
            )
            .map_err(build)?,
            held: IntGaugeVec::new(
                Opts::new(
                    "distributed_locks_held",
                    "Locks currently held by this process.",
                ),
                &["lock"],
            )
            .map_err(build)?,
            held_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "distributed_lock_held_seconds",
                    "How long locks were held, from acquire to release or loss.",
                )
                .buckets(vec![
                    0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
                ]),
                &["lock"],
            )
            .map_err(build)?,
        })
    }

    pub(crate) fn acquisition(&self, lock: &str, outcome: AcquireOutcome) {
        self.acquisitions
            .with_label_values(&[lock, outcome.as_str()])
            .inc();
    }

    pub(crate) fn renewal(&self, lock: &str, outcome: RenewalOutcome) {
        self.renewals
            .with_label_values(&[lock, outcome.as_str()])
            .inc();
    }

    pub(crate) fn lost(&self, lock: &str, reason: LossReason) {
        self.lost.with_label_values(&[lock, reason.as_str()]).inc();
    }

    pub(crate) fn held_start(&self, lock: &str) {
        self.held.with_label_values(&[lock]).inc();
    }

    pub(crate) fn held_end(&self, lock: &str, seconds: f64) {
        self.held.with_label_values(&[lock]).dec();
        self.held_seconds
            .with_label_values(&[lock])
            .observe(seconds);
    }

    /// The current value of `distributed_lock_acquisitions_total{lock, outcome}`.
    pub fn acquisitions(&self, lock: &str, outcome: AcquireOutcome) -> u64 {
        self.acquisitions
            .with_label_values(&[lock, outcome.as_str()])
            .get()
    }

    /// The current value of `distributed_lock_renewals_total{lock, outcome}`.
    pub fn renewals(&self, lock: &str, outcome: RenewalOutcome) -> u64 {
        self.renewals
            .with_label_values(&[lock, outcome.as_str()])
            .get()
    }

    /// The current value of `distributed_lock_lost_total{lock, reason}`.
    pub fn losses(&self, lock: &str, reason: LossReason) -> u64 {
        self.lost.with_label_values(&[lock, reason.as_str()]).get()
    }

    /// The current value of `distributed_locks_held{lock}`.
    pub fn held(&self, lock: &str) -> i64 {
        self.held.with_label_values(&[lock]).get()
    }

    /// How many holds of `lock` have ended (the histogram's sample count).
    pub fn holds_ended(&self, lock: &str) -> u64 {
        self.held_seconds
            .with_label_values(&[lock])
            .get_sample_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_once_per_registry_with_the_documented_names() {
        let registry = Registry::new();
        let m = LockMetrics::register(&registry).expect("first registration");
        m.acquisition("job", AcquireOutcome::Acquired);
        m.renewal("job", RenewalOutcome::Renewed);
        m.lost("job", LossReason::Stolen);
        m.held_start("job");
        m.held_end("job", 0.5);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        for expected in [
            "distributed_lock_acquisitions_total",
            "distributed_lock_renewals_total",
            "distributed_lock_lost_total",
            "distributed_locks_held",
            "distributed_lock_held_seconds",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} missing in {names:?}"
            );
        }
        assert!(matches!(
            LockMetrics::register(&registry),
            Err(Error::Config(_))
        ));
    }
}
