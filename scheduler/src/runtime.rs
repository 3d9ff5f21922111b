//! What every task of one running scheduler shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lock_core::{Locker, TickStore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::{SchedulerMetrics, TickOutcome, WallClock};

/// What happened to one tick on this replica, as passed to
/// [`SchedulerBuilder::on_outcome`](crate::SchedulerBuilder::on_outcome).
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
    pub(crate) ticks: Arc<dyn TickStore>,
    pub(crate) clock: Arc<dyn WallClock>,
    pub(crate) metrics: SchedulerMetrics,
    pub(crate) tolerance: Duration,
    pub(crate) tracker: TaskTracker,
    /// Cancelled at shutdown: handlers are asked to stop.
    pub(crate) soft_stop: CancellationToken,
    /// Cancelled at the shutdown deadline (or on drop): handlers are dropped.
    pub(crate) hard_stop: CancellationToken,
    pub(crate) on_outcome: Option<OutcomeHook>,
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
    pub(crate) fn report(&self, report: RunReport) {
        self.metrics.run(&report.job, report.outcome);
        if let Some(hook) = &self.on_outcome {
            hook(&report);
        }
    }
}

/// The current tokio runtime, or a clear error outside one.
pub(crate) fn current() -> crate::Result<tokio::runtime::Handle> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        crate::Error::Config("call this from within a tokio runtime (it spawns tasks)".into())
    })
}
