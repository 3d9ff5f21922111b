//! Replicas of a scheduler over one backend, and what they ran.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use lock_core::TickStore;
use scheduler::{
    ElectionOptions, Job, Mode, RunReport, Scheduler, SchedulerMetrics, TickOutcome, TokioClock,
    WallClock,
};
use tokio::time::Instant;

use crate::faulty::FaultyBackend;
use crate::{Ctx, Replica};

/// How many ticks a case runs and how long they are.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    pub(crate) cron: &'static str,
    pub(crate) period: Duration,
    pub(crate) ticks: u32,
    /// How long a normal run works: short, so completion marks matter.
    pub(crate) work: Duration,
}

impl Plan {
    pub(crate) fn of(ctx: &Ctx) -> Self {
        if ctx.timing().paused_clock {
            Self {
                cron: "*/2 * * * * *",
                period: Duration::from_secs(2),
                ticks: 60,
                work: Duration::from_millis(1),
            }
        } else {
            Self {
                cron: "* * * * * *",
                period: Duration::from_secs(1),
                ticks: 10,
                work: Duration::from_millis(1),
            }
        }
    }
}

/// The election settings cases use: the profile's TTL, a quarter-TTL interval.
pub(crate) fn election(ctx: &Ctx) -> ElectionOptions {
    let ttl = ctx.timing().ttl;
    ElectionOptions::new()
        .with_name(ctx.name("leader").as_str())
        .with_ttl(ttl)
        .with_interval(ttl / 4)
}

/// The skew tolerance cases give schedulers: 5 s, or the TTL if longer.
pub(crate) fn tolerance(ctx: &Ctx) -> Duration {
    Duration::from_secs(5).max(ctx.timing().ttl)
}

/// One handler run, as the handler saw it.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) replica: usize,
    pub(crate) tick: DateTime<Utc>,
    pub(crate) started: Instant,
    /// When it returned; `None` if its future was dropped first.
    pub(crate) finished: Option<Instant>,
    /// When its future was dropped unfinished.
    pub(crate) dropped: Option<Instant>,
}

/// Every handler run of a case, in start order.
#[derive(Debug, Default)]
pub(crate) struct RunLog {
    runs: Mutex<Vec<Run>>,
    reports: Mutex<Vec<(usize, RunReport)>>,
}

impl RunLog {
    pub(crate) fn all(&self) -> Vec<Run> {
        self.runs.lock().expect("log").clone()
    }

    pub(crate) fn completed(&self) -> Vec<Run> {
        self.all()
            .into_iter()
            .filter(|r| r.finished.is_some())
            .collect()
    }

    pub(crate) fn reports(&self) -> Vec<(usize, RunReport)> {
        self.reports.lock().expect("log").clone()
    }

    fn start(&self, replica: usize, tick: DateTime<Utc>) -> usize {
        let mut runs = self.runs.lock().expect("log");
        runs.push(Run {
            replica,
            tick,
            started: Instant::now(),
            finished: None,
            dropped: None,
        });
        runs.len() - 1
    }

    fn end(&self, index: usize, finished: bool) {
        let mut runs = self.runs.lock().expect("log");
        let run = &mut runs[index];
        if finished {
            run.finished = Some(Instant::now());
        } else if run.finished.is_none() {
            run.dropped = Some(Instant::now());
        }
    }
}

/// Marks a run dropped if its future goes away before it finished.
struct RunGuard {
    log: Arc<RunLog>,
    index: usize,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.log.end(self.index, false);
    }
}

/// Replicas with their own `Locker`s, clocks and fault switches.
pub(crate) struct Fleet {
    pub(crate) replicas: Vec<Replica>,
    pub(crate) faults: Vec<FaultyBackend>,
    pub(crate) clocks: Vec<Arc<TokioClock>>,
    pub(crate) ticks: Arc<dyn TickStore>,
    pub(crate) log: Arc<RunLog>,
    pub(crate) metrics: Vec<SchedulerMetrics>,
    /// The TTL of every job's tick locks: the profile's TTL.
    job_ttl: Duration,
}

impl Fleet {
    /// One replica per skew (in ms), all clocks starting from the same instant.
    pub(crate) async fn new(ctx: &Ctx, skews_ms: &[i64]) -> Self {
        let base = Utc::now();
        let clocks: Vec<_> = skews_ms
            .iter()
            .map(|s| Arc::new(TokioClock::starting_at(base).with_skew_ms(*s)))
            .collect();
        let mut replicas = Vec::new();
        let mut faults = Vec::new();
        for _ in skews_ms {
            let backend = ctx.factory().replica().await.expect("replica connects");
            let faulty = FaultyBackend::new(backend, ctx.timing().ttl);
            replicas.push(ctx.replica_over(Arc::new(faulty.clone())));
            faults.push(faulty);
        }
        let ticks = ctx
            .factory()
            .tick_store()
            .await
            .expect("tick store connects")
            .expect("every backend the scheduler supports has a tick store");
        let metrics = skews_ms
            .iter()
            .map(|_| SchedulerMetrics::register(&prometheus::Registry::new()).expect("registry"))
            .collect();
        Self {
            replicas,
            faults,
            clocks,
            ticks,
            log: Arc::default(),
            metrics,
            job_ttl: ctx.timing().ttl,
        }
    }

    /// A job that logs every run on `replica` and works for `work`.
    pub(crate) fn recording_job(
        &self,
        name: &str,
        cron: &str,
        replica: usize,
        work: Duration,
    ) -> Job {
        self.recording_job_with(name, cron, replica, move || work)
    }

    /// A job that logs every run on `replica` and works for `work()` each time.
    pub(crate) fn recording_job_with(
        &self,
        name: &str,
        cron: &str,
        replica: usize,
        work: impl Fn() -> Duration + Send + Sync + 'static,
    ) -> Job {
        let log = Arc::clone(&self.log);
        Job::new(name, cron, move |ctx| {
            let log = Arc::clone(&log);
            let work = work();
            async move {
                let index = log.start(replica, ctx.scheduled_at());
                let _guard = RunGuard {
                    log: Arc::clone(&log),
                    index,
                };
                tokio::time::sleep(work).await;
                ctx.assert_held()?;
                log.end(index, true);
                Ok(())
            }
        })
        .with_ttl(self.job_ttl)
    }

    /// A scheduler for `replica` with `jobs`, not started.
    pub(crate) fn scheduler(
        &self,
        ctx: &Ctx,
        replica: usize,
        mode: Mode,
        jobs: Vec<Job>,
    ) -> Scheduler {
        let clock = self.clocks[replica].clone();
        self.scheduler_with_clock(ctx, replica, mode, jobs, clock)
    }

    /// As [`Fleet::scheduler`], reading the wall clock from `clock`.
    pub(crate) fn scheduler_with_clock(
        &self,
        ctx: &Ctx,
        replica: usize,
        mode: Mode,
        jobs: Vec<Job>,
        clock: Arc<dyn WallClock>,
    ) -> Scheduler {
        let log = Arc::clone(&self.log);
        let mut builder = Scheduler::builder(
            self.replicas[replica].locker.clone(),
            Arc::clone(&self.ticks),
        )
        .with_mode(mode)
        .with_clock(clock)
        .with_metrics(self.metrics[replica].clone())
        .with_skew_tolerance(tolerance(ctx))
        .with_on_outcome(move |report| {
            log.reports
                .lock()
                .expect("log")
                .push((replica, report.clone()))
        });
        for job in jobs {
            builder = builder.with_job(job);
        }
        builder.build().expect("valid scheduler")
    }

    /// Builds and starts one scheduler per replica, in order, each with the
    /// job `job(replica)`.
    pub(crate) async fn start_all(
        &self,
        ctx: &Ctx,
        mode: Mode,
        job: impl Fn(usize) -> Job,
    ) -> Vec<Scheduler> {
        let mut started = Vec::new();
        for replica in 0..self.replicas.len() {
            let s = self.scheduler(ctx, replica, mode.clone(), vec![job(replica)]);
            let s = s.start().expect("starts");
            if replica == 0 && matches!(mode, Mode::Leader(_)) {
                // Replica 0 leads before the others start, so leader cases know
                // who leads; yielding alone is not enough against a real server.
                let bound = ctx.timing().ttl * 4 + Duration::from_secs(1);
                tokio::time::timeout(bound, s.leadership().wait_for(|leading| *leading))
                    .await
                    .expect("replica 0 is elected while alone")
                    .expect("leadership channel open");
            }
            tokio::task::yield_now().await;
            started.push(s);
        }
        started
    }

    pub(crate) async fn shutdown_all(&self, schedulers: Vec<Scheduler>) {
        for s in schedulers {
            s.shutdown(Duration::from_secs(10))
                .await
                .expect("clean shutdown");
        }
    }

    /// The outcomes `replica` reported for `job`, in order.
    pub(crate) fn reports_of(&self, replica: usize, job: &str) -> Vec<RunReport> {
        self.log
            .reports()
            .into_iter()
            .filter(|(r, report)| *r == replica && report.job == job)
            .map(|(_, report)| report)
            .collect()
    }

    /// `scheduler_runs_total{job, outcome=success}` over all replicas.
    pub(crate) fn successes(&self, job: &str) -> u64 {
        self.metrics
            .iter()
            .map(|m| m.runs(job, TickOutcome::Success))
            .sum()
    }
}

/// Every tick from the first run to the last ran exactly once.
#[track_caller]
pub(crate) fn assert_each_tick_once(runs: &[Run], period: Duration) {
    let mut by_tick: BTreeMap<DateTime<Utc>, Vec<usize>> = BTreeMap::new();
    for r in runs {
        by_tick.entry(r.tick).or_default().push(r.replica);
    }
    let duplicates: Vec<_> = by_tick.iter().filter(|(_, rs)| rs.len() > 1).collect();
    assert!(
        duplicates.is_empty(),
        "ticks run more than once: {duplicates:?}"
    );
    let ticks: Vec<_> = by_tick.keys().copied().collect();
    for pair in ticks.windows(2) {
        let gap = (pair[1] - pair[0]).to_std().expect("ordered");
        assert_eq!(
            gap, period,
            "a tick between {} and {} never ran",
            pair[0], pair[1]
        );
    }
}

/// Sleeps until `clock` is `1/fraction` of a period past a tick of a
/// `period` grid aligned on the Unix epoch (as `*/N` second crons are).
pub(crate) async fn sleep_until_phase(clock: &TokioClock, period: Duration, fraction: u32) {
    let period_ms = i64::try_from(period.as_millis()).expect("small period");
    let target = period_ms / i64::from(fraction);
    let into = clock.now().timestamp_millis().rem_euclid(period_ms);
    let wait = (target - into).rem_euclid(period_ms);
    tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
}
