use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    AcquireOutcome, Error, LockMetrics, LockName, LockOptions, Locker, LossReason, RunOutcome,
    SkipReason,
};
use prometheus::Registry;
use tokio::time::{sleep, Instant};

use super::assert_between;
use crate::faulty::{Fault, FaultyBackend};
use crate::Ctx;

/// Runs, through `locker`, a job that only notes it was entered: returns
/// the run's outcome and whether the job was entered (the cases below
/// check that a refused run never enters it).
async fn run_noting_entry(
    locker: &Locker,
    name: &LockName,
    opts: &LockOptions,
) -> (RunOutcome<()>, bool) {
    let entered = AtomicBool::new(false);
    let outcome = locker
        .with_lock(name, opts, |_| async {
            entered.store(true, Ordering::SeqCst)
        })
        .await
        .expect("valid input");
    (outcome, entered.load(Ordering::SeqCst))
}

/// A name held through a `Locker` is denied locally to its clones, without
/// any backend call.
pub(super) async fn in_process_guard(ctx: Ctx) {
    let (faulty, a) = super::faulty_replica(&ctx, Duration::ZERO).await;
    let name = ctx.name("local");
    let guard = a
        .locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("free lock");
    let calls = faulty.calls();
    let clone = a.locker.clone();
    assert!(matches!(
        clone.try_lock(&name, &ctx.opts()).await,
        Err(Error::HeldLocally { .. })
    ));
    let (outcome, ran) = run_noting_entry(&clone, &name, &ctx.opts()).await;
    assert!(matches!(
        outcome,
        RunOutcome::Skipped(SkipReason::HeldLocally)
    ));
    assert!(!ran, "an overlapping run was entered");
    assert_eq!(faulty.calls(), calls, "a local denial reached the backend");
    assert_eq!(
        a.metrics
            .acquisitions(name.as_str(), AcquireOutcome::HeldLocally),
        2
    );
    guard.release().await.expect("release");
    clone
        .try_lock(&name, &ctx.opts())
        .await
        .expect("free after release")
        .release()
        .await
        .expect("release");
}

/// Without a backend, jobs run behind the in-process guard and count
/// `unlocked`; with `lock_required`, they are refused.
pub(super) async fn unlocked_mode(ctx: Ctx) {
    let metrics = LockMetrics::register(&Registry::new()).expect("registry");
    let locker = Locker::builder()
        .with_metrics(metrics.clone())
        .build()
        .expect("builds");
    let name = ctx.name("unlocked");
    let outcome = locker
        .with_lock(&name, &ctx.opts(), |lease| async move {
            assert!(lease.is_unlocked());
            lease.assert_held().expect("an unlocked run is never lost");
            let overlapping = lease.name().clone();
            (overlapping, 7)
        })
        .await
        .expect("valid input");
    assert!(matches!(outcome, RunOutcome::Completed((_, 7))));
    assert_eq!(
        metrics.acquisitions(name.as_str(), AcquireOutcome::Unlocked),
        1
    );
    let held = locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("unlocked guard");
    assert!(matches!(
        locker.try_lock(&name, &ctx.opts()).await,
        Err(Error::HeldLocally { .. })
    ));
    held.release().await.expect("release");

    let strict = Locker::builder()
        .with_metrics(metrics.clone())
        .with_lock_required(true)
        .build()
        .expect("builds");
    let (outcome, ran) = run_noting_entry(&strict, &name, &ctx.opts()).await;
    assert!(matches!(
        outcome,
        RunOutcome::Skipped(SkipReason::LockRequired)
    ));
    assert!(!ran);
    assert_eq!(
        metrics.acquisitions(name.as_str(), AcquireOutcome::Unavailable),
        1
    );
}

/// A backend that refuses every call: the job is never entered (fail closed)
/// and the attempt counts as `unavailable`.
pub(super) async fn fail_closed_when_backend_down(ctx: Ctx) {
    let faulty = FaultyBackend::new(
        ctx.factory().replica().await.expect("replica"),
        Duration::ZERO,
    );
    faulty.set(Fault::Down);
    let a = ctx.replica_over(Arc::new(faulty));
    let name = ctx.name("down");
    let mut entered = false;
    for _ in 0..10 {
        let (outcome, ran) = run_noting_entry(&a.locker, &name, &ctx.opts()).await;
        entered |= ran;
        assert!(
            matches!(outcome, RunOutcome::Skipped(SkipReason::Unavailable(_))),
            "{outcome:?}"
        );
    }
    assert!(!entered, "a job ran without a lock");
    assert_eq!(
        a.metrics
            .acquisitions(name.as_str(), AcquireOutcome::Unavailable),
        10
    );
    let timed = ctx.opts().with_acquire_timeout(ctx.timing().ttl);
    assert!(matches!(
        a.locker.lock(&name, &timed).await,
        Err(Error::Unavailable { .. })
    ));
}

/// A real client pointed at a closed port: the acquire fails promptly as
/// `unavailable` and the job does not run.
pub(super) async fn fail_closed_when_server_unreachable(ctx: Ctx) {
    let Some(backend) = ctx.factory().unreachable().await else {
        // No server behind this backend: nothing can be unreachable.
        return;
    };
    let a = ctx.replica_over(backend);
    let name = ctx.name("unreachable");
    let started = Instant::now();
    let (outcome, entered) = run_noting_entry(&a.locker, &name, &ctx.opts()).await;
    assert!(
        matches!(outcome, RunOutcome::Skipped(SkipReason::Unavailable(_))),
        "{outcome:?}"
    );
    assert!(!entered);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}

/// The backend goes down while a job runs: the job is aborted with
/// `backend_error` no later than its local deadline.
pub(super) async fn backend_failure_mid_job_aborts_before_deadline(ctx: Ctx) {
    let timing = ctx.timing();
    let (faulty, a) = super::faulty_replica(&ctx, Duration::ZERO).await;
    let name = ctx.name("mid-job");
    let opts = ctx.opts();
    let started = Instant::now();
    // Guard log: the instant just before each check that allowed a write.
    let writes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&writes);
    let f = faulty.clone();
    let pause = opts.ttl() / 50;
    let job_start = Arc::new(std::sync::Mutex::new(None));
    let js = Arc::clone(&job_start);
    let outcome = a
        .locker
        .with_lock(&name, &opts, |lease| async move {
            *js.lock().expect("lock") = Some(Instant::now());
            f.set(Fault::Down);
            loop {
                let checked_at = Instant::now();
                if lease.assert_held().is_ok() {
                    log.lock().expect("lock").push(checked_at);
                }
                sleep(pause).await;
            }
        })
        .await
        .expect("valid input");
    match outcome {
        RunOutcome::Aborted(LossReason::BackendError) => {}
        other => panic!("expected Aborted(backend_error), got {other:?}"),
    }
    let opts = ctx.opts();
    assert_between(
        "abort after the backend went down",
        started.elapsed(),
        opts.ttl() - opts.drift() - timing.tolerance,
        opts.ttl() - opts.drift() + timing.tolerance,
    );
    // The acquire request left before the job started, so its deadline is no later than this.
    let start = job_start.lock().expect("lock").expect("job ran");
    let deadline = start + opts.ttl() - opts.drift();
    let writes = writes.lock().expect("lock");
    assert!(!writes.is_empty());
    assert_eq!(
        writes.iter().filter(|w| **w >= deadline).count(),
        0,
        "guarded writes after the local deadline"
    );
    faulty.set(Fault::None);
}

/// A guard dropped after its runtime is gone neither blocks nor panics, and
/// the lock still ends (by TTL, or with the session that held it).
pub(super) fn guard_dropped_outside_runtime(ctx: Ctx) {
    let timing = ctx.timing();
    let runtime = |paused: bool| {
        let mut b = tokio::runtime::Builder::new_current_thread();
        b.enable_all().start_paused(paused);
        b.build().expect("runtime")
    };
    let name = ctx.name("orphan");
    let first = runtime(timing.paused_clock);
    let guard = first.block_on(async {
        let a = ctx.replica().await;
        a.locker
            .try_lock(&name, &ctx.opts())
            .await
            .expect("free lock")
    });
    drop(first);
    drop(guard);
    let second = runtime(timing.paused_clock);
    second.block_on(async {
        let b = ctx.replica().await;
        let opts = ctx
            .opts()
            .with_acquire_timeout(timing.ttl * 2 + timing.tolerance);
        let started = Instant::now();
        let g = b
            .locker
            .lock(&name, &opts)
            .await
            .expect("the orphaned lock ends");
        assert!(started.elapsed() <= timing.ttl + timing.ttl / 8 + timing.tolerance);
        g.release().await.expect("release");
    });
}
