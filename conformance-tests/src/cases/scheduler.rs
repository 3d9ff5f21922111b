//! Scheduler cases: several replicas, each with its own `Locker`, clock and
//! scheduler, sharing one backend and its tick store.
//!
//! On the paused clock they run 60 two-second ticks exactly and instantly;
//! against a real server, about ten one-second ticks in real time.

mod crash;
mod extreme;
mod extreme_prop;
mod failover;
mod fleet;
mod late;
mod lifecycle;
mod missed;
mod panics;
mod pause;
mod shutdown;
mod skew;

pub(super) use crash::scheduler_crash_matrix;
pub(super) use extreme::{
    scheduler_extreme_lock_ttls_refused_or_run, scheduler_extreme_settings_refused_or_run,
};
pub(super) use extreme_prop::{
    scheduler_extreme_durations_never_panic, scheduler_extreme_lock_ttls_never_panic,
};
pub(super) use failover::scheduler_leader_failover_aborts_before_successor;
pub(super) use late::{
    scheduler_late_runs_do_not_crowd_out_the_next_tick,
    scheduler_late_wakeup_runs_ticks_still_in_window,
};
pub(super) use lifecycle::{
    scheduler_overlapping_tick_is_skipped, scheduler_panic_is_caught_and_lock_released,
    scheduler_shutdown_releases_every_lock,
};
pub(super) use missed::scheduler_missed_tick_policies_after_outage;
pub(super) use pause::scheduler_pause_matrix;
pub(super) use shutdown::{
    scheduler_shutdown_is_not_held_up_by_a_catch_up_wait, scheduler_shutdown_stops_a_catch_up_batch,
};
pub(super) use skew::{
    scheduler_busy_fast_replica_does_not_cancel_a_tick,
    scheduler_far_ahead_replica_does_not_starve_others,
    scheduler_finished_tick_is_marked_before_its_lock_is_checked,
    scheduler_finished_tick_outlives_its_replica, scheduler_skew_beyond_tolerance_still_runs_once,
};

use scheduler::Mode;

use self::fleet::{Fleet, Plan};
use crate::Ctx;

/// Three replicas, one clock 2 s ahead, per-tick mode: every tick runs
/// exactly once, with no gap, although jobs finish in milliseconds.
pub(super) async fn scheduler_per_tick_exactly_once(ctx: Ctx) {
    exactly_once(ctx, |_| Mode::PerTick).await;
}

/// Three replicas, one clock 2 s ahead, leader mode: only the leader runs,
/// every tick exactly once, with no gap.
pub(super) async fn scheduler_leader_exactly_once(ctx: Ctx) {
    exactly_once(ctx, |ctx| Mode::Leader(fleet::election(ctx))).await;
}

async fn exactly_once(ctx: Ctx, mode: impl Fn(&Ctx) -> Mode) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[2_000, 0, 0]).await;
    let leader_mode = matches!(mode(&ctx), Mode::Leader(_));
    let job = ctx.name("exactly-once");
    let schedulers = fleet
        .start_all(&ctx, mode(&ctx), |replica| {
            fleet.recording_job(job.as_str(), plan.cron, replica, plan.work)
        })
        .await;
    // Until the planned number of ticks completed, not for a fixed span: on
    // a loaded machine the first tick (after connecting, and in leader mode
    // an election) can come a period or two late. Gaps and duplicates are
    // judged over whatever ran; the bound keeps a stuck fleet failing fast.
    let give_up = tokio::time::Instant::now() + plan.period * (plan.ticks * 2 + 2);
    while fleet.log.completed().len() < plan.ticks as usize && tokio::time::Instant::now() < give_up
    {
        tokio::time::sleep(plan.period / 4).await;
    }
    let leaders: Vec<i64> = schedulers.iter().map(|s| s.metrics().is_leader()).collect();
    fleet.shutdown_all(schedulers).await;

    let runs = fleet.log.completed();
    assert!(
        runs.len() >= plan.ticks as usize,
        "only {} runs in {} periods",
        runs.len(),
        plan.ticks
    );
    fleet::assert_each_tick_once(&runs, plan.period);
    if leader_mode {
        assert_eq!(
            leaders.iter().sum::<i64>(),
            1,
            "scheduler_is_leader: {leaders:?}"
        );
        let ran_on: std::collections::BTreeSet<_> = runs.iter().map(|r| r.replica).collect();
        assert_eq!(
            ran_on.len(),
            1,
            "without failover only the leader runs: {ran_on:?}"
        );
    } else {
        let ran_on: std::collections::BTreeSet<_> = runs.iter().map(|r| r.replica).collect();
        assert!(
            ran_on.contains(&0),
            "the replica whose clock is ahead fires first and must win ticks"
        );
    }
    let successes: u64 = fleet.successes(job.as_str());
    assert_eq!(
        successes,
        runs.len() as u64,
        "scheduler_runs_total{{outcome=success}}"
    );
    let timed: u64 = fleet
        .metrics
        .iter()
        .map(|m| m.timed_runs(job.as_str()))
        .sum();
    let lags: u64 = fleet
        .metrics
        .iter()
        .map(|m| m.lag_samples(job.as_str()))
        .sum();
    assert_eq!(
        (timed, lags),
        (successes, successes),
        "duration and lag histograms"
    );
}
