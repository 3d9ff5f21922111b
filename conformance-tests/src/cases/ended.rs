//! A lease ends once, for every clone of its handle at the same instant:
//! released, dropped, retained hold over, or `max_hold` reached. A normal end
//! is not counted as a loss.

use std::time::Duration;

use lock_core::{Error, LeaseHandle, LockMetrics, LockOptions, LossReason};
use tokio::time::{timeout, Instant};

use crate::Ctx;

const LOSSES: [LossReason; 4] = [
    LossReason::Stolen,
    LossReason::Expired,
    LossReason::BackendError,
    LossReason::MaxHoldExceeded,
];

/// Asserts that `handle` (a clone kept by the work) reports the lease over,
/// at once and by every means: `assert_held`, `lost()`, the token.
async fn assert_over(what: &str, handle: &LeaseHandle, bound: Duration) -> LossReason {
    let token = handle.cancellation_token();
    assert!(
        matches!(handle.assert_held(), Err(Error::LockLost { .. })),
        "{what}: a clone still says held"
    );
    assert!(!handle.is_held(), "{what}: is_held is still true");
    assert!(
        token.is_cancelled(),
        "{what}: the cancellation token did not fire"
    );
    let reason = timeout(bound, handle.lost())
        .await
        .unwrap_or_else(|_| panic!("{what}: lost() did not complete within {bound:?}"));
    assert_eq!(handle.loss_reason(), Some(reason));
    assert_eq!(handle.remaining_validity(), Some(Duration::ZERO));
    reason
}

fn assert_no_loss_counted(what: &str, metrics: &LockMetrics, label: &str) {
    for reason in LOSSES {
        assert_eq!(
            metrics.losses(label, reason),
            0,
            "{what}: a normal end was counted as a loss ({reason})"
        );
    }
}

/// `release()` ends the lease for every clone of its handle before it returns.
pub(super) async fn released_lease_ends_every_clone(ctx: Ctx) {
    let a = ctx.replica().await;
    let name = ctx.name("released-clones");
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let (h1, h2) = (guard.handle(), guard.handle());
    let token = h1.cancellation_token();
    assert!(h1.is_held() && h2.is_held() && !token.is_cancelled());
    guard.release().await.expect("release");
    let bound = ctx.timing().tolerance;
    assert_eq!(
        assert_over("after release", &h1, bound).await,
        LossReason::Released
    );
    assert_over("after release (second clone)", &h2, bound).await;
    assert!(
        token.is_cancelled(),
        "a token taken before release did not fire"
    );
    assert_no_loss_counted("release", &a.metrics, name.as_str());
}

/// Dropping the guard ends the lease for every clone at once, and the lock
/// is released in the background.
pub(super) async fn dropped_guard_ends_every_clone(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("dropped-clones");
    let timing = ctx.timing();
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let handle = guard.handle();
    drop(guard);
    assert_eq!(
        assert_over("after drop", &handle, timing.tolerance).await,
        LossReason::Released
    );
    assert_no_loss_counted("drop", &a.metrics, name.as_str());
    b.assert_free(
        "after drop, released in the background",
        &name,
        &ctx,
        timing.ttl / 2 + timing.tolerance,
    )
    .await;
}

/// A lease kept with `retain_for` reports held during the hold, then ends
/// for every clone when the hold is over (released, not lost).
pub(super) async fn retained_lease_ends_every_clone_after_hold(ctx: Ctx) {
    let a = ctx.replica().await;
    let name = ctx.name("retained-clones");
    let timing = ctx.timing();
    let hold = timing.ttl / 2;
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let handle = guard.handle();
    let retained_at = Instant::now();
    guard.retain_for(hold).await.expect("retain");
    let reason = timeout(hold + timing.tolerance, handle.lost())
        .await
        .expect("the retained lease did not end after its hold");
    assert_eq!(reason, LossReason::Released);
    assert!(
        retained_at.elapsed() + timing.tolerance >= hold / 2,
        "the retained lease ended long before its hold"
    );
    assert_over("after the hold", &handle, timing.tolerance).await;
    assert_no_loss_counted("retain", &a.metrics, name.as_str());
}

/// Leases retained with holds given out of order each end at their own hold:
/// the ends of every hold of one `Locker` are kept in one schedule, and the
/// one retained first must not hold up one that ends sooner. On a session
/// backend the lock is then free to another replica too.
pub(super) async fn retained_leases_end_in_the_order_of_their_holds(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    // A hold is a TTL on the server: no shorter than the backend allows.
    let step = (timing.ttl / 4).max(a.backend.capabilities().min_ttl);
    let mut waits = Vec::new();
    let retained_at = Instant::now();
    for (i, steps) in [3u32, 1, 2].into_iter().enumerate() {
        let name = ctx.name(&format!("retained-order-{i}"));
        let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
        let handle = guard.handle();
        let hold = step * steps;
        guard.retain_for(hold).await.expect("retain");
        waits.push(tokio::spawn(async move {
            let reason = timeout(hold + timing.tolerance, handle.lost())
                .await
                .unwrap_or_else(|_| panic!("the lease retained for {hold:?} did not end in time"));
            (name, hold, reason, retained_at.elapsed())
        }));
    }
    for wait in waits {
        let (name, hold, reason, ended) = wait.await.expect("the wait panicked");
        assert_eq!(reason, LossReason::Released, "{name}");
        assert!(
            ended + timing.tolerance >= hold / 2,
            "{name}: retained for {hold:?}, ended after {ended:?}"
        );
        b.assert_free(
            &format!("{name}, after its hold"),
            &name,
            &ctx,
            timing.ttl / 8 + timing.tolerance,
        )
        .await;
    }
}

/// `assert_held` fails once `max_hold` has passed even while the heartbeat
/// (the watchdog) cannot run, however far the last renewal moved the
/// validity deadline.
pub(super) fn max_hold_fails_assert_held_while_starved(ctx: Ctx) {
    // A real clock on one thread: blocking it starves the heartbeat task.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let a = ctx.replica().await;
        let name = ctx.name("starved-watchdog");
        let caps = a.backend.capabilities();
        let ttl = caps.min_ttl.max(Duration::from_millis(600));
        let opts = LockOptions::new(ttl)
            .with_max_hold(ttl)
            .with_auto_renew(false);
        let guard = a.locker.try_lock(&name, &opts).await.expect("free");
        tokio::time::sleep(ttl / 2).await;
        guard.renew().await.expect("renew");
        // Past max_hold, still inside the renewed validity.
        let started = Instant::now();
        std::thread::sleep(ttl / 2 + ttl / 5);
        let past_hold = started.elapsed();
        let still_valid = guard.remaining_validity();
        let result = guard.assert_held();
        assert!(
            matches!(
                result,
                Err(Error::LockLost {
                    reason: LossReason::MaxHoldExceeded,
                    ..
                })
            ),
            "assert_held after max_hold with a starved heartbeat: {result:?} \
             (blocked {past_hold:?}, validity left {still_valid:?})"
        );
        drop(guard);
    });
}

/// Waits until `election` leads, and returns its lease.
async fn leading(election: &scheduler::LeaderElection, bound: Duration) -> LeaseHandle {
    let mut rx = election.subscribe();
    timeout(bound, async {
        loop {
            if let Some(lease) = election.lease().filter(|l| l.is_held()) {
                return lease;
            }
            if rx.changed().await.is_err() {
                panic!("the election stopped before leading");
            }
        }
    })
    .await
    .expect("not elected in time")
}

/// A leadership lease handle taken from `LeaderElection::lease()` reports
/// the lease over once the election is stopped or dropped.
pub(super) async fn election_lease_ends_on_stop_and_drop(ctx: Ctx) {
    let timing = ctx.timing();
    let bound = timing.ttl + timing.tolerance;
    for stop in [true, false] {
        let a = ctx.replica().await;
        let name = ctx.name(if stop { "leader-stop" } else { "leader-drop" });
        let election = scheduler::LeaderElection::builder(a.locker.clone(), name.as_str())
            .with_ttl(timing.ttl)
            .with_interval(timing.ttl / 4)
            .start()
            .expect("start");
        let lease = leading(&election, bound).await;
        if stop {
            election.stop().await;
            assert_eq!(
                assert_over("after stop()", &lease, timing.tolerance).await,
                LossReason::Released
            );
        } else {
            drop(election);
            let reason = timeout(bound, lease.lost())
                .await
                .expect("the lease did not end after the election was dropped");
            assert_eq!(reason, LossReason::Released);
            assert_over("after drop", &lease, timing.tolerance).await;
        }
        assert_no_loss_counted("election end", &a.metrics, name.as_str());
    }
}

/// A standby election takes the leadership as soon as the leader stops and
/// releases its lock, on a backend that reports releases: not at its next
/// attempt, an interval (here four TTLs) later. Without release
/// notification, within that interval.
pub(super) async fn election_standby_takes_over_at_release(ctx: Ctx) {
    let timing = ctx.timing();
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("standby");
    let interval = timing.ttl * 4;
    let start = |locker: lock_core::Locker| {
        scheduler::LeaderElection::builder(locker, name.as_str())
            .with_ttl(timing.ttl)
            .with_interval(interval)
            .start()
            .expect("start")
    };
    let leader = start(a.locker.clone());
    leading(&leader, timing.ttl + timing.tolerance).await;
    let standby = start(b.locker.clone());
    // Its first attempt is refused; the next is an interval away. A release
    // signal may wake it at most once per eighth of the interval (half a
    // TTL here), and the memory backend's signals also fire at the leader's
    // first expiry instant (one TTL in): stop between the two.
    tokio::time::sleep(timing.ttl / 2 + timing.tolerance).await;
    assert!(!standby.is_leader(), "two leaders at once");
    let mut took_over = standby.subscribe();
    let stopped = Instant::now();
    leader.stop().await;
    let bound = if ctx.factory().capabilities().release_notify {
        timing.tolerance
    } else {
        interval + timing.tolerance
    };
    timeout(bound * 2, took_over.wait_for(|l| *l))
        .await
        .expect("the standby did not take over in time")
        .expect("the election stopped");
    crate::cases::assert_between(
        "take-over after the leader stopped",
        stopped.elapsed(),
        Duration::ZERO,
        bound,
    );
    standby.stop().await;
}
