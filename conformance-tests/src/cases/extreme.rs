//! Extreme durations: "forever" and "nothing" never panic, never overflow a
//! clock, and never leave a lock held.

use std::time::Duration;

use lock_core::backend::{AcquireAttempt, RenewRequest};
use lock_core::{Error, LockOptions, OwnerToken, RunOutcome};
use tokio::time::timeout;

use crate::Ctx;

const HUGE: [Duration; 3] = [
    Duration::MAX,
    Duration::from_millis(u64::MAX),
    Duration::from_secs(u64::MAX / 2),
];

/// `Duration::MAX` and friends as TTL, max hold, acquire timeout, renewal
/// interval and retained hold: refused with a clear error or taken as "no
/// limit"; no panic, and nothing is left held.
pub(super) async fn extreme_durations_never_panic_or_leak(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    let bound = timing.ttl + timing.tolerance;
    let name = ctx.name("extreme");
    for huge in HUGE {
        // A TTL that long is refused before anything reaches the server.
        let r = a.locker.try_lock(&name, &LockOptions::new(huge)).await;
        assert!(matches!(r, Err(Error::Config(_))), "TTL {huge:?}: {r:?}");
        let r = a.locker.lock(&name, &LockOptions::new(huge)).await;
        assert!(matches!(r, Err(Error::Config(_))), "TTL {huge:?}: {r:?}");
        let opts = ctx.opts().with_renew_interval(huge);
        let r = a.locker.try_lock(&name, &opts).await;
        assert!(
            matches!(r, Err(Error::Config(_))),
            "interval {huge:?}: {r:?}"
        );

        // max_hold "forever" is no watchdog.
        let opts = ctx.opts().with_max_hold(huge);
        let g = a.locker.try_lock(&name, &opts).await.expect("max_hold");
        assert!(g.is_held(), "max_hold {huge:?}: not held");
        g.release().await.expect("release");
        let out = a
            .locker
            .with_lock(&name, &opts, |lease| async move { lease.assert_held() })
            .await
            .expect("valid input");
        assert!(
            matches!(out, RunOutcome::Completed(Ok(()))),
            "with_lock, max_hold {huge:?}: {out:?}"
        );

        // An acquire timeout "forever" waits without a deadline.
        let opts = ctx.opts().with_acquire_timeout(huge);
        let g = a.locker.lock(&name, &opts).await.expect("free lock");
        let waiting = timeout(timing.ttl / 4, b.locker.lock(&name, &opts)).await;
        assert!(waiting.is_err(), "a held lock was granted: {waiting:?}");
        g.release().await.expect("release");

        // A retained hold that long is refused, and the lock released. The
        // waiter cancelled above may have had an attempt in flight that took
        // the lock after the release (Postgres runs a statement whose caller
        // went away); its cleanup gives it back in the background, so wait.
        let free = ctx.opts().with_acquire_timeout(bound);
        let g = a.locker.lock(&name, &free).await.expect("free");
        let r = g.retain_for(huge).await;
        assert!(matches!(r, Err(Error::Config(_))), "retain {huge:?}: {r:?}");
        // A refused `retain_for` has released the lock by the time it returns.
        a.takes_at_once(&format!("retain {huge:?}"), &name, &ctx)
            .await;
        b.assert_free(&format!("retain {huge:?}"), &name, &ctx, bound)
            .await;
    }
    for tiny in [Duration::ZERO, Duration::from_nanos(1)] {
        for opts in [
            LockOptions::new(tiny),
            ctx.opts().with_renew_interval(tiny),
            ctx.opts().with_max_hold(tiny),
        ] {
            let r = a.locker.try_lock(&name, &opts).await;
            assert!(matches!(r, Err(Error::Config(_))), "{opts:?}: {r:?}");
        }
        // A zero wait is one attempt.
        let opts = ctx.opts().with_acquire_timeout(tiny);
        let g = a.locker.lock(&name, &opts).await.expect("free lock");
        let r = b.locker.lock(&name, &opts).await;
        assert!(
            matches!(r, Err(Error::Timeout { .. } | Error::HeldElsewhere { .. })),
            "wait {tiny:?} on a held lock: {r:?}"
        );
        let r = g.retain_for(tiny).await;
        if tiny.is_zero() {
            assert!(matches!(r, Err(Error::Config(_))), "retain 0: {r:?}");
            a.takes_at_once("retain 0", &name, &ctx).await;
        }
        b.assert_free(&format!("retain {tiny:?}"), &name, &ctx, bound)
            .await;
    }
}

/// The same durations straight through the `LockBackend` trait, as a
/// backend author's or a wrapper's caller would pass them: every call
/// answers (a refusal or a result) without a panic, and nothing is left held.
pub(super) async fn extreme_durations_through_the_trait(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    let bound = timing.ttl + timing.tolerance;
    let name = ctx.name("extreme-trait");
    let backend = &a.backend;
    for d in HUGE
        .into_iter()
        .chain([Duration::ZERO, Duration::from_nanos(1)])
    {
        let owner = OwnerToken::generate().expect("a token");
        if let Ok(AcquireAttempt::Acquired(_)) = backend.try_acquire(&name, &owner, d).await {
            backend
                .release(&name, &owner)
                .await
                .unwrap_or_else(|e| panic!("release after an acquire for {d:?}: {e}"));
        }
        b.assert_free(&format!("acquire for {d:?}"), &name, &ctx, bound)
            .await;

        let owner = OwnerToken::generate().expect("a token");
        let taken = backend.try_acquire(&name, &owner, timing.ttl).await;
        assert!(
            matches!(taken, Ok(AcquireAttempt::Acquired(_))),
            "{d:?}: {taken:?}"
        );
        let _ = backend.renew(&name, &owner, d).await;
        let request = RenewRequest {
            name: name.clone(),
            owner,
            ttl: d,
        };
        let _ = backend.renew_many(std::slice::from_ref(&request)).await;
        backend
            .release(&name, &owner)
            .await
            .unwrap_or_else(|e| panic!("release after a renewal for {d:?}: {e}"));
        b.assert_free(&format!("renewal for {d:?}"), &name, &ctx, bound)
            .await;
    }
}
