//! Redis-specific tests of server-side faults: scripts flushed, the server
//! paused (SIGSTOP) or restarted without persistence.

use std::sync::Arc;

use lock_core::{
    backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome, RenewRequest},
    BackendErrorKind, LockBackend, LockName, LossReason, OwnerToken, RenewalOutcome,
};
use lock_redis::RedisBackend;
use tokio::time::{sleep, timeout, Instant};

use super::specific::{ensure, locker_over, lost_within, opts, plain, tracing_line, TOLERANCE};
use super::{config_for, server, RedisFactory, OP_TIMEOUT, TTL};
use crate::harness::ServerProcess;
use crate::BoxError;

pub(super) async fn renewal_survives_script_flush(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let backend = f.config()?.connect().await?;
    let (locker, metrics) = locker_over(Arc::new(backend.clone()))?;
    let mut c = plain(f.url()).await?;
    let name = LockName::new("specific/flush")?;
    let guard = locker.try_lock(&name, &opts()).await?;
    let interval = opts().renew_interval();
    for _ in 0..4 {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut c)
            .await?;
        sleep(interval).await;
    }
    guard.assert_held()?;
    let n = name.as_str();
    ensure(
        metrics.renewals(n, RenewalOutcome::Error) == 0,
        "a renewal failed after SCRIPT FLUSH",
    )?;
    ensure(
        metrics.renewals(n, RenewalOutcome::Renewed) >= 3,
        "renewals stopped after SCRIPT FLUSH",
    )?;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await?;
    guard.release().await?;
    // Every script, straight after a flush: no NOSCRIPT reaches the caller.
    let owner = OwnerToken::generate()?;
    let steps: [&str; 4] = ["acquire", "renew", "renew_many", "release"];
    for step in steps {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut c)
            .await?;
        let ok = match step {
            "acquire" => matches!(
                backend.try_acquire(&name, &owner, TTL).await?,
                AcquireAttempt::Acquired(_)
            ),
            "renew" => backend.renew(&name, &owner, TTL).await? == LeaseStatus::Held,
            "renew_many" => {
                let r = [RenewRequest {
                    name: name.clone(),
                    owner,
                    ttl: TTL,
                }];
                backend.renew_many(&r).await? == [LeaseStatus::Held]
            }
            _ => backend.release(&name, &owner).await? == ReleaseOutcome::Released,
        };
        ensure(
            ok,
            format!("{step} after SCRIPT FLUSH gave the wrong answer"),
        )?;
    }
    Ok(())
}

pub(super) async fn paused_server_gives_timeouts(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let (srv, url, backend) = own_server(&f).await?;
    let (locker, metrics) = locker_over(Arc::new(backend.clone()))?;
    let name = LockName::new("specific/paused")?;
    let before = Instant::now();
    let guard = locker.try_lock(&name, &opts()).await?;
    srv.pause()?;
    let started = Instant::now();
    let err = backend
        .renew(&name, &OwnerToken::generate()?, TTL)
        .await
        .err()
        .ok_or("a call to a paused server succeeded")?;
    let took = started.elapsed();
    ensure(
        err.kind() == BackendErrorKind::Timeout,
        format!("expected a Timeout, got {err}"),
    )?;
    ensure(
        took >= OP_TIMEOUT && took <= OP_TIMEOUT + TOLERANCE,
        format!("the call took {took:?}, the operation timeout is {OP_TIMEOUT:?}"),
    )?;
    let deadline = TTL - opts().drift();
    let reason = timeout(TTL + TOLERANCE, guard.lost())
        .await
        .map_err(|_| "never lost")?;
    let lost_after = before.elapsed();
    srv.resume()?;
    ensure(
        reason == LossReason::BackendError,
        format!("lost as {reason}"),
    )?;
    ensure(
        lost_after <= deadline + TOLERANCE && lost_after + TOLERANCE >= deadline,
        format!("lost after {lost_after:?}, local deadline {deadline:?}"),
    )?;
    ensure(
        metrics.renewals(name.as_str(), RenewalOutcome::Error) >= 1,
        "no renewal failed",
    )?;
    // The server forgot the lease during the pause; another replica gets it.
    let other = connect_at(&f, &url).await?;
    let (b, _) = locker_over(Arc::new(other))?;
    let g = b.lock(&name, &opts().with_acquire_timeout(TTL * 2)).await?;
    g.release().await?;
    tracing_line(&format!(
        "paused server: call timed out after {took:?}, lease lost after {lost_after:?}"
    ));
    Ok(())
}

pub(super) async fn restart_reports_expired(f: Arc<RedisFactory>) -> Result<(), BoxError> {
    let (srv, url, backend) = own_server(&f).await?;
    let (locker, _) = locker_over(Arc::new(backend.clone()))?;
    let name = LockName::new("specific/restart")?;
    let guard = locker.try_lock(&name, &opts()).await?;
    // A waiter on another lock: losing the subscriber connection must wake
    // it (to try again) rather than leave it waiting on a dead subscription.
    let other = LockName::new("specific/restart-waiter")?;
    let signal = backend
        .subscribe_release(&other)
        .await?
        .ok_or("Redis notifies")?;
    sleep(opts().renew_interval() * 3 / 2).await;
    srv.restart()?;
    let took = lost_within(&guard.handle(), TTL + TOLERANCE, LossReason::Expired).await?;
    timeout(TOLERANCE, signal)
        .await
        .map_err(|_| "a waiter slept through the loss of its subscription")?;
    drop(guard);
    let mut c = plain(&url).await?;
    let exists: i64 = redis::cmd("EXISTS")
        .arg(backend.key_for(&name))
        .query_async(&mut c)
        .await?;
    ensure(exists == 0, "the lost key was re-created")?;
    let g = locker.try_lock(&name, &opts()).await?;
    // Without persistence the counter restarts too: the documented limit.
    tracing_line(&format!(
        "restart detected as expired after {took:?}; fencing token after restart {:?}",
        g.fencing_token()
    ));
    g.release().await?;
    Ok(())
}

/// A plain server of the case's own (to pause or restart), its URL, and a
/// backend on it as [`connect_at`] makes.
async fn own_server(f: &RedisFactory) -> Result<(ServerProcess, String, RedisBackend), BoxError> {
    let srv = server::start_plain()?;
    let url = format!("redis://127.0.0.1:{}", srv.port());
    let backend = connect_at(f, &url).await?;
    Ok((srv, url, backend))
}

/// A backend of the test profile on `url`, its keys under `f`'s prefix.
async fn connect_at(f: &RedisFactory, url: &str) -> Result<RedisBackend, BoxError> {
    Ok(config_for(url)?
        .with_key_prefix(f.prefix())
        .connect()
        .await?)
}
