//! What the scheduler tests share: a locker on a registry of its own, a
//! tick store whose `Completed` writes fail or lose their replies on
//! demand, and a replica over it on tokio's paused clock.

// Each test binary that includes this module uses only part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::DateTime;
use lock_core::{
    async_trait, BackendError, BackendErrorKind, Error as LockError, LockBackend, LockName,
    LockOptions, Locker, StartCheck, StartVerdict, TickAnswer, TickRecord, TickStore, TickWrite,
};
use lock_memory::MemoryBackend;
use prometheus::Registry;
use scheduler::{Delivery, Job, RunReport, Scheduler, SchedulerMetrics, TickOutcome, TokioClock};

/// The first tick every replica fires, in Unix ms.
pub(crate) const TICK_MS: i64 = 1_800_000_000_000;

/// A locker on `backend` with a fresh registry, so one replica's lock
/// metrics never count another's.
pub(crate) fn locker(backend: impl LockBackend + 'static) -> Locker {
    Locker::builder()
        .with_backend(backend)
        .with_registry(&Registry::new())
        .build()
        .expect("locker")
}

/// What the tick store does with `Completed` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completes {
    /// Writes them.
    Land,
    /// Fails every one with a timeout, without writing it.
    Fail,
    /// Writes the first one but loses its reply (a timeout), as a server
    /// that applied a write and then went quiet would; writes the rest.
    LoseFirstReply,
}

/// The memory backend's tick store with its `Completed` writes changed as
/// [`Completes`] says, counting them. The tick store is the scheduler's
/// second argument, apart from the `Locker`'s backend, so it is wrapped
/// here rather than through `Intercepted`.
///
/// With `one_step`, it also says it makes a start's checks in the write's
/// own step, as Postgres does (its `start_checked_many` is the trait's
/// default over the memory store: the same checks), and counts the marks
/// the scheduler reads apart, which it then must not.
#[derive(Debug)]
pub(crate) struct FlakyCompletes {
    inner: MemoryBackend,
    completes: Mutex<Completes>,
    sent: AtomicUsize,
    one_step: bool,
    marks_read: AtomicUsize,
}

impl FlakyCompletes {
    pub(crate) fn new(inner: MemoryBackend, completes: Completes) -> Arc<Self> {
        Arc::new(Self {
            inner,
            completes: Mutex::new(completes),
            sent: AtomicUsize::new(0),
            one_step: false,
            marks_read: AtomicUsize::new(0),
        })
    }

    /// Over `inner`, landing every write, and checking starts in one step.
    pub(crate) fn one_step(inner: MemoryBackend) -> Arc<Self> {
        Arc::new(Self {
            inner,
            completes: Mutex::new(Completes::Land),
            sent: AtomicUsize::new(0),
            one_step: true,
            marks_read: AtomicUsize::new(0),
        })
    }

    /// The marks read through `is_completed` so far.
    pub(crate) fn marks_read(&self) -> usize {
        self.marks_read.load(Ordering::SeqCst)
    }

    pub(crate) fn set(&self, completes: Completes) {
        *self.completes.lock().expect("mode") = completes;
    }

    pub(crate) fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }
}

fn timeout() -> BackendError {
    BackendError::new(
        BackendErrorKind::Timeout,
        "injected: no answer within the operation timeout",
    )
}

#[async_trait]
impl TickStore for FlakyCompletes {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.inner.last_completed(job).await
    }
    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.inner.record_completed(job, tick, keep).await
    }
    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        self.marks_read.fetch_add(1, Ordering::SeqCst);
        self.inner.is_completed(job, tick).await
    }
    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        self.inner.server_time().await
    }
    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        if matches!(write, TickWrite::Complete { .. }) {
            let n = self.sent.fetch_add(1, Ordering::SeqCst);
            let mode = *self.completes.lock().expect("mode");
            match mode {
                Completes::Fail => return Err(timeout()),
                Completes::LoseFirstReply if n == 0 => {
                    self.inner.write_tick(job, tick, write, keep).await?;
                    return Err(timeout());
                }
                _ => {}
            }
        }
        self.inner.write_tick(job, tick, write, keep).await
    }
    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        self.inner.tick_record(job, tick).await
    }
    fn checks_starts_in_one_step(&self) -> bool {
        self.one_step
    }
    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        self.inner.start_checked_many(starts, keep).await
    }
}

/// What the job's handler does after logging its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handler {
    /// Returns `Ok`.
    Returns,
    /// Panics.
    Panics,
}

/// One replica over `memory` and `store`, its clock `skew_ms` off, with one
/// job that fires at second 0 of each minute (the first tick 100 ms after
/// the start), logs its handler calls' tokens and then does as `handler`
/// says.
pub(crate) fn replica(
    memory: &MemoryBackend,
    store: &Arc<FlakyCompletes>,
    skew_ms: i64,
    delivery: Delivery,
    calls: &Arc<Mutex<Vec<u64>>>,
    reports: &Arc<Mutex<Vec<RunReport>>>,
    handler: Handler,
) -> (Scheduler, SchedulerMetrics) {
    let locker = locker(memory.clone());
    let base = DateTime::from_timestamp(1_799_999_999, 900_000_000).expect("valid");
    let metrics = SchedulerMetrics::register(&Registry::new()).expect("registry");
    let (log, seen) = (Arc::clone(calls), Arc::clone(reports));
    let store: Arc<dyn TickStore> = Arc::clone(store) as Arc<dyn TickStore>;
    let s = Scheduler::builder(locker, store)
        .with_metrics(metrics.clone())
        .with_clock(Arc::new(
            TokioClock::starting_at(base).with_skew_ms(skew_ms),
        ))
        .with_skew_tolerance(Duration::from_secs(2))
        .with_on_outcome(move |r| seen.lock().expect("log").push(r.clone()))
        .with_job(
            Job::new("recorded", "0 * * * * *", move |ctx| {
                let log = Arc::clone(&log);
                async move {
                    log.lock()
                        .expect("log")
                        .push(ctx.fencing_token().unwrap_or(0));
                    if handler == Handler::Panics {
                        panic!("deliberate panic in a job handler");
                    }
                    Ok(())
                }
            })
            .with_ttl(Duration::from_secs(3))
            .with_delivery(delivery),
        )
        .start()
        .expect("starts");
    (s, metrics)
}

/// One replica on a fresh memory backend, over a tick store whose
/// `Completed` writes do as `completes` says, and what a test reads of it.
pub(crate) struct Solo {
    pub(crate) memory: MemoryBackend,
    pub(crate) store: Arc<FlakyCompletes>,
    pub(crate) calls: Arc<Mutex<Vec<u64>>>,
    pub(crate) reports: Arc<Mutex<Vec<RunReport>>>,
    pub(crate) scheduler: Scheduler,
    pub(crate) metrics: SchedulerMetrics,
}

impl Solo {
    /// Started, on the true clock, its job at most once.
    pub(crate) fn start(completes: Completes, handler: Handler) -> Self {
        let memory = MemoryBackend::new();
        let store = FlakyCompletes::new(memory.clone(), completes);
        let calls: Arc<Mutex<Vec<u64>>> = Arc::default();
        let reports: Arc<Mutex<Vec<RunReport>>> = Arc::default();
        let (scheduler, metrics) = replica(
            &memory,
            &store,
            0,
            Delivery::AtMostOnce,
            &calls,
            &reports,
            handler,
        );
        Self {
            memory,
            store,
            calls,
            reports,
            scheduler,
            metrics,
        }
    }

    /// The outcomes reported so far, in order.
    pub(crate) fn outcomes(&self) -> Vec<TickOutcome> {
        outcomes(&self.reports)
    }

    /// The record of the first tick.
    pub(crate) async fn record(&self) -> Option<TickRecord> {
        first_record(&self.memory).await
    }

    /// Shuts the replica down, cleanly within a second.
    pub(crate) async fn shutdown(self) {
        self.scheduler
            .shutdown(Duration::from_secs(1))
            .await
            .expect("clean");
    }
}

/// The record of the first tick in `memory`.
pub(crate) async fn first_record(memory: &MemoryBackend) -> Option<TickRecord> {
    let job = LockName::new("recorded").expect("valid");
    memory.tick_record(&job, TICK_MS).await.expect("memory")
}

/// The outcomes in `reports`, in order.
pub(crate) fn outcomes(reports: &Mutex<Vec<RunReport>>) -> Vec<TickOutcome> {
    reports
        .lock()
        .expect("log")
        .iter()
        .map(|r| r.outcome)
        .collect()
}

/// Whether another locker over `memory` finds the first tick's lock held
/// (one it gets is released again).
pub(crate) async fn tick_lock_held(memory: &MemoryBackend) -> bool {
    let other = locker(memory.clone());
    let name = LockName::new(format!("recorded/{TICK_MS}")).expect("valid");
    match other
        .try_lock(&name, &LockOptions::new(Duration::from_secs(1)))
        .await
    {
        Ok(guard) => {
            guard.release().await.expect("release");
            false
        }
        Err(LockError::HeldElsewhere { .. }) => true,
        Err(e) => panic!("unexpected: {e}"),
    }
}
