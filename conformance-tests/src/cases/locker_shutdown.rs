//! `Locker::shutdown`: every lease ends and is released before it returns,
//! nothing is acquired after it, and a slow backend cannot hold it past its
//! deadline.

use std::time::Duration;

use lock_core::backend::Expiry;
use lock_core::{Error, LossReason};
use tokio::time::{timeout, Instant};

use crate::faulty::Fault;
use crate::Ctx;

/// Held guards, a guard dropped just before (its release only queued), a
/// retained hold and a guarded run in progress: after `shutdown` returns
/// every lock is free on the server (a retained one on session backends),
/// every handle says the lease ended, the run was stopped, and the `Locker`
/// and its clones acquire nothing more.
pub(super) async fn locker_shutdown_releases_every_lease(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let timing = ctx.timing();
    let bound = timing.ttl / 2 + timing.tolerance;
    let held = ctx.name("held");
    let dropped = ctx.name("dropped");
    let running = ctx.name("running");
    let guard = a.locker.try_lock(&held, &ctx.opts()).await.expect("free");
    let handle = guard.handle();
    drop(
        a.locker
            .try_lock(&dropped, &ctx.opts())
            .await
            .expect("free"),
    );
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let job = {
        let (locker, name, opts) = (a.locker.clone(), running.clone(), ctx.opts());
        tokio::spawn(async move {
            locker
                .with_lock(&name, &opts, |_lease| async move {
                    let _ = started_tx.send(());
                    std::future::pending::<()>().await;
                })
                .await
        })
    };
    timeout(bound, started)
        .await
        .expect("the guarded run started")
        .expect("job alive");

    // A hold retained past the shutdown ends with it (released at once on
    // a session backend; a TTL server keeps the mark for the hold).
    let kept = ctx.name("kept");
    let kept_guard = a.locker.try_lock(&kept, &ctx.opts()).await.expect("free");
    let kept_handle = kept_guard.handle();
    kept_guard.retain_for(timing.ttl * 2).await.expect("retain");

    let began = Instant::now();
    timeout(bound * 2, a.locker.shutdown(bound))
        .await
        .expect("shutdown returned by its deadline")
        .expect("every release finished");
    let took = began.elapsed();

    assert!(!handle.is_held(), "a held guard's handle still says held");
    assert_eq!(
        kept_handle.loss_reason(),
        Some(LossReason::Released),
        "a retained hold outlived the shutdown"
    );
    if a.backend.capabilities().expiry == Expiry::Session {
        b.takes_at_once("a retained lock on a session backend", &kept, &ctx)
            .await;
    }
    assert_eq!(handle.loss_reason(), Some(LossReason::Released));
    let outcome = timeout(bound, job)
        .await
        .expect("the guarded run was stopped")
        .expect("job task")
        .expect("valid input");
    assert!(
        !outcome.is_completed(),
        "a never-ending run completed: {outcome:?}"
    );
    for (what, name) in [
        ("a held guard", &held),
        ("a dropped guard", &dropped),
        ("a guarded run", &running),
    ] {
        b.takes_at_once(what, name, &ctx).await;
    }
    let later = ctx.name("later");
    for locker in [&a.locker, &a.locker.clone()] {
        let r = locker.try_lock(&later, &ctx.opts()).await;
        assert!(matches!(r, Err(Error::ShutDown { .. })), "{r:?}");
    }
    let r = a.locker.lock(&later, &ctx.opts()).await;
    assert!(matches!(r, Err(Error::ShutDown { .. })), "{r:?}");
    // The guard outlived the shutdown: releasing or dropping it is harmless.
    let r = guard.release().await;
    assert!(
        matches!(
            r,
            Err(Error::LockLost {
                reason: LossReason::Released,
                ..
            })
        ),
        "{r:?}"
    );
    println!("shutdown released 3 leases in {took:?}");
}

/// A release slower than the deadline: `shutdown` returns an error at the
/// deadline instead of waiting, and the lease still ended locally.
pub(super) async fn locker_shutdown_is_bounded_by_its_deadline(ctx: Ctx) {
    let timing = ctx.timing();
    let stall = timing.ttl * 4;
    let (faulty, a) = super::faulty_replica(&ctx, stall).await;
    let name = ctx.name("slow");
    let guard = a.locker.try_lock(&name, &ctx.opts()).await.expect("free");
    let handle = guard.handle();
    faulty.set(Fault::StallReleases);
    let deadline = timing.ttl / 4;
    let began = Instant::now();
    let r = timeout(
        deadline + timing.tolerance + Duration::from_secs(1),
        a.locker.shutdown(deadline),
    )
    .await
    .expect("shutdown waited past its deadline");
    let took = began.elapsed();
    assert!(
        matches!(&r, Err(Error::Backend(e)) if e.to_string().contains("still running")),
        "{r:?}"
    );
    assert!(took >= deadline, "returned before its deadline: {took:?}");
    assert!(!handle.is_held(), "the lease still says held");
    drop(guard);
    faulty.set(Fault::None);
}
