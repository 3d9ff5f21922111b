use std::time::Duration;

use lock_core::{LossReason, RunOutcome};
use tokio::time::{sleep, Instant};

use super::assert_between;
use crate::Ctx;

/// A job that would run 3 × `max_hold` is cancelled at `max_hold`, the lock
/// is free at once, and renewal stops.
pub(super) async fn max_hold_aborts_and_frees(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("watchdog");
    let timing = ctx.timing();
    let max_hold = timing.ttl * 2;
    let opts = ctx.opts().with_max_hold(max_hold);
    let started = Instant::now();
    let outcome = a
        .locker
        .with_lock(&name, &opts, |_lease| async move {
            sleep(max_hold * 3).await;
        })
        .await
        .expect("valid input");
    let aborted_after = started.elapsed();
    match outcome {
        RunOutcome::Aborted(LossReason::MaxHoldExceeded) => {}
        other => panic!("expected Aborted(max_hold_exceeded), got {other:?}"),
    }
    assert_between(
        "watchdog abort",
        aborted_after,
        max_hold,
        max_hold + timing.tolerance,
    );
    // Released at once, not at TTL expiry: a waiter gets it within the tolerance
    // plus one backoff step.
    let free_opts = ctx
        .opts()
        .with_acquire_timeout(timing.tolerance + Duration::from_millis(600));
    let g = b
        .locker
        .lock(&name, &free_opts)
        .await
        .expect("the lock is free right after the watchdog");
    let renewals_at_abort = a
        .metrics
        .renewals(name.as_str(), lock_core::RenewalOutcome::Renewed);
    sleep(timing.ttl).await;
    assert_eq!(
        a.metrics
            .renewals(name.as_str(), lock_core::RenewalOutcome::Renewed),
        renewals_at_abort,
        "renewal continued after the watchdog fired"
    );
    assert_eq!(
        a.metrics.losses(name.as_str(), LossReason::MaxHoldExceeded),
        1
    );
    g.release().await.expect("release");
}
