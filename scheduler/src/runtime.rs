//! What every task of one running scheduler shares.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use lock_core::Locker;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::batch::Ticks;
use crate::job::JobSpec;
use crate::per_tick::Tick;
use crate::{SchedulerMetrics, TickOutcome, WallClock};

/// What happened to one tick on this replica, as passed to
/// [`SchedulerBuilder::with_on_outcome`](crate::SchedulerBuilder::with_on_outcome).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// The job.
    pub job: String,
    /// The tick's scheduled instant.
    pub scheduled: DateTime<Utc>,
    /// How it ended here.
    pub outcome: TickOutcome,
    /// Whether it was a missed tick being caught up.
    pub catch_up: bool,
}

pub(crate) type OutcomeHook = Arc<dyn Fn(&RunReport) + Send + Sync + 'static>;

pub(crate) struct Runtime {
    pub(crate) locker: Locker,
    /// The tick store, with the calls of concurrent ticks batched.
    pub(crate) ticks: Ticks,
    pub(crate) clock: Arc<dyn WallClock>,
    pub(crate) metrics: SchedulerMetrics,
    pub(crate) tolerance: Duration,
    pub(crate) tracker: TaskTracker,
    /// Cancelled at shutdown: handlers are asked to stop, and no run starts
    /// any more. Cancel it through [`Runtime::stop_starting`] only.
    pub(crate) soft_stop: CancellationToken,
    /// Held while a run is started and while `soft_stop` is cancelled, so
    /// that a run either starts before shutdown begins or not at all.
    pub(crate) start_gate: Mutex<()>,
    /// Cancelled at the shutdown deadline (or on drop): handlers are dropped.
    pub(crate) hard_stop: CancellationToken,
    pub(crate) on_outcome: Option<OutcomeHook>,
    /// Who this replica is, in the tick records it writes.
    pub(crate) replica: String,
    /// Numbers this replica's runs, so that without fencing tokens each
    /// run's `Started` record is told apart from another run's of the same
    /// replica.
    pub(crate) runs: std::sync::atomic::AtomicU64,
    #[cfg(feature = "test-util")]
    pub(crate) pause: Option<crate::PauseHook>,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("clock", &self.clock)
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl Runtime {
    /// Spawns a run's handler on the tracker, unless shutdown has begun.
    pub(crate) fn start_run<F>(&self, run: F) -> Option<JoinHandle<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let _gate = self
            .start_gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (!self.soft_stop.is_cancelled()).then(|| self.tracker.spawn(run))
    }

    /// Begins shutdown: from the moment this returns no run starts, and
    /// running handlers are asked to stop.
    pub(crate) fn stop_starting(&self) {
        let _gate = self
            .start_gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.soft_stop.cancel();
    }

    /// Whether shutdown has begun.
    pub(crate) fn is_stopping(&self) -> bool {
        self.soft_stop.is_cancelled()
    }

    /// Counts how `tick` of `job` ended here, and tells the outcome hook
    /// (the report is built only when there is one).
    pub(crate) fn report(&self, job: &JobSpec, tick: Tick, outcome: TickOutcome) {
        job.metrics.run(outcome);
        *job.last_run.lock().unwrap_or_else(PoisonError::into_inner) = Some((tick.at, outcome));
        if let Some(hook) = &self.on_outcome {
            hook(&RunReport {
                job: job.label().to_owned(),
                scheduled: tick.at,
                outcome,
                catch_up: tick.catch_up,
            });
        }
    }
}

/// The current tokio runtime, or a clear error outside one.
pub(crate) fn current() -> crate::Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        crate::Error::Config("call this from within a tokio runtime (it spawns tasks)".into())
    })
}
