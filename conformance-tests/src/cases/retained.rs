//! Retained holds at the edges of the lease contract: a hold that cannot be
//! set, one below the backend's minimum TTL, and a renewal of a retained
//! lease. A hold ends in one of two ways, never in neither: the lock is kept
//! for the hold, or it is released.

use std::sync::Arc;

use lock_core::{Error, LockGuard};
use tokio::time::sleep;

use crate::faulty::{Fault, FaultyBackend};
use crate::{Ctx, Replica};

/// Another lock of the same replica and TTL, held for the whole case: on a
/// backend that shares one server lease between a process's locks of one
/// TTL (etcd), it keeps that lease alive, as a busy service would.
async fn keep_another(replica: &Replica, ctx: &Ctx) -> LockGuard {
    replica
        .locker
        .try_lock(&ctx.name("kept-alongside"), &ctx.opts())
        .await
        .expect("the other lock is free")
}

/// A hold that the backend refuses, does not answer, or answers with the
/// lease gone leaves the lock released before `retain_for` returns: another
/// replica takes it at once, and `Locker::shutdown` then has nothing left to
/// do. The last is what a check answering `Expired` already did (the guard
/// dropped after it releases the key, owner-checked); a hold must not leave
/// the key to its TTL where a check would not.
pub(super) async fn failed_hold_releases_the_lock(ctx: Ctx) {
    let timing = ctx.timing();
    for fault in [
        Fault::RefuseRenewals,
        Fault::StallRenewals,
        Fault::RenewalsExpire,
    ] {
        let faulty = FaultyBackend::new(
            ctx.factory().replica().await.expect("replica"),
            timing.ttl / 4,
        );
        let (a, b) = (
            ctx.replica_over(Arc::new(faulty.clone())),
            ctx.replica().await,
        );
        let name = ctx.name(&format!("failed-hold-{fault:?}"));
        let other = keep_another(&a, &ctx).await;
        let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
        let handle = guard.handle();
        faulty.set(fault);
        let kept = guard.retain_for(timing.ttl * 2).await;
        faulty.set(Fault::None);
        assert!(kept.is_err(), "{fault:?}: the hold was set: {kept:?}");
        assert!(
            !handle.is_held(),
            "{fault:?}: a failed hold still says held"
        );
        b.assert_free(
            &format!("{fault:?}: after a failed hold"),
            &name,
            &ctx,
            timing.tolerance,
        )
        .await;
        // Under `RenewalsExpire` a renewal of the other lock that fell in
        // the hold's call lost it too, as it should have: that is all its
        // release may report.
        let released = other.release().await;
        assert!(
            released.is_ok()
                || (fault == Fault::RenewalsExpire
                    && matches!(released, Err(Error::LockLost { .. }))),
            "{fault:?}: releasing the other lock: {released:?}"
        );
        a.locker
            .shutdown(timing.ttl)
            .await
            .unwrap_or_else(|e| panic!("{fault:?}: shutdown found work left: {e}"));
    }
}

/// A hold below the backend's minimum TTL (a TTL the server would refuse)
/// is refused with a configuration error, and the lock is released.
pub(super) async fn short_hold_is_refused_and_released(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    let name = ctx.name("short-hold");
    let other = keep_another(&a, &ctx).await;
    let min = a.backend.capabilities().min_ttl;
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let refused = guard.retain_for(min / 2).await;
    assert!(
        matches!(&refused, Err(Error::Config(m)) if m.contains("minimum")),
        "a hold of {:?} under a minimum TTL of {min:?}: {refused:?}",
        min / 2
    );
    b.assert_free("after a refused hold", &name, &ctx, timing.tolerance)
        .await;
    other.release().await.expect("release the other lock");
}

/// A clone's `renew()` of a retained lease keeps the hold on the server:
/// past the lease's TTL, while the clone still says held, no other replica
/// takes the lock.
pub(super) async fn renew_keeps_a_retained_hold(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    let name = ctx.name("renewed-hold");
    let hold = (timing.ttl + timing.tolerance) * 2;
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let clone = guard.handle();
    guard.retain_for(hold).await.expect("retain");
    clone
        .renew()
        .await
        .expect("a retained lease renews as held");
    // Waiting is the observation: past the TTL a renewal would have set.
    sleep(timing.ttl + timing.tolerance).await;
    assert!(clone.is_held(), "the hold of {hold:?} is not over yet");
    match b.locker.try_lock(&name, &ctx.opts()).await {
        Err(Error::HeldElsewhere { .. }) => {}
        Ok(g) => {
            let _ = g.release().await;
            panic!("another replica took the lock while a clone of its retained lease said held");
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
    b.assert_free(
        "after the hold",
        &name,
        &ctx,
        hold + timing.ttl / 4 + timing.tolerance,
    )
    .await;
}
