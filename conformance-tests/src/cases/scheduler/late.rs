//! A replica whose timer fires late (a process starved of CPU) still runs
//! the ticks that passed meanwhile, as long as their skew window is open.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use scheduler::{Mode, Schedule, TokioClock, WallClock};
use tokio::time::sleep;

use super::fleet::{self, sleep_until_phase, Fleet, Plan};
use crate::Ctx;

/// A wall clock that, once armed, blocks the thread of the first caller
/// that reads it at or after a given instant, for a given time: that caller
/// (the scheduler's tick loop, waking for a tick) and everything else on
/// its thread are starved, and then see the clock moved on by the stall.
#[derive(Debug)]
struct StallingClock {
    inner: Arc<TokioClock>,
    armed: Mutex<Option<(DateTime<Utc>, Duration)>>,
}

impl StallingClock {
    fn new(inner: Arc<TokioClock>) -> Self {
        Self {
            inner,
            armed: Mutex::new(None),
        }
    }

    fn stall_at(&self, at: DateTime<Utc>, stall: Duration) {
        *self.armed.lock().expect("clock lock") = Some((at, stall));
    }
}

impl WallClock for StallingClock {
    fn now(&self) -> DateTime<Utc> {
        let now = self.inner.now();
        let stall = {
            let mut armed = self.armed.lock().expect("clock lock");
            match *armed {
                Some((at, stall)) if now >= at => {
                    *armed = None;
                    Some(stall)
                }
                _ => None,
            }
        };
        match stall {
            Some(stall) => {
                // Deliberately blocking: this is the starvation under test.
                std::thread::sleep(stall);
                self.inner.now()
            }
            None => now,
        }
    }
}

/// One replica runs a few ticks, then its tick loop wakes 2.25 periods late
/// for the next one (the whole runtime stalled on the paused clock; the
/// loop's thread blocked against a real server). The two or three ticks
/// that passed are still within the skew tolerance, so they run, late, in
/// order: every tick from the first run to the last ran exactly once.
pub(crate) async fn scheduler_late_wakeup_runs_ticks_still_in_window(ctx: Ctx) {
    let work = Plan::of(&ctx).work;
    late_wakeup(ctx, work).await;
}

/// As [`scheduler_late_wakeup_runs_ticks_still_in_window`], with runs of
/// 0.3 periods: the late runs, one after another, are still going when the
/// next tick fires. That tick waits for them and runs late too, instead of
/// being skipped as overlapping.
pub(crate) async fn scheduler_late_runs_do_not_crowd_out_the_next_tick(ctx: Ctx) {
    let work = Plan::of(&ctx).period * 3 / 10;
    late_wakeup(ctx, work).await;
}

async fn late_wakeup(ctx: Ctx, work: Duration) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0]).await;
    let name = ctx.name("late");
    let clock = Arc::new(StallingClock::new(Arc::clone(&fleet.clocks[0])));
    let job = fleet.recording_job(name.as_str(), plan.cron, 0, work);
    let s = fleet.scheduler_with_clock(&ctx, 0, Mode::PerTick, vec![job], clock.clone());
    let s = s.start().expect("starts");
    sleep(plan.period * 2).await;
    // Half a period in: the last run has ended (runs last under a third).
    sleep_until_phase(&fleet.clocks[0], plan.period, 2).await;
    let stall = plan.period * 9 / 4;
    assert!(
        stall < fleet::tolerance(&ctx),
        "the stall stays in the window"
    );
    if ctx.timing().paused_clock {
        // Time jumps while no task runs: every timer fires late at once.
        tokio::time::advance(stall).await;
    } else {
        // Exactly the next tick: the tick loop is the first to read the
        // clock then, as it wakes for that tick.
        let schedule = Schedule::parse(name.as_str(), plan.cron, "UTC").expect("valid");
        let next = schedule
            .next_after(fleet.clocks[0].now())
            .expect("a next tick");
        clock.stall_at(next, stall);
    }
    sleep(stall + plan.period * 3).await;
    s.shutdown(Duration::from_secs(10))
        .await
        .expect("clean shutdown");
    let runs = fleet.log.completed();
    assert!(runs.len() >= 6, "only {} runs: {runs:?}", runs.len());
    fleet::assert_each_tick_once(&runs, plan.period);
}
