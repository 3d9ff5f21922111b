use lock_core::{AcquireOutcome, LossReason, RenewalOutcome};
use tokio::time::sleep;

use crate::Ctx;

/// Each outcome moves exactly its own counter and label.
pub(super) async fn metrics_track_outcomes(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let saboteur = ctx.saboteur().await;
    let name = ctx.name("metered");
    let n = name.as_str();
    let opts = ctx.opts();

    let guard = a.locker.try_lock(&name, &opts).await.expect("free lock");
    assert_eq!(a.metrics.acquisitions(n, AcquireOutcome::Acquired), 1);
    assert_eq!(a.metrics.held(n), 1);
    assert!(b.locker.try_lock(&name, &opts).await.is_err());
    assert_eq!(b.metrics.acquisitions(n, AcquireOutcome::HeldElsewhere), 1);
    assert_eq!(b.metrics.acquisitions(n, AcquireOutcome::Acquired), 0);
    assert!(a.locker.try_lock(&name, &opts).await.is_err());
    assert_eq!(a.metrics.acquisitions(n, AcquireOutcome::HeldLocally), 1);
    assert_eq!(a.metrics.acquisitions(n, AcquireOutcome::HeldElsewhere), 0);

    sleep(opts.renew_interval() * 3 / 2).await;
    assert_eq!(a.metrics.renewals(n, RenewalOutcome::Renewed), 1);
    guard.release().await.expect("release");
    assert_eq!(a.metrics.held(n), 0);
    assert_eq!(a.metrics.holds_ended(n), 1);

    let labelled = opts.clone().with_metric_label("job-label");
    let guard = a
        .locker
        .try_lock(&name, &labelled)
        .await
        .expect("free lock");
    assert_eq!(
        a.metrics
            .acquisitions("job-label", AcquireOutcome::Acquired),
        1
    );
    saboteur
        .steal(&name, ctx.timing().ttl * 20)
        .await
        .expect("steal");
    let (seen_as, renewal) = super::theft_seen_as(&ctx);
    assert_eq!(guard.lost().await, seen_as);
    assert_eq!(a.metrics.losses("job-label", seen_as), 1);
    assert_eq!(
        a.metrics.renewals("job-label", RenewalOutcome::Stolen),
        u64::from(renewal.is_some())
    );
    assert_eq!(
        a.metrics.held("job-label"),
        0,
        "a lost lease is no longer held"
    );
    for reason in [
        LossReason::Stolen,
        LossReason::Expired,
        LossReason::BackendError,
        LossReason::MaxHoldExceeded,
    ] {
        if reason != seen_as {
            assert_eq!(a.metrics.losses("job-label", reason), 0);
        }
    }
    assert_eq!(
        a.metrics.acquisitions(n, AcquireOutcome::Acquired),
        1,
        "the label moved, not the name"
    );
    drop(guard);
    saboteur.clear(&name).await.expect("cleanup");
}
