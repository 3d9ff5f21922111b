//! Leader mode: a leader cut off mid-run is replaced in time, and its run is
//! stopped before the successor runs anything.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lock_core::backend::Expiry;
use scheduler::{Delivery, MissedTicks, Mode, TickOutcome};
use tokio::time::{sleep, Instant};

use super::fleet::{self, Fleet, Plan};
use crate::cases::assert_between;
use crate::faulty::Fault;
use crate::Ctx;

/// The leader (the replica whose clock is 2 s ahead) loses its backend in
/// the middle of a run, as a crashed or partitioned process would: its run
/// is dropped at its lease's local deadline; a standby leads within
/// TTL + one election interval; the successor's first run starts after the
/// old run was dropped, and catches up the missed tick (`RunOnce`) from the
/// last tick the old leader completed; no tick completes twice. The job is
/// delivered at least once, so the successor takes over the tick the old
/// leader started and never completed (at most once would mark it
/// abandoned instead: see the tick record cases).
pub(crate) async fn scheduler_leader_failover_aborts_before_successor(ctx: Ctx) {
    let plan = Plan::of(&ctx);
    let timing = ctx.timing();
    let election = fleet::election(&ctx);
    let interval = timing.ttl / 4;
    let fleet = Fleet::new(&ctx, &[2_000, 0, 0]).await;
    let name = ctx.name("failover");
    // The leader's third run outlasts the lease's TTL, so it is still going
    // when the cut-off leader's local deadline passes; the first two
    // complete, so the tick store knows where the successor takes over.
    let work = timing.ttl * 2;
    let leader_runs = Arc::new(AtomicU32::new(0));
    let job = |replica| {
        let count = Arc::clone(&leader_runs);
        fleet
            .recording_job_with(name.as_str(), plan.cron, replica, move || {
                if replica == 0 && count.fetch_add(1, Ordering::SeqCst) == 2 {
                    work
                } else {
                    plan.work
                }
            })
            .with_missed_ticks(MissedTicks::RunOnce)
            .with_delivery(Delivery::AtLeastOnce)
    };
    let schedulers = fleet.start_all(&ctx, Mode::Leader(election), job).await;
    let mut leadership: Vec<_> = schedulers.iter().map(|s| s.leadership()).collect();
    leadership[0]
        .wait_for(|leading| *leading)
        .await
        .expect("replica 0 campaigns first and leads");

    // Wait until the leader is inside its third run, then cut it off.
    let mid_run = loop {
        if let Some(r) = fleet.log.all().iter().filter(|r| r.replica == 0).nth(2) {
            break r.started;
        }
        sleep(plan.period / 20).await;
    };
    sleep((mid_run + plan.period / 2).saturating_duration_since(Instant::now())).await;
    fleet.faults[0].set(Fault::Down);
    let cut_at = Instant::now();
    if ctx.factory().capabilities().expiry == Expiry::Session {
        // A session backend's server drops a vanished client only after the
        // client's own deadline (keepalives are configured from the TTL), so
        // end the cut-off session once the old leader has stepped down.
        let mut old = schedulers[0].leadership();
        tokio::time::timeout(
            timing.ttl + timing.tolerance,
            old.wait_for(|leading| !*leading),
        )
        .await
        .expect("the cut-off leader steps down by its local deadline")
        .expect("leadership channel open");
        let saboteur = ctx.saboteur().await;
        saboteur
            .expire(&ctx.name("leader"))
            .await
            .expect("end the leader's session");
    }

    let (first, rest) = leadership.split_at_mut(2);
    let (successor, elected_at) = tokio::select! {
        _ = first[1].wait_for(|l| *l) => (1, Instant::now()),
        _ = rest[0].wait_for(|l| *l) => (2, Instant::now()),
        _ = sleep((timing.ttl + interval) * 3) => panic!("no standby took over"),
    };
    assert_between(
        "failover",
        elected_at - cut_at,
        Duration::ZERO,
        timing.ttl + interval + timing.tolerance,
    );
    assert_eq!(
        schedulers[0].metrics().is_leader(),
        0,
        "the old leader still reports itself leader"
    );

    assert_eq!(schedulers[successor].metrics().is_leader(), 1);
    // Let the successor run a few ticks.
    sleep(work * 3).await;
    let runs = fleet.log.all();
    let old_run = runs
        .iter()
        .filter(|r| r.replica == 0)
        .find(|r| r.started <= cut_at && r.finished.is_none())
        .expect("the leader was mid-run at the cut");
    let dropped_at = old_run.dropped.expect("the old leader's run was aborted");
    assert_between(
        "abort after the cut",
        dropped_at - cut_at,
        Duration::ZERO,
        timing.ttl,
    );
    let first_new = runs
        .iter()
        .filter(|r| r.replica == successor)
        .map(|r| r.started)
        .min()
        .expect("the successor ran ticks");
    assert!(
        dropped_at < first_new,
        "the old leader's run was dropped {:?} after the successor's first run started",
        dropped_at - first_new
    );
    assert!(
        runs.iter().all(|r| r.replica != 0 || r.started <= cut_at),
        "the cut-off leader started a run"
    );
    assert!(
        schedulers[0]
            .metrics()
            .runs(name.as_str(), TickOutcome::Aborted)
            >= 1
    );
    // The missed-tick policy held across the failover: the successor's first
    // run caught up the latest tick after the last one the old leader finished.
    let last_done_by_old = runs
        .iter()
        .filter(|r| r.replica == 0 && r.finished.is_some())
        .map(|r| r.tick)
        .max()
        .expect("the old leader completed ticks before the cut");
    let first_report = fleet
        .reports_of(successor, name.as_str())
        .into_iter()
        .find(|r| r.outcome != TickOutcome::Skipped)
        .expect("the successor ran ticks");
    assert_eq!(
        first_report.outcome,
        TickOutcome::Success,
        "{first_report:?}"
    );
    // On the paused clock the takeover lands between ticks, so the first run
    // must be the catch-up; in real time a regular tick can fire at the same
    // moment and is then the same (latest) tick the catch-up would run.
    if timing.paused_clock {
        assert!(
            first_report.catch_up,
            "the successor did not catch up: {first_report:?}"
        );
    }
    assert!(first_report.scheduled > last_done_by_old);
    fleet.faults[0].set(Fault::None);
    let mut schedulers = schedulers.into_iter();
    if let Some(old) = schedulers.next() {
        // Its lease is long gone; dropping it is what a crash does.
        drop(old);
    }
    for s in schedulers {
        s.shutdown(Duration::from_secs(10))
            .await
            .expect("clean shutdown");
    }
    let mut completed: Vec<_> = fleet.log.completed().iter().map(|r| r.tick).collect();
    let total = completed.len();
    completed.sort();
    completed.dedup();
    assert_eq!(completed.len(), total, "a tick completed twice");
}
