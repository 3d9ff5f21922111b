//! Scheduler metrics, with the names dashboards and alerts already use.

use std::fmt;
use std::sync::OnceLock;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};

use crate::{Error, Result};

/// How one scheduled tick ended on one replica: the `outcome` label of
/// `scheduler_runs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TickOutcome {
    /// The handler returned `Ok` and the lock was still held afterwards.
    Success,
    /// The handler returned an error. The tick counts as done (it was
    /// attempted) and is not retried elsewhere.
    Failure,
    /// The lock or the leadership was lost, or the scheduler shut down, while
    /// the handler ran; it was stopped.
    Aborted,
    /// This replica did not run the tick: another replica has it or ran it,
    /// a newer tick replaced it while it waited for the previous run here
    /// (or that run outlasted its skew window), or the backend was
    /// unavailable.
    Skipped,
    /// The handler panicked; the panic was caught.
    Panicked,
}

impl TickOutcome {
    /// The label value: `success`, `failure`, `aborted`, `skipped` or `panicked`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Aborted => "aborted",
            Self::Skipped => "skipped",
            Self::Panicked => "panicked",
        }
    }
}

impl fmt::Display for TickOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The scheduler's metrics, registered once per registry. Cheap to clone.
///
/// | metric | labels |
/// |---|---|
/// | `scheduler_runs_total` | `job`, `outcome` |
/// | `scheduler_is_leader` | (none): 1 on the elected replica, 0 elsewhere |
/// | `scheduler_run_duration_seconds` | `job` |
/// | `scheduler_tick_lag_seconds` | `job`: from the scheduled instant to the handler's start |
#[derive(Clone)]
pub struct SchedulerMetrics {
    runs: IntCounterVec,
    is_leader: IntGauge,
    duration: HistogramVec,
    lag: HistogramVec,
}

impl fmt::Debug for SchedulerMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SchedulerMetrics")
    }
}

impl SchedulerMetrics {
    /// Creates the metrics and registers them in `registry`.
    ///
    /// # Errors
    ///
    /// [`Error::Metrics`] if `registry` already has metrics of these names.
    pub fn register(registry: &Registry) -> Result<Self> {
        let m = Self::unregistered().map_err(|e| Error::Metrics(e.to_string()))?;
        let collectors: [Box<dyn prometheus::core::Collector>; 4] = [
            Box::new(m.runs.clone()),
            Box::new(m.is_leader.clone()),
            Box::new(m.duration.clone()),
            Box::new(m.lag.clone()),
        ];
        for c in collectors {
            registry
                .register(c)
                .map_err(|e| Error::Metrics(e.to_string()))?;
        }
        Ok(m)
    }

    /// The metrics in the process-wide default registry, registered on first use.
    ///
    /// # Errors
    ///
    /// [`Error::Metrics`] if other code registered metrics of these names there.
    pub fn default_registry() -> Result<Self> {
        static DEFAULT: OnceLock<std::result::Result<SchedulerMetrics, String>> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                Self::register(prometheus::default_registry()).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Metrics)
    }

    fn unregistered() -> prometheus::Result<Self> {
        let buckets = vec![
            0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
        ];
        Ok(Self {
            runs: IntCounterVec::new(
                Opts::new("scheduler_runs_total", "Scheduled ticks by job and outcome."),
                &["job", "outcome"],
            )?,
            is_leader: IntGauge::new(
                "scheduler_is_leader",
                "1 while this replica is the elected scheduler leader, else 0.",
            )?,
            duration: HistogramVec::new(
                HistogramOpts::new(
                    "scheduler_run_duration_seconds",
                    "How long job handlers ran.",
                )
                .buckets(buckets.clone()),
                &["job"],
            )?,
            lag: HistogramVec::new(
                HistogramOpts::new(
                    "scheduler_tick_lag_seconds",
                    "From a tick's scheduled instant to its handler's start, on the runner's clock.",
                )
                .buckets(buckets),
                &["job"],
            )?,
        })
    }

    pub(crate) fn run(&self, job: &str, outcome: TickOutcome) {
        self.runs.with_label_values(&[job, outcome.as_str()]).inc();
    }

    pub(crate) fn set_leader(&self, leader: bool) {
        self.is_leader.set(i64::from(leader));
    }

    pub(crate) fn observe_duration(&self, job: &str, seconds: f64) {
        self.duration.with_label_values(&[job]).observe(seconds);
    }

    pub(crate) fn observe_lag(&self, job: &str, seconds: f64) {
        self.lag.with_label_values(&[job]).observe(seconds.max(0.0));
    }

    /// The current value of `scheduler_runs_total{job, outcome}`.
    pub fn runs(&self, job: &str, outcome: TickOutcome) -> u64 {
        self.runs.with_label_values(&[job, outcome.as_str()]).get()
    }

    /// The current value of `scheduler_is_leader`.
    pub fn is_leader(&self) -> i64 {
        self.is_leader.get()
    }

    /// How many runs of `job` were timed (the duration histogram's count).
    pub fn timed_runs(&self, job: &str) -> u64 {
        self.duration.with_label_values(&[job]).get_sample_count()
    }

    /// How many tick lags of `job` were observed.
    pub fn lag_samples(&self, job: &str) -> u64 {
        self.lag.with_label_values(&[job]).get_sample_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_once_per_registry_with_the_documented_names() {
        let registry = Registry::new();
        let m = SchedulerMetrics::register(&registry).expect("first registration");
        m.run("job", TickOutcome::Panicked);
        m.set_leader(true);
        m.observe_duration("job", 0.2);
        m.observe_lag("job", 0.01);
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        for expected in [
            "scheduler_runs_total",
            "scheduler_is_leader",
            "scheduler_run_duration_seconds",
            "scheduler_tick_lag_seconds",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} missing in {names:?}"
            );
        }
        assert_eq!(m.runs("job", TickOutcome::Panicked), 1);
        assert_eq!(m.is_leader(), 1);
        assert!(matches!(
            SchedulerMetrics::register(&registry),
            Err(Error::Metrics(_))
        ));
    }
}
