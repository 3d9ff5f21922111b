//! Scheduler metrics, with the names dashboards and alerts already use.

use std::fmt;
use std::sync::OnceLock;

use lock_core::shared_metrics::{
    in_default_registry, register_shared, MetricSet, SharedRegistrationError,
};
use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use crate::{Error, Result};

/// How one scheduled tick ended on one replica: the `outcome` label of
/// `scheduler_runs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TickOutcome {
    /// The handler returned `Ok` and its `Completed` record was written.
    Success,
    /// The handler returned an error and its `Completed` record was
    /// written. The tick counts as done (it was attempted) and is not
    /// retried elsewhere.
    Failure,
    /// The lock or the leadership was lost, or the scheduler shut down, while
    /// the handler ran; it was stopped.
    Aborted,
    /// This replica did not run the tick: another replica has it or ran it,
    /// a newer tick replaced it while it waited for the previous run here
    /// (or that run outlasted its skew window), or the backend was
    /// unavailable.
    Skipped,
    /// The handler panicked; the panic was caught, and its `Completed`
    /// record was written.
    Panicked,
    /// [`Delivery::AtMostOnce`](crate::Delivery::AtMostOnce): the tick had
    /// been started by a replica whose lock then expired before it
    /// completed, so this replica marked it abandoned instead of running it
    /// again. Its first run may or may not have done its work: alert on it.
    Abandoned,
    /// The handler ran here, but by the time it returned another replica had
    /// taken the tick over ([`Delivery::AtLeastOnce`](crate::Delivery::AtLeastOnce))
    /// or marked it abandoned: this replica's completion was refused (fenced
    /// out by the token). The run here may have done its work too.
    FencedOut,
    /// The handler ran here and returned (whatever it returned: its result
    /// is logged), but its `Completed` record could not be written: the
    /// store failed or timed out on every try (the write is sent again, as
    /// it is safe to). The tick stays `Started` in the store, and this
    /// replica keeps the tick's lock as its only mark until every replica
    /// within the skew tolerance has passed the tick, so none runs it again
    /// meanwhile. A replica that fires it later all the same (a missed-tick
    /// catch-up, or one whose clock is further behind than the tolerance)
    /// finds a stale start: [`Delivery::AtMostOnce`](crate::Delivery::AtMostOnce)
    /// marks it abandoned without running it,
    /// [`Delivery::AtLeastOnce`](crate::Delivery::AtLeastOnce) runs it again.
    /// Alert on it, as on `abandoned`.
    Unrecorded,
}

impl TickOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 8] = [
        Self::Success,
        Self::Failure,
        Self::Aborted,
        Self::Skipped,
        Self::Panicked,
        Self::Abandoned,
        Self::FencedOut,
        Self::Unrecorded,
    ];

    /// Its position in [`Self::ALL`].
    const fn index(self) -> usize {
        match self {
            Self::Success => 0,
            Self::Failure => 1,
            Self::Aborted => 2,
            Self::Skipped => 3,
            Self::Panicked => 4,
            Self::Abandoned => 5,
            Self::FencedOut => 6,
            Self::Unrecorded => 7,
        }
    }

    /// The label value: `success`, `failure`, `aborted`, `skipped`,
    /// `panicked`, `abandoned`, `fenced_out` or `unrecorded`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Aborted => "aborted",
            Self::Skipped => "skipped",
            Self::Panicked => "panicked",
            Self::Abandoned => "abandoned",
            Self::FencedOut => "fenced_out",
            Self::Unrecorded => "unrecorded",
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
    /// Registers the metrics in `registry`, or returns the ones this library
    /// already registered there, so every scheduler reporting into one
    /// registry counts into the same series.
    ///
    /// # Errors
    ///
    /// [`Error::Metrics`] if other code registered metrics of these names in
    /// `registry`: give the scheduler metrics a registry of their own.
    pub fn register(registry: &Registry) -> Result<Self> {
        register_shared(registry, "scheduler_metrics_instance", Self::unregistered).map_err(|e| {
            match e {
                SharedRegistrationError::TakenByOthers => Error::Metrics(
                    "metrics named scheduler_* are already registered in this registry by \
                     other code; give the scheduler metrics a registry of their own"
                        .into(),
                ),
                e => Error::Metrics(format!("{e}; give them a registry of their own")),
            }
        })
    }

    /// The metrics in the process-wide default registry, registered on first
    /// use; the same as `register(prometheus::default_registry())`.
    ///
    /// # Errors
    ///
    /// [`Error::Metrics`] if other code registered metrics of these names there.
    pub fn default_registry() -> Result<Self> {
        static DEFAULT: OnceLock<SchedulerMetrics> = OnceLock::new();
        in_default_registry(&DEFAULT, Self::register)
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

    /// `job`'s series, with its run series created at 0 for every outcome.
    /// Prometheus's `increase()` cannot see a counter's first sample as a
    /// rise, so a `panicked` series born at 1 on the first panic would never
    /// alert.
    pub(crate) fn job(&self, job: &str) -> JobMetrics {
        JobMetrics {
            runs: TickOutcome::ALL.map(|o| self.runs.with_label_values(&[job, o.as_str()])),
            duration: self.duration.with_label_values(&[job]),
            lag: self.lag.with_label_values(&[job]),
        }
    }

    pub(crate) fn set_leader(&self, leader: bool) {
        self.is_leader.set(i64::from(leader));
    }

    /// Test hook: the current value of `scheduler_runs_total{job, outcome}`.
    #[cfg(feature = "test-util")]
    pub fn runs(&self, job: &str, outcome: TickOutcome) -> u64 {
        self.runs.with_label_values(&[job, outcome.as_str()]).get()
    }

    /// Test hook: the current value of `scheduler_is_leader`.
    #[cfg(feature = "test-util")]
    pub fn is_leader(&self) -> i64 {
        self.is_leader.get()
    }

    /// Test hook: how many runs of `job` were timed (the duration histogram's count).
    #[cfg(feature = "test-util")]
    pub fn timed_runs(&self, job: &str) -> u64 {
        self.duration.with_label_values(&[job]).get_sample_count()
    }

    /// Test hook: how many tick lags of `job` were observed.
    #[cfg(feature = "test-util")]
    pub fn lag_samples(&self, job: &str) -> u64 {
        self.lag.with_label_values(&[job]).get_sample_count()
    }
}

/// One job's series, resolved once when the scheduler is built: a tick then
/// updates them without looking its job's label up in each metric family
/// (with 1,000 jobs firing every second, those lookups showed in profiles).
#[derive(Clone)]
pub(crate) struct JobMetrics {
    /// By outcome, in the order of [`TickOutcome::ALL`].
    runs: [IntCounter; 8],
    duration: Histogram,
    lag: Histogram,
}

impl JobMetrics {
    pub(crate) fn run(&self, outcome: TickOutcome) {
        self.runs[outcome.index()].inc();
    }

    pub(crate) fn observe_duration(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    pub(crate) fn observe_lag(&self, seconds: f64) {
        self.lag.observe(seconds.max(0.0));
    }
}

impl MetricSet for SchedulerMetrics {
    fn collectors(&self) -> Vec<&dyn Collector> {
        vec![&self.runs, &self.is_leader, &self.duration, &self.lag]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_the_documented_names_once_per_registry() {
        let registry = Registry::new();
        let m = SchedulerMetrics::register(&registry).expect("first registration");
        let job = m.job("job");
        job.run(TickOutcome::Panicked);
        m.set_leader(true);
        job.observe_duration(0.2);
        job.observe_lag(0.01);
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
        assert!(
            !names.iter().any(|n| n == "scheduler_metrics_instance"),
            "{names:?}"
        );
        let again = SchedulerMetrics::register(&registry.clone()).expect("reused");
        again.job("job").run(TickOutcome::Panicked);
        assert_eq!(m.runs("job", TickOutcome::Panicked), 2);
        let apart = SchedulerMetrics::register(&Registry::new()).expect("another registry");
        assert_eq!(apart.runs("job", TickOutcome::Panicked), 0);
    }

    #[test]
    fn a_declared_job_has_every_outcome_at_zero() {
        let registry = Registry::new();
        let m = SchedulerMetrics::register(&registry).expect("registration");
        let report = m.job("report");
        let mut outcomes: Vec<(String, u64)> = registry
            .gather()
            .iter()
            .filter(|f| f.name() == "scheduler_runs_total")
            .flat_map(|f| f.get_metric())
            .map(|m| {
                let outcome = m
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "outcome")
                    .map(|l| l.value().to_owned())
                    .unwrap_or_default();
                (outcome, m.get_counter().get_value() as u64)
            })
            .collect();
        outcomes.sort();
        let expected: Vec<(String, u64)> = [
            "abandoned",
            "aborted",
            "failure",
            "fenced_out",
            "panicked",
            "skipped",
            "success",
            "unrecorded",
        ]
        .iter()
        .map(|o| ((*o).to_owned(), 0))
        .collect();
        assert_eq!(outcomes, expected);
        report.run(TickOutcome::Panicked);
        assert_eq!(m.runs("report", TickOutcome::Panicked), 1);
        report.run(TickOutcome::Skipped);
        report.run(TickOutcome::Skipped);
        assert_eq!(m.runs("report", TickOutcome::Skipped), 2);
        assert_eq!(m.runs("report", TickOutcome::Success), 0);
        report.observe_lag(-1.0);
        assert_eq!(m.lag_samples("report"), 1, "a negative lag counts as 0");
    }

    #[test]
    fn each_outcome_indexes_its_place_in_all() {
        for (i, outcome) in TickOutcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome.index(), i, "{outcome}");
        }
    }

    #[test]
    fn names_taken_by_other_code_are_an_error() {
        let registry = Registry::new();
        let foreign = IntGauge::new(
            "scheduler_is_leader",
            "1 while this replica is the elected scheduler leader, else 0.",
        )
        .expect("valid metric");
        registry
            .register(Box::new(foreign))
            .expect("foreign metric");
        let err = SchedulerMetrics::register(&registry).expect_err("the name is taken");
        assert!(
            matches!(&err, Error::Metrics(m) if m.contains("other code")),
            "{err}"
        );
        assert_eq!(registry.gather().len(), 1, "only the foreign gauge");
    }
}
