//! One replica's own behaviour: overlap, panics, shutdown.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use lock_core::{Error as LockError, LockName};
use scheduler::{Error, Job, Mode, TickOutcome};
use tokio::time::sleep;

use super::fleet::{self, sleep_until_phase, Fleet, Plan};
use crate::observe::OverlapObserver;
use crate::Ctx;

/// The tick lock `<job>/<tick ms>` of a reported tick.
fn tick_lock(job: &str, tick: chrono::DateTime<chrono::Utc>) -> LockName {
    LockName::new(format!("{job}/{}", tick.timestamp_millis())).expect("valid")
}

/// Runs that outlast two periods: a tick arriving meanwhile never runs
/// alongside one; the newest waits and runs when it ends, still within the
/// skew tolerance, and the tick it replaced is skipped and counted.
pub(crate) async fn scheduler_overlapping_tick_is_skipped(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0]).await;
    let name = ctx.name("slow");
    let observer = Arc::new(OverlapObserver::default());
    let obs = Arc::clone(&observer);
    let long = plan.period * 9 / 4;
    let job = Job::new(name.as_str(), plan.cron, move |_ctx| {
        let obs = Arc::clone(&obs);
        async move {
            obs.enter();
            sleep(long).await;
            obs.exit();
            Ok(())
        }
    })
    // The profile's TTL: backends may cap it (Postgres's max_ttl).
    .with_ttl(ctx.timing().ttl);
    sleep_until_phase(fleet.clocks[0].as_ref(), plan.period, 4).await;
    let s = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job]);
    let s = s.start().expect("starts");
    // Ticks at 0.75, 1.75, ..., 5.75 periods; runs of 2.25 periods. The
    // 1st runs until 3.0, the 3rd replaces the 2nd and runs until 5.25, the
    // 5th replaces the 4th and runs until 7.5, the 6th waits for it and is
    // skipped by the shutdown.
    sleep(plan.period * 6).await;
    let metrics = s.metrics().clone();
    s.shutdown(plan.period * 2)
        .await
        .expect("the run finishes in time");
    assert_eq!(observer.overlaps(), 0, "two runs of the job overlapped");
    assert_eq!(observer.sections(), 3);
    assert_eq!(metrics.runs(name.as_str(), TickOutcome::Success), 3);
    assert_eq!(metrics.runs(name.as_str(), TickOutcome::Skipped), 3);
}

/// A panicking handler is caught and counted `panicked`, and its tick lock
/// is free at once; a handler returning an error counts as `failure` and
/// keeps its completion mark like a success; later ticks still run.
pub(crate) async fn scheduler_panic_is_caught_and_lock_released(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0, 0]).await;
    let name = ctx.name("panics");
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&calls);
    let job = Job::new(name.as_str(), plan.cron, move |_ctx| {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        async move {
            match n % 4 {
                1 => Err("deliberate failure".into()),
                2 => Ok(()),
                _ => panic!("deliberate panic in a job handler"),
            }
        }
    })
    // The profile's TTL: backends may cap it (Postgres's max_ttl).
    .with_ttl(ctx.timing().ttl);
    sleep_until_phase(fleet.clocks[0].as_ref(), plan.period, 4).await;
    let s = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job]);
    let s = s.start().expect("starts");
    sleep(plan.period * 4).await;
    let metrics = s.metrics().clone();
    s.shutdown(plan.period).await.expect("clean shutdown");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(metrics.runs(name.as_str(), TickOutcome::Panicked), 2);
    assert_eq!(metrics.runs(name.as_str(), TickOutcome::Failure), 1);
    assert_eq!(metrics.runs(name.as_str(), TickOutcome::Success), 1);
    let other = &fleet.replicas[1];
    for report in fleet.reports_of(0, name.as_str()) {
        let lock = tick_lock(name.as_str(), report.scheduled);
        let opts = ctx.opts();
        let got = other.locker.try_lock(&lock, &opts).await;
        match report.outcome {
            TickOutcome::Panicked => {
                got.expect("a panicked tick's lock is free")
                    .release()
                    .await
                    .expect("release");
            }
            TickOutcome::Success | TickOutcome::Failure => assert!(
                matches!(got, Err(LockError::HeldElsewhere { .. })),
                "a finished tick keeps its completion mark"
            ),
            other => panic!("unexpected outcome {other}"),
        }
    }
    assert_eq!(fleet.replicas[0].metrics.held(name.as_str()), 0);
}

/// Shutdown stops a leader whose run ignores cancellation: the run is
/// aborted at the deadline, the error says so, and every lock it held (the
/// tick's and the leadership) is free for another replica at once.
pub(crate) async fn scheduler_shutdown_releases_every_lock(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0, 0]).await;
    let name = ctx.name("stubborn");
    let started = Arc::new(tokio::sync::Notify::new());
    let notify = Arc::clone(&started);
    let job = Job::new(name.as_str(), plan.cron, move |_ctx| {
        let notify = Arc::clone(&notify);
        async move {
            notify.notify_one();
            std::future::pending::<()>().await;
            Ok(())
        }
    })
    // The profile's TTL: backends may cap it (Postgres's max_ttl).
    .with_ttl(ctx.timing().ttl);
    let election = fleet::election(&ctx);
    let leader_lock = LockName::new(ctx.name("leader").as_str()).expect("valid");
    let s = fleet.scheduler(&ctx, 0, Mode::Leader(election), vec![job]);
    let s = s.start().expect("starts");
    started.notified().await;
    let scheduled = fleet.reports_of(0, name.as_str());
    assert!(scheduled.is_empty(), "no run has ended yet: {scheduled:?}");
    assert!(s.is_leader());
    let deadline = plan.period / 2;
    match s.shutdown(deadline).await {
        Err(Error::ShutdownTimedOut { still_running, .. }) => assert_eq!(still_running, 1),
        other => panic!("expected ShutdownTimedOut, got {other:?}"),
    }
    let reports = fleet.reports_of(0, name.as_str());
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].outcome, TickOutcome::Aborted);
    let other = &fleet.replicas[1];
    let opts = ctx.opts();
    for lock in [leader_lock, tick_lock(name.as_str(), reports[0].scheduled)] {
        other
            .locker
            .try_lock(&lock, &opts)
            .await
            .unwrap_or_else(|e| panic!("{lock} is still held after shutdown: {e}"))
            .release()
            .await
            .expect("release");
    }
    let held = &fleet.replicas[0].metrics;
    assert_eq!(held.held(name.as_str()), 0);
    assert_eq!(held.held(ctx.name("leader").as_str()), 0);
    assert_eq!(fleet.metrics[0].is_leader(), 0);
}
