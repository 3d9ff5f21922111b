//! The release-notification waiter table stays O(live waiters): waits that
//! time out or are cancelled, and waits for locks that end without a release
//! announcement (their session ended), leave nothing behind. A release is
//! announced only while someone waits for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use lock_core::{Error, LockBackend, LockOptions, OwnerToken};
use tokio::time::{sleep, timeout, Instant};

use super::specific::{acquire_free, backend_as, locker, name};
use super::{plain_session, terminate, PostgresFactory, TTL};
use crate::BoxError;

/// Waits cancelled after their first poll, on distinct names.
// Enough to show the table does not grow with cancelled waits (each one
// would leave a key if it leaked); 100,000 took 70 s alone in a debug build
// and over the case's 150 s bound with the whole suite running beside it.
const CANCELLED_WAITS: usize = 20_000;

/// 20,000 waits cancelled on names nobody releases, then `Locker` waits
/// that time out, then a wait for a lock whose holder's session is killed
/// (no `NOTIFY`: the waiter finds it free by polling): after each, the
/// waiter table holds only what live waiters need.
pub(super) async fn release_waiters_stay_bounded(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let holder = backend_as(&f, "postgres").await?;
    let waiter = Arc::new(backend_as(&f, "postgres").await?);
    let held = name(&f, "waited");
    let token = OwnerToken::generate()?;
    acquire_free(&holder, &held, &token, "setup: a fresh name was held").await?;

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
        "after 20,000 cancelled waits, with one live waiter",
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
    terminate(&killer, holder.lock_session_pid(&held).await?).await?;
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

/// A plain session listening on the release channel, and what it hears.
async fn eavesdrop(
    url: &str,
) -> Result<
    (
        tokio_postgres::Client,
        tokio::sync::mpsc::UnboundedReceiver<String>,
    ),
    BoxError,
> {
    let (client, mut conn) = url
        .parse::<tokio_postgres::Config>()?
        .connect_timeout(Duration::from_secs(5))
        .connect(tokio_postgres::NoTls)
        .await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(m)) = std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = m {
                let _ = tx.send(n.payload().to_owned());
            }
        }
    });
    client.batch_execute("LISTEN lock_release").await?;
    Ok((client, rx))
}

/// What the eavesdropper heard of `payload` by the end of a round trip
/// after the release (a notification committed before it is delivered by
/// then), and a moment more. Other trials' releases on the same server are
/// passed over.
async fn heard(
    client: &tokio_postgres::Client,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    payload: &str,
) -> Result<usize, BoxError> {
    client.batch_execute("SELECT 1").await?;
    let mut got = 0;
    while let Ok(Some(p)) = timeout(Duration::from_millis(200), rx.recv()).await {
        got += usize::from(p == payload);
    }
    Ok(got)
}

/// `NOTIFY` serialises the server's notifying commits, so a release pays
/// for it only while someone waits: a plain listener hears nothing of a
/// release nobody waits for, hears the one a waiter waits for (and the
/// waiter wakes), and nothing again once that waiter is gone.
pub(super) async fn release_is_announced_only_while_waited_for(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let holder = backend_as(&f, "postgres").await?;
    let waiter = backend_as(&f, "postgres").await?;
    let url = tokio::task::block_in_place(|| f.url())?;
    let (ear, mut rx) = eavesdrop(&url).await?;
    let n = name(&f, "announced");
    let key = holder.config().key_for(&n);
    let payload = format!("{}:{}", key.key1, key.key2);
    let cycle = || async {
        let token = OwnerToken::generate()?;
        acquire_free(&holder, &n, &token, "the lock was not free").await?;
        Ok::<_, BoxError>(token)
    };

    let token = cycle().await?;
    holder.release(&n, &token).await?;
    if heard(&ear, &mut rx, &payload).await? != 0 {
        return Err("a release nobody waited for was announced".into());
    }

    let token = cycle().await?;
    let signal = waiter
        .subscribe_release(&n)
        .await?
        .ok_or("release notification is on by default")?;
    holder.release(&n, &token).await?;
    let got = heard(&ear, &mut rx, &payload).await?;
    if got != 1 {
        return Err(format!("a waited-for release was heard {got} times").into());
    }
    timeout(Duration::from_secs(5), signal)
        .await
        .map_err(|_| "the waiter was not woken by the release")?;

    // The waiter's marker goes back once its entry is gone.
    let marker = waiter.release_wait_marker(&n);
    let back_by = Instant::now() + Duration::from_secs(5);
    loop {
        let row = ear
            .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&marker])
            .await?;
        if row.get::<_, bool>(0) {
            break;
        }
        if Instant::now() >= back_by {
            return Err("the waiter's marker was still held 5 s after its wait".into());
        }
        sleep(Duration::from_millis(20)).await;
    }
    let token = cycle().await?;
    holder.release(&n, &token).await?;
    if heard(&ear, &mut rx, &payload).await? != 0 {
        return Err("a release after the wait ended was announced".into());
    }
    Ok(())
}
