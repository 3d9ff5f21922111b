use std::time::Duration;

use lock_core::{LossReason, RunOutcome};
use tokio::time::{sleep, Instant};

use super::assert_between;
use crate::Ctx;

/// A job that would run 3 × `max_hold` is cancelled at `max_hold`, the lock
/// is free at once, and renewal stops. Before that, the lease's remaining
/// validity counts the max hold: after renewals it never promises more
/// than the hold has left (a supervisor reading it would stop too late).
pub(super) async fn max_hold_aborts_and_frees(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("watchdog");
    let timing = ctx.timing();
    let max_hold = timing.ttl * 2;
    let opts = ctx.opts().with_max_hold(max_hold);
    let started = Instant::now();
    let outcome = a
        .locker
        .with_lock(&name, &opts, |lease| async move {
            let granted = Instant::now();
            // Renewed by now, so the validity alone reaches past the hold.
            sleep(max_hold * 3 / 4).await;
            let asked = Instant::now();
            let left = lease.remaining_validity().expect("a backed lease");
            let hold_left = (granted + max_hold).saturating_duration_since(asked);
            assert!(
                left <= hold_left,
                "remaining validity {left:?} is past the max hold, {hold_left:?} away"
            );
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
