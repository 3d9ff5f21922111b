//! The release-notification waiter table stays O(live waiters): waits that
//! time out or are cancelled, and waits for locks that end without a release
//! announcement (their session ended), leave nothing behind.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use lock_core::{backend::AcquireAttempt, Error, LockBackend, LockOptions, OwnerToken};
use tokio::time::{sleep, timeout, Instant};

use super::specific::{backend_as, locker, name};
use super::{plain_session, terminate, PostgresFactory, TTL};
use crate::BoxError;

/// Waits cancelled after their first poll, on distinct names.
const CANCELLED_WAITS: usize = 100_000;

/// 100,000 waits cancelled on names nobody releases, then `Locker` waits
/// that time out, then a wait for a lock whose holder's session is killed
/// (no `NOTIFY`: the waiter finds it free by polling): after each, the
/// waiter table holds only what live waiters need.
pub(super) async fn release_waiters_stay_bounded(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let holder = backend_as(&f, "postgres").await?;
    let waiter = Arc::new(backend_as(&f, "postgres").await?);
    let held = name(&f, "waited");
    let token = OwnerToken::generate()?;
    if !matches!(
        holder.try_acquire(&held, &token, TTL).await?,
        AcquireAttempt::Acquired(_)
    ) {
        return Err("setup: a fresh name was held".into());
    }

    let live = waiter
        .subscribe_release(&held)
        .await?
        .ok_or("release notification is on by default")?;
    let prefix = name(&f, "cancelled");
    for i in 0..CANCELLED_WAITS {
        let n = lock_core::LockName::new(format!("{prefix}-{i}"))?;
        let mut signal = waiter
            .subscribe_release(&n)
            .await?
            .ok_or("release notification is on by default")?;
        let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut signal).poll(cx))).await;
        if polled.is_ready() {
            return Err(format!("a wait for {n}, never released, completed").into());
        }
    }
    expect_keys(
        &waiter,
        1,
        "after 100,000 cancelled waits, with one live waiter",
    )
    .await?;
    drop(live);
    expect_keys(&waiter, 0, "once the live waiter is gone").await?;

    let lw = locker(waiter.clone())?;
    let short = LockOptions::new(TTL).with_acquire_timeout(Duration::from_millis(30));
    for _ in 0..20 {
        match lw.lock(&held, &short).await {
            Err(Error::Timeout { .. }) => {}
            other => return Err(format!("a wait for a held lock gave {other:?}").into()),
        }
    }
    expect_keys(&waiter, 0, "after 20 timed-out Locker waits").await?;

    // The holder's session ends: its lock is freed without a NOTIFY.
    let wait = LockOptions::new(TTL).with_acquire_timeout(TTL * 4);
    let (lw2, held2) = (lw.clone(), held.clone());
    let pending = tokio::spawn(async move { lw2.lock(&held2, &wait).await });
    let registered_by = Instant::now() + Duration::from_secs(5);
    while waiter.release_waiter_keys().await == 0 {
        if Instant::now() >= registered_by || pending.is_finished() {
            return Err("the waiting acquire never subscribed".into());
        }
        sleep(Duration::from_millis(10)).await;
    }
    let url = tokio::task::block_in_place(|| f.url())?;
    let killer = plain_session(&url, f.application_name()).await?;
    terminate(&killer, holder.session_pid().await?).await?;
    let guard = timeout(TTL * 5, pending)
        .await
        .map_err(|_| "the waiter did not finish")??
        .map_err(|e| format!("the waiter did not get the freed lock: {e}"))?;
    expect_keys(&waiter, 0, "after a wait for a lock that ended unannounced").await?;
    guard.release().await?;
    Ok(())
}

async fn expect_keys(
    backend: &lock_postgres::PostgresBackend,
    want: usize,
    when: &str,
) -> Result<(), BoxError> {
    let got = backend.release_waiter_keys().await;
    if got == want {
        Ok(())
    } else {
        Err(format!("{when}: {got} keys in the waiter table, expected {want}").into())
    }
}
