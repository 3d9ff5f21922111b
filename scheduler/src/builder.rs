//! Configuring a [`Scheduler`].

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{Locker, TickStore};
use prometheus::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::leader::{DEFAULT_ELECTION_INTERVAL, DEFAULT_ELECTION_TTL};
use crate::runtime::{OutcomeHook, Runtime};
use crate::{Error, Job, Result, RunReport, Scheduler, SchedulerMetrics, SystemClock, WallClock};

/// The default skew tolerance: how far apart replicas' clocks may be.
pub const DEFAULT_SKEW_TOLERANCE: Duration = Duration::from_secs(5);

/// The largest skew tolerance a scheduler accepts: a day. Every finished
/// tick's lock is kept for up to the tolerance and its mark for twice as
/// long; clocks further apart than this need fixing, not tolerating.
pub const MAX_SKEW_TOLERANCE: Duration = Duration::from_secs(24 * 60 * 60);

/// The smallest skew tolerance: ticks are named and compared in whole
/// milliseconds, so anything shorter is no tolerance at all.
const MIN_SKEW_TOLERANCE: Duration = Duration::from_millis(1);

/// How replicas agree on who runs a tick.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Every replica fires every tick on its own clock; a lock named for the
    /// job and the tick lets exactly one of them run it.
    PerTick,
    /// Replicas elect a leader; only the leader fires ticks (each still under
    /// its per-tick lock, so a handover can never run a tick twice).
    Leader(ElectionOptions),
}

/// Settings of the leader election in [`Mode::Leader`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionOptions {
    pub(crate) name: String,
    pub(crate) ttl: Duration,
    pub(crate) interval: Duration,
}

impl Default for ElectionOptions {
    /// The lock `scheduler/leader`, a 15 s TTL, a 5 s retry interval.
    fn default() -> Self {
        Self {
            name: "scheduler/leader".into(),
            ttl: DEFAULT_ELECTION_TTL,
            interval: DEFAULT_ELECTION_INTERVAL,
        }
    }
}

impl ElectionOptions {
    /// The default options.
    pub fn new() -> Self {
        Self::default()
    }

    /// The election lock's name; replicas of one service must agree on it.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The election lock's TTL: a crashed leader is replaced within
    /// `ttl + interval`.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often standbys try to take over.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }
}

/// Builds a [`Scheduler`]: a [`Locker`], a [`TickStore`] on the same server,
/// a mode, jobs, and optionally a clock, a metrics registry and an outcome hook.
#[must_use = "a scheduler builder runs nothing until `start` is called"]
pub struct SchedulerBuilder {
    locker: Locker,
    ticks: Arc<dyn TickStore>,
    mode: Mode,
    clock: Arc<dyn WallClock>,
    metrics: Option<SchedulerMetrics>,
    registry: Option<Registry>,
    tolerance: Duration,
    jobs: Vec<Job>,
    on_outcome: Option<OutcomeHook>,
    replica: Option<String>,
    #[cfg(feature = "test-util")]
    pause: Option<crate::PauseHook>,
}

impl fmt::Debug for SchedulerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchedulerBuilder")
            .field("mode", &self.mode)
            .field("clock", &self.clock)
            .field("tolerance", &self.tolerance)
            .field("jobs", &self.jobs)
            .finish()
    }
}

impl SchedulerBuilder {
    pub(crate) fn new(locker: Locker, ticks: Arc<dyn TickStore>) -> Self {
        Self {
            locker,
            ticks,
            mode: Mode::PerTick,
            clock: Arc::new(SystemClock),
            metrics: None,
            registry: None,
            tolerance: DEFAULT_SKEW_TOLERANCE,
            jobs: Vec::new(),
            on_outcome: None,
            replica: None,
            #[cfg(feature = "test-util")]
            pause: None,
        }
    }

    /// The coordination mode (default [`Mode::PerTick`]).
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Adds a job.
    pub fn with_job(mut self, job: Job) -> Self {
        self.jobs.push(job);
        self
    }

    /// The wall clock cron expressions are evaluated against (default the
    /// system clock).
    pub fn with_clock(mut self, clock: Arc<dyn WallClock>) -> Self {
        self.clock = clock;
        self
    }

    /// How far apart replicas' clocks may be (default 5 s, at least 1 ms, at
    /// most [`MAX_SKEW_TOLERANCE`]). A finished tick's lock is kept until the
    /// tick plus this tolerance has passed, and a tick that a late timer
    /// finds passed still runs while it is within the tolerance.
    pub fn with_skew_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Registers the metrics in `registry` (default: the process default registry).
    pub fn with_registry(mut self, registry: &Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Reports into already registered metrics.
    pub fn with_metrics(mut self, metrics: SchedulerMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Calls `hook` with every tick's outcome on this replica.
    ///
    /// Keep it quick; it runs on the task that fires every job, so a hook
    /// that blocks delays every job's firing. Hand slow work to a channel or
    /// a spawned task.
    pub fn with_on_outcome(mut self, hook: impl Fn(&RunReport) + Send + Sync + 'static) -> Self {
        self.on_outcome = Some(Arc::new(hook));
        self
    }

    /// Names this replica in the tick records it writes (who started a
    /// tick), for people reading the store. Default: a random id per
    /// scheduler.
    pub fn with_replica_id(mut self, id: impl Into<String>) -> Self {
        self.replica = Some(id.into());
        self
    }

    /// Test hook (feature `test-util`): awaits `hook` at each
    /// [`ProtocolPoint`](crate::ProtocolPoint) of every tick, so a test can
    /// freeze this replica there.
    #[cfg(feature = "test-util")]
    pub fn with_pause_hook(mut self, hook: crate::PauseHook) -> Self {
        self.pause = Some(hook);
        self
    }

    /// Builds the scheduler and starts it on the current tokio runtime, in
    /// one call: keep the returned [`Scheduler`] until its
    /// [`shutdown`](Scheduler::shutdown), since dropping it stops every job.
    ///
    /// # Errors
    ///
    /// As [`SchedulerBuilder::build`] and [`Scheduler::start`].
    ///
    /// # Examples
    ///
    /// A scheduler started and dropped in one statement would stop every job
    /// at once; the unused [`Scheduler`] is a `must_use` warning (here denied):
    ///
    /// ```compile_fail
    /// #![deny(unused_must_use)]
    /// # async fn demo(locker: lock_core::Locker, ticks: std::sync::Arc<dyn lock_core::TickStore>) -> scheduler::Result<()> {
    /// use scheduler::{Job, Scheduler};
    ///
    /// Scheduler::builder(locker, ticks)
    ///     .with_job(Job::new("reports/hourly", "0 0 * * * *", |_ctx| async { Ok(()) }))
    ///     .start()?;
    /// # Ok(()) }
    /// ```
    pub fn start(self) -> Result<Scheduler> {
        self.build()?.start()
    }

    /// Validates everything and builds the scheduler (not started yet: see
    /// [`SchedulerBuilder::start`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCron`], [`Error::InvalidTimeZone`] or
    /// [`Error::InvalidJob`] naming the job; [`Error::Config`] for a skew
    /// tolerance under 1 ms or over [`MAX_SKEW_TOLERANCE`], a zero election
    /// interval, a duplicate job name or no jobs; [`Error::Lock`] for a bad
    /// election lock; [`Error::Metrics`].
    pub fn build(self) -> Result<Scheduler> {
        if self.tolerance < MIN_SKEW_TOLERANCE {
            return Err(Error::Config(format!(
                "a skew tolerance of {:?} is below 1 ms; it is how long a finished tick stays marked, and ticks are named in whole milliseconds",
                self.tolerance
            )));
        }
        if self.tolerance > MAX_SKEW_TOLERANCE {
            return Err(Error::Config(format!(
                "a skew tolerance of {:?} is above the maximum of {MAX_SKEW_TOLERANCE:?}: every finished tick's lock is kept that long; fix clocks that far apart instead",
                self.tolerance
            )));
        }
        if self.jobs.is_empty() {
            return Err(Error::Config("add at least one job".into()));
        }
        if let Mode::Leader(e) = &self.mode {
            if e.interval.is_zero() {
                return Err(Error::Config(
                    "the election interval must be greater than zero".into(),
                ));
            }
            lock_core::LockName::new(&e.name)?;
            lock_core::LockOptions::new(e.ttl).validate_for(&self.limits())?;
        }
        let mut seen = HashSet::new();
        for job in &self.jobs {
            if !seen.insert(job.name()) {
                return Err(Error::Config(format!(
                    "two jobs are named {:?}; job names must be unique",
                    job.name()
                )));
            }
        }
        let metrics = match (&self.metrics, &self.registry) {
            (Some(m), _) => m.clone(),
            (None, Some(r)) => SchedulerMetrics::register(r)?,
            (None, None) => SchedulerMetrics::default_registry()?,
        };
        let limits = self.limits();
        let mut jobs = Vec::with_capacity(self.jobs.len());
        for job in self.jobs.iter().cloned() {
            jobs.push(Arc::new(job.compile(&limits, &metrics)?));
        }
        let soft_stop = CancellationToken::new();
        let runtime = Runtime {
            locker: self.locker,
            ticks: crate::batch::Ticks::new(self.ticks),
            clock: self.clock,
            metrics,
            tolerance: self.tolerance,
            tracker: TaskTracker::new(),
            hard_stop: CancellationToken::new(),
            soft_stop,
            start_gate: std::sync::Mutex::new(()),
            on_outcome: self.on_outcome,
            replica: self.replica.unwrap_or_else(|| {
                lock_core::OwnerToken::generate()
                    .map(|t| t.to_hex().chars().take(12).collect())
                    .unwrap_or_else(|_| "replica".to_owned())
            }),
            runs: std::sync::atomic::AtomicU64::new(0),
            #[cfg(feature = "test-util")]
            pause: self.pause,
        };
        Ok(Scheduler::new(Arc::new(runtime), jobs, self.mode))
    }

    /// The backend's TTL limits (none without a backend).
    fn limits(&self) -> lock_core::Capabilities {
        self.locker
            .capabilities()
            .cloned()
            .unwrap_or_else(|| lock_core::Capabilities::new(lock_core::backend::Expiry::Ttl))
    }
}
