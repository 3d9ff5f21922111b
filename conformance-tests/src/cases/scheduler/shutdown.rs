//! Shutdown: no run starts once it has been called, and it returns by its
//! deadline even while a catch-up tick waits for its lock.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lock_core::LockName;
use scheduler::{Job, MissedTicks, Mode, Schedule, TickOutcome, WallClock};
use tokio::sync::Notify;
use tokio::time::{sleep, timeout, Instant};

use super::fleet::{sleep_until_phase, Fleet, Plan};
use crate::cases::assert_between;
use crate::Ctx;

/// Records `periods` periods before the latest tick as the job's last
/// completed one, so a replica starting now has that many missed ticks,
/// and returns them, oldest first.
async fn miss_ticks(fleet: &Fleet, plan: Plan, job: &LockName, periods: u32) -> Vec<DateTime<Utc>> {
    let schedule = Schedule::parse(job.as_str(), plan.cron, "UTC").expect("valid cron");
    let now = fleet.clocks[0].now();
    let latest = schedule
        .latest_at_or_before(now)
        .expect("a tick before now");
    let period = chrono::TimeDelta::from_std(plan.period).expect("small");
    let last = latest - period * i32::try_from(periods).expect("few");
    fleet
        .ticks
        .record_completed(job, last.timestamp_millis(), Duration::from_secs(60))
        .await
        .expect("record the last completed tick");
    schedule.ticks_between(last, now)
}

/// Every missed tick is caught up (`RunAll`), oldest first, in one batch.
fn run_all(plan: Plan) -> MissedTicks {
    MissedTicks::RunAll {
        window: plan.period * 10,
        max: 10,
    }
}

/// Three missed ticks are caught up in one batch; shutdown is called while
/// the first catch-up run is going (its handler stops when asked). The rest
/// of the batch must not start: exactly one handler ever entered, and the
/// two other ticks are reported skipped.
pub(crate) async fn scheduler_shutdown_stops_a_catch_up_batch(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0]).await;
    let name = ctx.name("batch");
    sleep_until_phase(fleet.clocks[0].as_ref(), plan.period, 4).await;
    let missed = miss_ticks(&fleet, plan, &name, 3).await;
    assert_eq!(missed.len(), 3, "{missed:?}");
    let entered = Arc::new(AtomicU32::new(0));
    let started = Arc::new(Notify::new());
    let (count, notify) = (Arc::clone(&entered), Arc::clone(&started));
    let job = Job::new(name.as_str(), plan.cron, move |ctx| {
        count.fetch_add(1, Ordering::SeqCst);
        notify.notify_one();
        async move {
            ctx.cancellation_token().cancelled().await;
            Ok(())
        }
    })
    .with_ttl(ctx.timing().ttl)
    .with_missed_ticks(run_all(plan));
    let s = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job]);
    let s = s.start().expect("starts");
    timeout(plan.period, started.notified())
        .await
        .expect("the first catch-up run starts at once");
    s.shutdown(plan.period * 2)
        .await
        .expect("the running handler stops when asked");
    let runs = entered.load(Ordering::SeqCst);
    let reports: Vec<_> = fleet
        .reports_of(0, name.as_str())
        .into_iter()
        .map(|r| (r.scheduled, r.outcome, r.catch_up))
        .collect();
    assert_eq!(
        runs, 1,
        "{runs} handlers started; only the one running when shutdown was called may have: {reports:?}"
    );
    let expected: Vec<_> = missed
        .iter()
        .zip([
            TickOutcome::Success,
            TickOutcome::Skipped,
            TickOutcome::Skipped,
        ])
        .map(|(t, o)| (*t, o, true))
        .collect();
    assert_eq!(reports, expected, "each tick of the batch reported once");
}

/// A catch-up tick whose lock another replica holds is waited for (up to
/// the job's TTL). Shutdown, called during that wait with a deadline of a
/// quarter TTL, returns without error well within it, and no handler
/// starts: before, it waited out the TTL and then ran the next tick.
pub(crate) async fn scheduler_shutdown_is_not_held_up_by_a_catch_up_wait(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let timing = ctx.timing();
    let fleet = Fleet::new(&ctx, &[0, 0]).await;
    let name = ctx.name("waiting");
    sleep_until_phase(fleet.clocks[0].as_ref(), plan.period, 4).await;
    let missed = miss_ticks(&fleet, plan, &name, 2).await;
    let first = LockName::new(format!("{name}/{}", missed[0].timestamp_millis())).expect("valid");
    let holder = fleet.replicas[1]
        .locker
        .try_lock(&first, &ctx.opts())
        .await
        .expect("the other replica takes the first missed tick's lock");
    let entered = Arc::new(AtomicU32::new(0));
    let count = Arc::clone(&entered);
    let job = Job::new(name.as_str(), plan.cron, move |_ctx| {
        count.fetch_add(1, Ordering::SeqCst);
        async { Ok(()) }
    })
    .with_ttl(timing.ttl)
    .with_missed_ticks(run_all(plan));
    let s = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job]);
    let s = s.start().expect("starts");
    // The replica's first backend call is the catch-up's acquire; from then
    // on it waits for the held lock.
    timeout(timing.ttl / 2, async {
        while fleet.faults[0].calls() == 0 {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the catch-up tries the held lock");
    let deadline = timing.ttl / 4;
    let began = Instant::now();
    let result = s.shutdown(deadline).await;
    let took = began.elapsed();
    let ran = entered.load(Ordering::SeqCst);
    holder.release().await.expect("release the held tick");
    assert_between(
        "shutdown during a catch-up wait",
        took,
        Duration::ZERO,
        deadline + timing.tolerance,
    );
    assert!(result.is_ok(), "nothing was running: {result:?}");
    assert_eq!(ran, 0, "a handler started after shutdown was called");
    assert_eq!(fleet.replicas[0].metrics.held(name.as_str()), 0);
}
