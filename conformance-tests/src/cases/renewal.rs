use lock_core::{Error, LossReason, RenewalOutcome};
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::assert_between;
use crate::faulty::Fault;
use crate::Ctx;

/// The heartbeat keeps a lease for 3.5 × TTL; nobody else gets it meanwhile.
pub(super) async fn renewal_keeps_lease_alive(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("renewed");
    let ttl = ctx.timing().ttl;
    let guard = a
        .locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("free lock");
    let until = Instant::now() + ttl * 7 / 2;
    while Instant::now() < until {
        assert!(
            matches!(
                b.locker.try_lock(&name, &ctx.opts()).await,
                Err(Error::HeldElsewhere { .. })
            ),
            "another replica acquired a renewed lease"
        );
        guard.assert_held().expect("renewed lease stays valid");
        sleep(ttl / 4).await;
    }
    let renewed = a.metrics.renewals(name.as_str(), RenewalOutcome::Renewed);
    assert!(
        renewed >= 9,
        "expected ≥ 9 renewals in 3.5 TTLs at ttl/3, saw {renewed}"
    );
    guard.release().await.expect("release");
}

/// With the heartbeat off, `assert_held` fails exactly at
/// `sent_at + ttl - drift`, although nothing ever told the lease it expired.
pub(super) async fn deadline_without_heartbeat(ctx: Ctx) {
    let a = ctx.replica().await;
    let name = ctx.name("unrenewed");
    let opts = ctx.opts().with_auto_renew(false);
    let before = Instant::now();
    let guard = a.locker.try_lock(&name, &opts).await.expect("free lock");
    // The deadline is counted from before the request left, so it can only be earlier.
    let latest_deadline = before + opts.ttl() - opts.drift() + ctx.timing().tolerance;
    sleep(opts.ttl() / 2).await;
    guard.assert_held().expect("valid at half the TTL");
    let remaining = guard
        .remaining_validity()
        .expect("a backed lease has a deadline");
    sleep(remaining).await;
    match guard.assert_held() {
        Err(Error::LockLost {
            reason: LossReason::Expired,
            ..
        }) => {}
        other => panic!("expected LockLost(expired) at the deadline, got {other:?}"),
    }
    assert!(Instant::now() <= latest_deadline + ctx.timing().tolerance);
    assert_eq!(
        a.metrics.renewals(name.as_str(), RenewalOutcome::Renewed),
        0
    );
}

/// Renewals that never answer in time: the lease is lost with
/// `backend_error` at its local deadline, and the job's token fires then.
pub(super) async fn stalled_renewal_fails_closed_at_deadline(ctx: Ctx) {
    let timing = ctx.timing();
    let (faulty, a) = super::faulty_replica(&ctx, timing.ttl * 10).await;
    let name = ctx.name("stalled");
    let opts = ctx.opts();
    let before = Instant::now();
    let guard = a.locker.try_lock(&name, &opts).await.expect("free lock");
    faulty.set(Fault::StallRenewals);
    let reason = guard.lost().await;
    assert_eq!(reason, LossReason::BackendError);
    let deadline = before + opts.ttl() - opts.drift();
    assert_between(
        "loss after a stalled renewal, from acquire",
        Instant::now() - before,
        deadline - before - timing.tolerance,
        deadline - before + timing.tolerance,
    );
    assert!(guard.assert_held().is_err());
    faulty.set(Fault::None);
    drop(guard);
}

/// A renewal refused for a reason that will not heal (configuration,
/// permission) loses the lease at once instead of at its deadline.
pub(super) async fn refused_renewal_loses_the_lease_at_once(ctx: Ctx) {
    let timing = ctx.timing();
    let (faulty, a) = super::faulty_replica(&ctx, timing.ttl).await;
    let name = ctx.name("refused");
    let opts = ctx.opts();
    let guard = a.locker.try_lock(&name, &opts).await.expect("free lock");
    faulty.set(Fault::RefuseRenewals);
    let refused_from = Instant::now();
    assert_eq!(guard.lost().await, LossReason::BackendError);
    assert_between(
        "loss after a refused renewal",
        refused_from.elapsed(),
        Duration::ZERO,
        opts.renew_interval() + timing.tolerance,
    );
    faulty.set(Fault::None);
    drop(guard);
}

/// A waiting acquire with a timeout retries through a short outage and gets
/// the lock once the backend is back.
pub(super) async fn waiting_acquire_rides_out_an_outage(ctx: Ctx) {
    let timing = ctx.timing();
    let (faulty, a) = super::faulty_replica(&ctx, timing.ttl).await;
    let name = ctx.name("outage");
    faulty.set(Fault::Down);
    let heal = {
        let faulty = faulty.clone();
        let after = timing.ttl / 2;
        tokio::spawn(async move {
            sleep(after).await;
            faulty.set(Fault::None);
        })
    };
    let opts = ctx.opts().with_acquire_timeout(timing.ttl * 3);
    let guard = a
        .locker
        .lock(&name, &opts)
        .await
        .expect("acquired after the outage");
    heal.await.expect("healer");
    guard.release().await.expect("release");
}
