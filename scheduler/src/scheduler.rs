//! A running scheduler: start, leadership, shutdown.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{LeaseHandle, Locker, TickStore};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::driver::drive;
use crate::job::JobSpec;
use crate::runtime::{current, Runtime};
use crate::{Error, LeaderElection, Mode, Result, SchedulerBuilder, SchedulerMetrics};

/// The most [`Scheduler::shutdown`] waits past its deadline: for aborted
/// runs to stop and release their tick locks, and for the leadership to be
/// released (a backend round trip each, normally milliseconds).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Runs cron jobs so that each tick runs once across replicas.
///
/// Build and start it with [`Scheduler::builder`] and
/// [`SchedulerBuilder::start`], keep it, and end it with
/// [`shutdown`](Scheduler::shutdown). Dropping it without a
/// shutdown stops every task at once and releases locks in the background.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> scheduler::Result<()> {
/// use std::time::Duration;
/// use scheduler::{Job, Mode, ElectionOptions, Scheduler};
///
/// let backend = scheduler::connect("memory://").await?;
/// let locker = backend.locker(&prometheus::Registry::new())?;
/// let scheduler = Scheduler::builder(locker, backend.tick_store())
///     .with_mode(Mode::Leader(ElectionOptions::new()))
///     .with_registry(&prometheus::Registry::new())
///     .with_job(Job::new("reports/hourly", "0 0 * * * *", |ctx| async move {
///         ctx.assert_held()?;
///         Ok(())
///     }))
///     .start()?;
/// scheduler.shutdown(Duration::from_secs(10)).await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping a Scheduler stops every job at once; keep it and end it with `shutdown`"]
pub struct Scheduler {
    pub(crate) rt: Arc<Runtime>,
    pub(crate) jobs: Vec<Arc<JobSpec>>,
    pub(crate) mode: Mode,
    root: CancellationToken,
    started: Mutex<bool>,
    election: Mutex<Option<Arc<LeaderElection>>>,
    leading: watch::Sender<bool>,
}

impl Scheduler {
    /// Starts building a scheduler over `locker`, recording completed ticks
    /// in `ticks` (which must live on the same server as the locks).
    pub fn builder(locker: Locker, ticks: Arc<dyn TickStore>) -> SchedulerBuilder {
        SchedulerBuilder::new(locker, ticks)
    }

    pub(crate) fn new(rt: Arc<Runtime>, jobs: Vec<Arc<JobSpec>>, mode: Mode) -> Self {
        Self {
            rt,
            jobs,
            mode,
            root: CancellationToken::new(),
            started: Mutex::new(false),
            election: Mutex::new(None),
            leading: watch::channel(false).0,
        }
    }

    /// Starts firing jobs (per-tick mode) or campaigning for leadership
    /// (leader mode), on the current tokio runtime, and hands the running
    /// scheduler back: keep it until [`shutdown`](Scheduler::shutdown), since
    /// dropping it stops every job. [`SchedulerBuilder::start`] builds and
    /// starts in one call.
    ///
    /// # Errors
    ///
    /// [`Error::AlreadyStarted`] on a second call; [`Error::Config`] outside
    /// a tokio runtime; [`Error::Lock`] if the election cannot start. The
    /// scheduler is dropped with the error, stopping anything it began.
    pub fn start(self) -> Result<Self> {
        self.start_tasks()?;
        Ok(self)
    }

    fn start_tasks(&self) -> Result<()> {
        let handle = current()?;
        let mut started = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        if *started {
            return Err(Error::AlreadyStarted);
        }
        let _enter = handle.enter();
        match &self.mode {
            Mode::PerTick => {
                let rt = Arc::clone(&self.rt);
                self.rt
                    .tracker
                    .spawn(drive(rt, self.jobs.clone(), self.root.child_token(), None));
            }
            Mode::Leader(opts) => {
                let election = LeaderElection::builder(self.rt.locker.clone(), opts.name.clone())
                    .with_ttl(opts.ttl)
                    .with_interval(opts.interval)
                    .with_metrics(self.rt.metrics.clone())
                    .start()?;
                let election = Arc::new(election);
                *self.election.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Arc::clone(&election));
                let supervisor = Supervisor {
                    rt: Arc::clone(&self.rt),
                    jobs: self.jobs.clone(),
                    root: self.root.clone(),
                    leading: self.leading.clone(),
                };
                self.rt.tracker.spawn(supervisor.run(election));
            }
        }
        *started = true;
        info!(jobs = self.jobs.len(), mode = ?self.mode, "scheduler started");
        Ok(())
    }

    /// Whether this replica leads (always `false` in per-tick mode).
    pub fn is_leader(&self) -> bool {
        self.election
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|e| e.is_leader())
    }

    /// A receiver that turns `true` while this replica's jobs fire as leader.
    pub fn leadership(&self) -> watch::Receiver<bool> {
        self.leading.subscribe()
    }

    /// The metrics this scheduler reports into.
    pub fn metrics(&self) -> &SchedulerMetrics {
        &self.rt.metrics
    }

    /// Stops gracefully: stops firing, asks running handlers to stop (their
    /// [`JobContext::cancellation_token`](crate::JobContext::cancellation_token)),
    /// waits up to `deadline`, aborts what is left, and releases every lock
    /// it holds: tick locks of unfinished runs and the leadership. Completion
    /// marks of finished ticks are kept until they end by themselves, so no
    /// other replica runs those ticks again.
    ///
    /// No run starts once `shutdown` has been called: ticks not yet started
    /// (the rest of a catch-up batch, a catch-up waiting for its lock) are
    /// reported [`Skipped`](crate::TickOutcome::Skipped) at once. It returns
    /// by `deadline` plus [`SHUTDOWN_GRACE`], the most it then waits for
    /// aborted runs and the leadership to be released; whatever is still
    /// releasing after that finishes in the background. `Duration::MAX`
    /// waits for running handlers without limit.
    ///
    /// # Errors
    ///
    /// [`Error::ShutdownTimedOut`] if runs had to be aborted at the deadline
    /// (everything is stopped and released all the same).
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, everything is still cancelled; aborted runs
    /// then release their locks in the background.
    pub async fn shutdown(self, deadline: Duration) -> Result<()> {
        let stopper = HardStopOnDrop(self.rt.hard_stop.clone());
        self.root.cancel();
        self.rt.stop_starting();
        self.rt.tracker.close();
        let timed_out = tokio::time::timeout(deadline, self.rt.tracker.wait())
            .await
            .is_err();
        let still_running = self
            .jobs
            .iter()
            .filter(|j| crate::overlap::is_busy(j))
            .count();
        let grace_ends = Instant::now().checked_add(SHUTDOWN_GRACE);
        if timed_out {
            warn!(
                still_running,
                ?deadline,
                "shutdown deadline passed; aborting runs"
            );
            self.rt.hard_stop.cancel();
            if !finishes_by(grace_ends, self.rt.tracker.wait()).await {
                warn!(grace = ?SHUTDOWN_GRACE, "aborted runs are still releasing their locks; they finish in the background");
            }
        }
        let election = self
            .election
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(election) = election {
            if !finishes_by(grace_ends, election.stop()).await {
                warn!(grace = ?SHUTDOWN_GRACE, "the leadership is still being released; it finishes in the background");
            }
        }
        drop(stopper);
        info!("scheduler stopped");
        if timed_out && still_running > 0 {
            return Err(Error::ShutdownTimedOut {
                deadline,
                still_running,
            });
        }
        Ok(())
    }
}

/// Whether `work` finished by `until` (always, without a bound); dropped
/// unfinished otherwise.
async fn finishes_by(until: Option<Instant>, work: impl Future<Output = ()>) -> bool {
    match until {
        Some(until) => tokio::time::timeout_at(until, work).await.is_ok(),
        None => {
            work.await;
            true
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.root.cancel();
        self.rt.stop_starting();
        self.rt.hard_stop.cancel();
    }
}

struct HardStopOnDrop(CancellationToken);

impl Drop for HardStopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// In leader mode: starts the job loops on election, stops them on demotion.
struct Supervisor {
    rt: Arc<Runtime>,
    jobs: Vec<Arc<JobSpec>>,
    root: CancellationToken,
    leading: watch::Sender<bool>,
}

impl Supervisor {
    async fn run(self, election: Arc<LeaderElection>) {
        let mut rx = election.subscribe();
        loop {
            let lease = tokio::select! {
                _ = self.root.cancelled() => return,
                lease = elected(&election, &mut rx) => match lease {
                    Some(l) => l,
                    None => return,
                },
            };
            let term = self.root.child_token();
            self.rt.tracker.spawn(drive(
                Arc::clone(&self.rt),
                self.jobs.clone(),
                term.clone(),
                Some(lease.clone()),
            ));
            self.leading.send_replace(true);
            tokio::select! {
                _ = self.root.cancelled() => {}
                _ = lease.lost() => {}
                _ = demoted(&mut rx) => {}
            }
            term.cancel();
            self.leading.send_replace(false);
            if self.root.is_cancelled() {
                return;
            }
        }
    }
}

/// Waits until the election reports this replica as leader, with its lease.
async fn elected(election: &LeaderElection, rx: &mut watch::Receiver<bool>) -> Option<LeaseHandle> {
    loop {
        if *rx.borrow_and_update() {
            if let Some(lease) = election.lease().filter(|l| l.is_held()) {
                return Some(lease);
            }
        }
        rx.changed().await.ok()?;
    }
}

async fn demoted(rx: &mut watch::Receiver<bool>) {
    loop {
        if !*rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
