//! Prometheus metrics, with the names dashboards and alerts already use.

mod label;
mod shared;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use prometheus::core::Collector;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::Error;
#[cfg(any(test, feature = "test-util"))]
use crate::LossReason;

pub(crate) use label::LabelMetrics;

type LabelMap = HashMap<Arc<str>, Arc<LabelMetrics>, foldhash::fast::RandomState>;

pub use shared::{in_default_registry, register_shared, MetricSet, SharedRegistrationError};

/// The outcome label of `distributed_lock_acquisitions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AcquireOutcome {
    /// This process now holds the lock.
    Acquired,
    /// Another owner holds it (label `denied`).
    HeldElsewhere,
    /// It is already held or being acquired in this process (label `denied_local`).
    HeldLocally,
    /// The backend could not be reached, or no backend is configured while one is
    /// required; nothing ran.
    Unavailable,
    /// No backend is configured; the job ran behind the in-process guard only.
    Unlocked,
    /// The backend answered with an error other than unavailability (ACL, protocol).
    Error,
}

impl AcquireOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 6] = [
        Self::Acquired,
        Self::HeldElsewhere,
        Self::HeldLocally,
        Self::Unavailable,
        Self::Unlocked,
        Self::Error,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::HeldElsewhere => "denied",
            Self::HeldLocally => "denied_local",
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
    /// An operator's forced release freed the lock.
    Forced,
}

impl RenewalOutcome {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Renewed => "renewed",
            Self::Stolen => "stolen",
            Self::Expired => "expired",
            Self::Error => "error",
            Self::Forced => "forced",
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
///
/// The first time a `lock` label is seen, its acquisition series (every
/// outcome) and loss series (every reason but `released`) are created at 0.
/// Prometheus's `increase()` cannot see a counter's first sample as a rise,
/// so a series born at 1 on the first theft would never trip an alert on
/// `increase(distributed_lock_lost_total[...]) > 0`.
#[derive(Clone)]
pub struct LockMetrics {
    acquisitions: IntCounterVec,
    renewals: IntCounterVec,
    lost: IntCounterVec,
    held: IntGaugeVec,
    held_seconds: HistogramVec,
    /// Every `lock` label seen, with its series resolved (the acquisition
    /// and loss ones created at 0); bounded by the number of labels, as the
    /// series themselves are.
    labels: Arc<Mutex<LabelMap>>,
}

impl fmt::Debug for LockMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LockMetrics")
    }
}

impl LockMetrics {
    /// Registers the metrics in `registry`, or returns the ones this library
    /// already registered there, so every [`Locker`](crate::Locker) reporting
    /// into one registry counts into the same series.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code registered metrics of these names in
    /// `registry`: give the lock metrics a registry of their own.
    pub fn register(registry: &Registry) -> Result<Self, Error> {
        register_shared(
            registry,
            "distributed_lock_metrics_instance",
            Self::unregistered,
        )
        .map_err(|e| match e {
            SharedRegistrationError::TakenByOthers => Error::Config(
                "metrics named distributed_lock_* are already registered in this registry by \
                     other code; give the lock metrics a registry of their own"
                    .into(),
            ),
            e => Error::Config(format!(
                "cannot register lock metrics ({e}); give them a registry of their own"
            )),
        })
    }

    /// The metrics in the process-wide default registry, registered on first
    /// use; the same as `register(prometheus::default_registry())`.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if other code already registered metrics of these names there.
    pub fn default_registry() -> Result<Self, Error> {
        static DEFAULT: OnceLock<LockMetrics> = OnceLock::new();
        in_default_registry(&DEFAULT, Self::register)
    }

    fn unregistered() -> prometheus::Result<Self> {
        Ok(Self {
            acquisitions: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_acquisitions_total",
                    "Lock acquisition attempts by outcome.",
                ),
                &["lock", "outcome"],
            )?,
            renewals: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_renewals_total",
                    "Lease renewals by outcome.",
                ),
                &["lock", "outcome"],
            )?,
            lost: IntCounterVec::new(
                Opts::new(
                    "distributed_lock_lost_total",
                    "Held leases lost, by reason.",
                ),
                &["lock", "reason"],
            )?,
            held: IntGaugeVec::new(
                Opts::new(
                    "distributed_locks_held",
                    "Locks currently held by this process.",
                ),
                &["lock"],
            )?,
            held_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "distributed_lock_held_seconds",
                    "How long locks were held, from acquire to release or loss.",
                )
                .buckets(vec![
                    0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
                ]),
                &["lock"],
            )?,
            labels: Arc::default(),
        })
    }

    /// The series of `lock`, resolved once per label: the first call creates
    /// every series an alert rule reads for it at 0.
    pub(crate) fn label(&self, lock: &str) -> Arc<LabelMetrics> {
        // Each critical section is one lookup or insert: poison carries no half-state.
        let mut labels = self.labels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = labels.get(lock) {
            return Arc::clone(found);
        }
        let label: Arc<str> = Arc::from(lock);
        let resolved = Arc::new(LabelMetrics::new(
            Arc::clone(&label),
            &label::Families {
                acquisitions: &self.acquisitions,
                renewals: &self.renewals,
                lost: &self.lost,
                held: &self.held,
                held_seconds: &self.held_seconds,
            },
        ));
        labels.insert(label, Arc::clone(&resolved));
        resolved
    }

    /// Test hook: the current value of `distributed_lock_acquisitions_total{lock, outcome}`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn acquisitions(&self, lock: &str, outcome: AcquireOutcome) -> u64 {
        self.acquisitions
            .with_label_values(&[lock, outcome.as_str()])
            .get()
    }

    /// Test hook: the current value of `distributed_lock_renewals_total{lock, outcome}`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn renewals(&self, lock: &str, outcome: RenewalOutcome) -> u64 {
        self.renewals
            .with_label_values(&[lock, outcome.as_str()])
            .get()
    }

    /// Test hook: the current value of `distributed_lock_lost_total{lock, reason}`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn losses(&self, lock: &str, reason: LossReason) -> u64 {
        self.lost.with_label_values(&[lock, reason.as_str()]).get()
    }

    /// Test hook: the current value of `distributed_locks_held{lock}`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn held(&self, lock: &str) -> i64 {
        self.held.with_label_values(&[lock]).get()
    }

    /// Test hook: how many holds of `lock` have ended (the histogram's sample count).
    #[cfg(any(test, feature = "test-util"))]
    pub fn holds_ended(&self, lock: &str) -> u64 {
        self.held_seconds
            .with_label_values(&[lock])
            .get_sample_count()
    }
}

impl MetricSet for LockMetrics {
    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![
            &self.acquisitions,
            &self.renewals,
            &self.lost,
            &self.held,
            &self.held_seconds,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_the_documented_names() {
        let registry = Registry::new();
        let m = LockMetrics::register(&registry).expect("first registration");
        let job = m.label("job");
        job.acquisition(AcquireOutcome::Acquired);
        job.renewal(RenewalOutcome::Renewed);
        job.lost(LossReason::Stolen);
        job.held_start();
        job.held_end(0.5);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        // Sorted by name; the marker is never exported.
        assert_eq!(
            names,
            [
                "distributed_lock_acquisitions_total",
                "distributed_lock_held_seconds",
                "distributed_lock_lost_total",
                "distributed_lock_renewals_total",
                "distributed_locks_held",
            ]
        );
    }

    fn series(registry: &Registry, family: &str) -> Vec<(String, String, f64)> {
        let mut out = Vec::new();
        for f in registry.gather().iter().filter(|f| f.name() == family) {
            for m in f.get_metric() {
                let label = |n: &str| {
                    m.get_label()
                        .iter()
                        .find(|l| l.name() == n)
                        .map(|l| l.value().to_owned())
                        .unwrap_or_default()
                };
                let kind = if family.ends_with("lost_total") {
                    "reason"
                } else {
                    "outcome"
                };
                out.push((label("lock"), label(kind), m.get_counter().get_value()));
            }
        }
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        out
    }

    #[test]
    fn a_new_lock_label_starts_every_alerted_series_at_zero() {
        let registry = Registry::new();
        let m = LockMetrics::register(&registry).expect("registration");
        m.label("job").acquisition(AcquireOutcome::Acquired);
        let lost = series(&registry, "distributed_lock_lost_total");
        assert_eq!(
            lost,
            [
                ("job".into(), "backend_error".into(), 0.0),
                ("job".into(), "expired".into(), 0.0),
                ("job".into(), "forced".into(), 0.0),
                ("job".into(), "max_hold_exceeded".into(), 0.0),
                ("job".into(), "stolen".into(), 0.0),
            ],
            "released is never a loss, so it has no series"
        );
        let acquisitions = series(&registry, "distributed_lock_acquisitions_total");
        let outcomes: Vec<(&str, f64)> = acquisitions
            .iter()
            .map(|(_, o, v)| (o.as_str(), *v))
            .collect();
        assert_eq!(
            outcomes,
            [
                ("acquired", 1.0),
                ("denied", 0.0),
                ("denied_local", 0.0),
                ("error", 0.0),
                ("unavailable", 0.0),
                ("unlocked", 0.0),
            ]
        );
        m.label("job").lost(LossReason::Stolen);
        m.label("job").acquisition(AcquireOutcome::Acquired);
        assert_eq!(m.losses("job", LossReason::Stolen), 1);
        assert_eq!(m.acquisitions("job", AcquireOutcome::Acquired), 2);
        assert_eq!(
            series(&registry, "distributed_lock_lost_total").len(),
            LossReason::LOSSES.len(),
            "one series per reason and label, however often counted"
        );
    }
}
