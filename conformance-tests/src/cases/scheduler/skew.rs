//! Per-tick mode at the edges of clock skew.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use scheduler::{Mode, TickOutcome};
use tokio::time::sleep;

use super::fleet::{self, Fleet, Plan};
use crate::faulty::Fault;
use crate::Ctx;

/// Replica 0's clock is 3 s ahead and once gets busy: its first run lasts
/// 2.5 periods, so the next tick, waiting for it, is replaced by the one
/// after and skipped, and that one finishes first. That later completion
/// must not cancel the skipped tick, which replica 1 then runs: every tick
/// still runs exactly once.
pub(crate) async fn scheduler_busy_fast_replica_does_not_cancel_a_tick(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[3_000, 0]).await;
    let name = ctx.name("busy");
    let first = Arc::new(AtomicU32::new(0));
    let schedulers = fleet
        .start_all(&ctx, Mode::PerTick, |replica| {
            let slow_once = Arc::clone(&first);
            fleet.recording_job_with(name.as_str(), plan.cron, replica, move || {
                if replica == 0 && slow_once.fetch_add(1, Ordering::SeqCst) == 0 {
                    plan.period * 5 / 2
                } else {
                    plan.work
                }
            })
        })
        .await;
    sleep(plan.period * 8).await;
    fleet.shutdown_all(schedulers).await;
    let runs = fleet.log.completed();
    fleet::assert_each_tick_once(&runs, plan.period);
    assert!(
        runs.iter().any(|r| r.replica == 1),
        "replica 1 never ran the tick replica 0 skipped: {runs:?}"
    );
}

/// Replica 1's clock is behind by more than the tolerance (plus three
/// periods), so completion marks have ended when it fires: the recorded
/// later ticks still stop it from running any tick again.
pub(crate) async fn scheduler_skew_beyond_tolerance_still_runs_once(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let behind = fleet::tolerance(&ctx) + plan.period * 3;
    let behind_ms = i64::try_from(behind.as_millis()).expect("small");
    let fleet = Fleet::new(&ctx, &[0, -behind_ms]).await;
    let name = ctx.name("far-behind");
    let job = |replica| fleet.recording_job(name.as_str(), plan.cron, replica, plan.work);
    let ahead = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job(0)]);
    let ahead = ahead.start().expect("starts");
    // Start the late replica once every tick it will see was due on replica 0.
    sleep(behind + plan.period).await;
    let late = fleet.scheduler(&ctx, 1, Mode::PerTick, vec![job(1)]);
    let late = late.start().expect("starts");
    sleep(plan.period * plan.ticks / 2).await;
    let schedulers = vec![ahead, late];
    fleet.shutdown_all(schedulers).await;
    let runs = fleet.log.completed();
    fleet::assert_each_tick_once(&runs, plan.period);
    assert!(
        runs.iter().all(|r| r.replica == 0),
        "the far-behind replica re-ran a tick"
    );
}

/// Replica 0's clock is an hour ahead (a step that slewing never undid).
/// Where the tick store reads a server clock, that replica's ticks are
/// refused, and replica 1 (true clock) runs every tick, once: the hour-ahead
/// ticks are never recorded as done. Without a server clock (the in-process
/// memory backend, etcd) the hour-ahead ticks run early and replica 1 then
/// skips its own as past; only "never twice" holds, which is checked.
pub(crate) async fn scheduler_far_ahead_replica_does_not_starve_others(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[3_600_000, 0]).await;
    let has_clock = fleet
        .ticks
        .server_time()
        .await
        .expect("the server clock reads")
        .is_some();
    let name = ctx.name("far-ahead");
    let schedulers = fleet
        .start_all(&ctx, Mode::PerTick, |replica| {
            fleet.recording_job(name.as_str(), plan.cron, replica, plan.work)
        })
        .await;
    sleep(plan.period * plan.ticks / 2).await;
    fleet.shutdown_all(schedulers).await;
    let runs = fleet.log.completed();
    let by_replica = |r: usize| runs.iter().filter(|run| run.replica == r).count();
    if has_clock {
        fleet::assert_each_tick_once(&runs, plan.period);
        assert_eq!(by_replica(0), 0, "the hour-ahead replica ran: {runs:?}");
        assert!(
            by_replica(1) + 1 >= (plan.ticks / 2) as usize,
            "the true-clocked replica ran only {} ticks in {} periods",
            by_replica(1),
            plan.ticks / 2
        );
    } else {
        let mut ticks: Vec<_> = runs.iter().map(|r| r.tick).collect();
        let total = ticks.len();
        ticks.dedup();
        assert_eq!(ticks.len(), total, "a tick ran twice: {runs:?}");
    }
}

/// Replica 0's clock is 2 s ahead. Once it has finished two ticks it goes
/// away without a shutdown, and its locks (the finished ticks' completion
/// marks among them) go with it, as a crashed replica's do on Postgres (the
/// saboteur removes them here, on every backend).
/// Replica 1, on the true clock, then fires those ticks 2 s later. For the
/// first, the latest completed tick is the second, a later one, which alone
/// does not prove the first ran: the first's own mark in the tick store must
/// stop replica 1 from running it again.
pub(crate) async fn scheduler_finished_tick_outlives_its_replica(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let fleet = Fleet::new(&ctx, &[2_000, 0]).await;
    let name = ctx.name("outlives");
    let job = |replica| fleet.recording_job(name.as_str(), plan.cron, replica, plan.work);
    let ahead = fleet.scheduler(&ctx, 0, Mode::PerTick, vec![job(0)]);
    let ahead = ahead.start().expect("starts");
    let mut waited = 0;
    while fleet.log.completed().len() < 2 {
        assert!(waited < 60, "replica 0 finished no two ticks in 6 periods");
        sleep(plan.period / 10).await;
        waited += 1;
    }
    drop(ahead);
    // The crash: the finished ticks' locks, kept as completion marks, go.
    let saboteur = ctx.saboteur().await;
    for run in fleet.log.completed() {
        let lock =
            lock_core::LockName::new(format!("{}/{}", name.as_str(), run.tick.timestamp_millis()))
                .expect("a tick's lock name");
        // On Postgres the dropped scheduler's locks may be gone already.
        let _ = saboteur.expire(&lock).await;
    }
    let late = fleet.scheduler(&ctx, 1, Mode::PerTick, vec![job(1)]);
    let late = late.start().expect("starts");
    sleep(plan.period * 4).await;
    fleet.shutdown_all(vec![late]).await;
    let runs = fleet.log.completed();
    let done: Vec<_> = runs
        .iter()
        .filter(|r| r.replica == 0)
        .map(|r| r.tick)
        .collect();
    let again: Vec<_> = runs
        .iter()
        .filter(|r| r.replica == 1 && done.contains(&r.tick))
        .collect();
    assert!(
        again.is_empty(),
        "replica 1 ran ticks replica 0 had finished: {again:?} (all runs: {runs:?})"
    );
    let first = done[0];
    assert!(
        runs.iter().any(|r| r.replica == 1 && r.tick > first),
        "replica 1 ran nothing after {first}: {runs:?}"
    );
}

/// Replica 0's clock is two periods ahead, and every check of its tick
/// locks answers "expired", as when a lease ends on the server between a
/// handler's return and the check that follows it. Replica 1, behind, then
/// takes each tick's lock after replica 0 let it go: the completion mark,
/// written as soon as the handler returned, must stop it running a finished
/// tick again, and replica 0's runs count as finished, not aborted.
pub(crate) async fn scheduler_finished_tick_is_marked_before_its_lock_is_checked(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let behind_ms = i64::try_from((plan.period * 2).as_millis()).expect("small");
    let fleet = Fleet::new(&ctx, &[0, -behind_ms]).await;
    fleet.faults[0].set(Fault::ChecksExpire);
    let name = ctx.name("lapsed");
    let schedulers = fleet
        .start_all(&ctx, Mode::PerTick, |replica| {
            fleet.recording_job(name.as_str(), plan.cron, replica, plan.work)
        })
        .await;
    sleep(plan.period * 8).await;
    fleet.shutdown_all(schedulers).await;
    let runs = fleet.log.completed();
    fleet::assert_each_tick_once(&runs, plan.period);
    let ahead = runs.iter().filter(|r| r.replica == 0).count();
    assert!(
        ahead >= 4,
        "replica 0 ran only {ahead} ticks in 8 periods: {runs:?}"
    );
    // Replica 1 alone fires the ticks due before replica 0 started; after
    // those, every tick is replica 0's, finished and marked.
    let first_ahead = runs.iter().filter(|r| r.replica == 0).map(|r| r.tick).min();
    assert!(
        runs.iter()
            .all(|r| r.replica == 0 || first_ahead.is_some_and(|first| r.tick < first)),
        "the replica behind ran a tick after replica 0 took over: {runs:?}"
    );
    let reports = fleet.reports_of(0, name.as_str());
    assert!(
        reports.iter().all(|r| r.outcome == TickOutcome::Success),
        "a finished run whose lock was lost afterwards counts as finished: {reports:?}"
    );
}
