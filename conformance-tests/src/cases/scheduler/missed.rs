//! Missed-tick policies after every replica was down for a while.

use std::time::Duration;

use scheduler::{Job, MissedTicks, Mode, WallClock};
use tokio::time::sleep;

use super::fleet::{sleep_until_phase, Fleet, Plan};
use crate::Ctx;

/// Three jobs complete a few ticks, every replica goes away for ten
/// periods, and a fresh replica starts (with its own clock): `Skip` runs
/// nothing missed, `RunOnce` runs only the latest missed tick, and
/// `RunAll { window: 4.5 periods, max: 3 }` runs the three latest, oldest first.
pub(crate) async fn scheduler_missed_tick_policies_after_outage(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[0, 0]).await;
    let names = [ctx.name("skip"), ctx.name("once"), ctx.name("all")];
    let jobs = |replica: usize, policies: [MissedTicks; 3]| -> Vec<Job> {
        names
            .iter()
            .zip(policies)
            .map(|(n, p)| {
                fleet
                    .recording_job(n.as_str(), plan.cron, replica, plan.work)
                    .with_missed_ticks(p)
            })
            .collect()
    };
    let before = fleet.scheduler(&ctx, 0, Mode::PerTick, jobs(0, [MissedTicks::Skip; 3]));
    let before = before.start().expect("starts");
    sleep(plan.period * 3).await;
    before
        .shutdown(Duration::from_secs(10))
        .await
        .expect("clean shutdown");
    let last_before = fleet
        .log
        .completed()
        .iter()
        .map(|r| r.tick)
        .max()
        .expect("ran before the outage");

    sleep(plan.period * 10).await;
    sleep_until_phase(fleet.clocks[1].as_ref(), plan.period, 4).await;
    let window = plan.period * 9 / 2;
    let policies = [
        MissedTicks::Skip,
        MissedTicks::RunOnce,
        MissedTicks::RunAll { window, max: 3 },
    ];
    let back_at = fleet.clocks[1].now();
    let after = fleet.scheduler(&ctx, 1, Mode::PerTick, jobs(1, policies));
    let after = after.start().expect("starts");
    // Less than the time left to the next tick: only catch-up runs happen.
    sleep(plan.period / 2).await;
    after
        .shutdown(Duration::from_secs(10))
        .await
        .expect("clean shutdown");

    let period = chrono::TimeDelta::from_std(plan.period).expect("small");
    let latest_missed = {
        let mut t = last_before;
        while t + period <= back_at {
            t += period;
        }
        t
    };
    assert!(
        latest_missed - last_before >= period * 9,
        "the outage was not ten periods"
    );
    let ran = |job: &lock_core::LockName| -> Vec<_> {
        fleet
            .reports_of(1, job.as_str())
            .into_iter()
            .filter(|r| r.catch_up)
            .map(|r| (r.scheduled, r.outcome))
            .collect()
    };
    let ok = scheduler::TickOutcome::Success;
    assert_eq!(ran(&names[0]), vec![], "Skip ran missed ticks");
    assert_eq!(ran(&names[1]), vec![(latest_missed, ok)], "RunOnce");
    assert_eq!(
        ran(&names[2]),
        vec![
            (latest_missed - period * 2, ok),
            (latest_missed - period, ok),
            (latest_missed, ok)
        ],
        "RunAll"
    );
    let replica1_runs: Vec<_> = fleet
        .log
        .completed()
        .into_iter()
        .filter(|r| r.replica == 1)
        .collect();
    assert_eq!(
        replica1_runs.len(),
        4,
        "only catch-up runs were expected: {replica1_runs:?}"
    );
}
