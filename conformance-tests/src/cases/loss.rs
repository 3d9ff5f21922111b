use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome},
    Error, LeaseHandle, LossReason, OwnerToken, RenewalOutcome, RunOutcome,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use super::{assert_between, theft_seen_as};
use crate::{Ctx, Replica};

/// Starts a `with_lock` job that runs until it is aborted, and returns its
/// lease handle and the task that yields the run's outcome; an error when
/// the job never started (its lock was not acquired).
pub(crate) async fn hold_in_job(
    replica: &Replica,
    ctx: &Ctx,
    name: &lock_core::LockName,
) -> Result<(LeaseHandle, JoinHandle<RunOutcome<()>>), &'static str> {
    let (tx, rx) = oneshot::channel();
    let locker = replica.locker.clone();
    let (name, opts) = (name.clone(), ctx.opts());
    let run = tokio::spawn(async move {
        locker
            .with_lock(&name, &opts, |lease| async move {
                let _ = tx.send(lease);
                std::future::pending::<()>().await
            })
            .await
            .expect("valid input")
    });
    let handle = rx
        .await
        .map_err(|_| "the job did not start: the lock was not acquired")?;
    Ok((handle, run))
}

/// Another owner takes the lock: detected within one renewal interval, the
/// job's token fires, `assert_held` errs, the run is aborted, and the
/// thief's lock is left alone. (A session backend that pushes losses
/// reports the end of the session the theft needed: see [`theft_seen_as`].)
pub(super) async fn theft_is_detected(ctx: Ctx) {
    let a = ctx.replica().await;
    let saboteur = ctx.saboteur().await;
    let name = ctx.name("stolen");
    let timing = ctx.timing();
    let (seen_as, renewal) = theft_seen_as(&ctx);
    let (lease, run) = hold_in_job(&a, &ctx, &name).await.expect("job started");
    sleep(timing.ttl / 2).await;
    let stolen_at = Instant::now();
    saboteur.steal(&name, timing.ttl * 20).await.expect("steal");
    let reason = lease.lost().await;
    assert_eq!(reason, seen_as);
    assert_between(
        "theft detection",
        stolen_at.elapsed(),
        Duration::ZERO,
        ctx.opts().renew_interval() + timing.tolerance,
    );
    assert!(matches!(
        lease.assert_held(),
        Err(Error::LockLost { reason, .. }) if reason == seen_as
    ));
    assert!(lease.cancellation_token().is_cancelled());
    match run.await.expect("job task") {
        RunOutcome::Aborted(reason) if reason == seen_as => {}
        other => panic!("expected Aborted({seen_as}), got {other:?}"),
    }
    sleep(ctx.opts().renew_interval()).await;
    assert!(
        saboteur.thief_holds(&name).await.expect("query"),
        "the thief's lock was touched"
    );
    assert_eq!(a.metrics.losses(name.as_str(), seen_as), 1);
    assert_eq!(
        a.metrics.renewals(name.as_str(), RenewalOutcome::Stolen),
        u64::from(renewal.is_some())
    );
    saboteur.clear(&name).await.expect("cleanup");
}

/// The lease vanishes on the server: detected within one renewal interval
/// as `expired`, and the run is aborted.
pub(super) async fn expiry_is_detected(ctx: Ctx) {
    let a = ctx.replica().await;
    let saboteur = ctx.saboteur().await;
    let name = ctx.name("expired");
    let timing = ctx.timing();
    let (lease, run) = hold_in_job(&a, &ctx, &name).await.expect("job started");
    sleep(timing.ttl / 2).await;
    let expired_at = Instant::now();
    saboteur.expire(&name).await.expect("expire");
    let reason = lease.lost().await;
    assert_eq!(reason, LossReason::Expired);
    assert_between(
        "expiry detection",
        expired_at.elapsed(),
        Duration::ZERO,
        ctx.opts().renew_interval() + timing.tolerance,
    );
    match run.await.expect("job task") {
        RunOutcome::Aborted(LossReason::Expired) => {}
        other => panic!("expected Aborted(expired), got {other:?}"),
    }
    // The name is free again for anyone.
    let b = ctx.replica().await;
    b.assert_free_now("free after expiry", &name, &ctx).await;
}

/// After its lease vanished and a successor took the lock, the old holder
/// can neither renew nor release it, and the successor's lease is intact.
pub(super) async fn stale_holder_cannot_touch_successor(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let saboteur = ctx.saboteur().await;
    let name = ctx.name("stale");
    let ttl = ctx.timing().ttl;
    for round in 0..5 {
        let (ta, tb) = (
            OwnerToken::generate().expect("token"),
            OwnerToken::generate().expect("token"),
        );
        assert!(matches!(
            a.backend
                .try_acquire(&name, &ta, ttl)
                .await
                .expect("acquire"),
            AcquireAttempt::Acquired(_)
        ));
        saboteur.expire(&name).await.expect("expire");
        assert!(
            matches!(
                b.backend
                    .try_acquire(&name, &tb, ttl)
                    .await
                    .expect("acquire"),
                AcquireAttempt::Acquired(_)
            ),
            "round {round}: the successor could not acquire"
        );
        let renewed = a
            .backend
            .renew(&name, &ta, ttl)
            .await
            .expect("renew answers");
        assert_ne!(
            renewed,
            LeaseStatus::Held,
            "round {round}: stale renew succeeded"
        );
        let released = a
            .backend
            .release(&name, &ta)
            .await
            .expect("release answers");
        assert_eq!(
            released,
            ReleaseOutcome::NotHeld,
            "round {round}: stale release deleted the successor's lock"
        );
        assert_ne!(
            a.backend.check(&name, &ta).await.expect("check"),
            LeaseStatus::Held
        );
        assert_eq!(
            b.backend.check(&name, &tb).await.expect("check"),
            LeaseStatus::Held
        );
        assert_eq!(
            b.backend.release(&name, &tb).await.expect("release"),
            ReleaseOutcome::Released
        );
        // Released means gone: releasing again, or renewing, finds nothing.
        assert_eq!(
            b.backend.release(&name, &tb).await.expect("release"),
            ReleaseOutcome::NotHeld
        );
        assert_eq!(
            b.backend.renew(&name, &tb, ttl).await.expect("renew"),
            LeaseStatus::Expired
        );
    }
}

/// Releasing a guard whose lease was lost reports the loss instead of success.
pub(super) async fn release_after_loss_reports_lost(ctx: Ctx) {
    let a = ctx.replica().await;
    let saboteur = ctx.saboteur().await;
    let name = ctx.name("release-lost");
    let (seen_as, _) = theft_seen_as(&ctx);
    let guard = a
        .locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("free lock");
    saboteur
        .steal(&name, ctx.timing().ttl * 20)
        .await
        .expect("steal");
    let reason = guard.lost().await;
    assert_eq!(reason, seen_as);
    assert!(matches!(
        guard.release().await,
        Err(Error::LockLost { reason, .. }) if reason == seen_as
    ));
    assert!(
        saboteur.thief_holds(&name).await.expect("query"),
        "release of a lost guard deleted the thief's lock"
    );
    saboteur.clear(&name).await.expect("cleanup");
}

/// A lock kept as a completion mark with `retain_for` blocks others for the
/// hold, then ends by itself.
pub(super) async fn retained_lock_ends_after_hold(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("retained");
    let timing = ctx.timing();
    let hold = timing.ttl / 2;
    let guard = a
        .locker
        .try_lock(&name, &ctx.opts())
        .await
        .expect("free lock");
    let retained_at = Instant::now();
    guard.retain_for(hold).await.expect("retain");
    assert!(
        matches!(
            b.locker.try_lock(&name, &ctx.opts()).await,
            Err(Error::HeldElsewhere { .. })
        ),
        "a retained lock was free at once"
    );
    let opts = ctx.opts().with_acquire_timeout(hold + timing.ttl);
    let g = b
        .locker
        .lock(&name, &opts)
        .await
        .expect("free after the hold");
    assert_between(
        "end of a retained lock",
        retained_at.elapsed(),
        hold.saturating_sub(timing.tolerance),
        hold + timing.ttl / 8 + timing.tolerance,
    );
    g.release().await.expect("release");
}
