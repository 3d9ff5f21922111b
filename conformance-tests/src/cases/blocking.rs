use std::time::Duration;

use lock_core::{Error, LockGuard, LockName};
use tokio::time::{sleep, Instant};

use super::assert_between;
use crate::{Ctx, Replica};

/// Takes the free lock `name` through `holder`'s Locker with the case's
/// options: the holder every waiter in these cases queues behind.
async fn take_free(ctx: &Ctx, holder: &Replica, name: &LockName) -> LockGuard {
    holder
        .locker
        .try_lock(name, &ctx.opts())
        .await
        .expect("free lock")
}

/// A waiter gets the lock promptly after the holder releases it.
pub(super) async fn blocking_acquire_wakes_on_release(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("handoff");
    let timing = ctx.timing();
    let guard = take_free(&ctx, &a, &name).await;
    let waiter = {
        let (locker, name) = (b.locker.clone(), name.clone());
        let opts = ctx.opts().with_acquire_timeout(timing.ttl * 10);
        tokio::spawn(async move {
            let g = locker.lock(&name, &opts).await;
            (Instant::now(), g)
        })
    };
    sleep(timing.ttl).await;
    assert!(!waiter.is_finished(), "the waiter acquired a held lock");
    let released_at = Instant::now();
    guard.release().await.expect("release");
    let (acquired_at, g) = waiter.await.expect("waiter");
    let g = g.expect("the waiter acquires after release");
    // Notification makes this immediate; polling takes at most one backoff step (≤ ttl/8).
    let bound = if ctx.factory().capabilities().release_notify {
        timing.tolerance
    } else {
        timing.ttl / 8 + timing.tolerance
    };
    assert_between("handoff", acquired_at - released_at, Duration::ZERO, bound);
    g.release().await.expect("release");
}

/// A waiter gives up at its timeout, on time.
pub(super) async fn blocking_acquire_times_out(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("timeout");
    let timing = ctx.timing();
    let guard = take_free(&ctx, &a, &name).await;
    let timeout = Duration::from_millis(200);
    let started = Instant::now();
    match b
        .locker
        .lock(&name, &ctx.opts().with_acquire_timeout(timeout))
        .await
    {
        Err(Error::Timeout { waited, .. }) => assert!(waited >= timeout),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_between(
        "acquire timeout",
        started.elapsed(),
        timeout,
        timeout + timing.tolerance,
    );
    guard.release().await.expect("release");
}

/// Dropping a waiting acquire leaves nothing behind: once the holder
/// releases, anyone (including the cancelled replica) acquires at once.
pub(super) async fn cancelled_acquire_leaves_nothing(ctx: Ctx) {
    let (a, b, c) = (
        ctx.replica().await,
        ctx.replica().await,
        ctx.replica().await,
    );
    let name = ctx.name("cancelled");
    let timing = ctx.timing();
    let guard = take_free(&ctx, &a, &name).await;
    let opts = ctx.opts();
    let waiting = b.locker.lock(&name, &opts);
    assert!(
        tokio::time::timeout(timing.ttl / 2, waiting).await.is_err(),
        "acquired a held lock"
    );
    guard.release().await.expect("release");
    // Give a stray background acquire, if there were one, the time to land.
    sleep(timing.ttl / 2).await;
    c.assert_free_now("no residue from the cancelled waiter", &name, &ctx)
        .await;
    b.assert_free_now("the cancelled replica's local claim is gone", &name, &ctx)
        .await;
    super::no_warnings_after(&b, &[name], "a given-up waiting acquire").await;
}
