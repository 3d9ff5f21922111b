//! Every lease of a process lives on one of its lock sessions, and when
//! that session ends the server frees all of its locks at once. These trials check
//! that no lease on it still says "held" by the time another replica can
//! take its name: after a release that failed, and after the connection died.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, ReleaseOutcome},
    LeaseHandle, LockBackend, LockName, LockOptions, LossReason, OwnerToken, RunOutcome,
};
use lock_postgres::PostgresBackend;
use tokio::time::{sleep, timeout, Instant};

use super::server::ROLE_IDLER;
use super::specific::{acquire_free, add, backend_as, hold, locker, name};
use super::{plain_session, terminate, PostgresFactory, OP_TIMEOUT, TTL};
use crate::proxy::FaultProxy;
use crate::{BoxError, Suite};

/// The trials of this module.
pub(super) fn register(suite: &mut Suite, f: &Arc<PostgresFactory>) {
    let table = crate::trial_table![
        "terminate_backend_aborts_the_job" => terminate_backend_aborts_the_job,
        "idle_session_timeout_is_detected" => idle_session_timeout_is_detected,
        "slow_release_keeps_the_session" => slow_release_keeps_the_session,
        "second_release_answers_after_the_first" => second_release_answers_after_the_first,
        "failed_unlock_ends_the_session_after_its_leases" => failed_unlock_ends_the_session_after_its_leases,
        "session_end_marks_every_lease_lost_first" => session_end_marks_every_lease_lost_first,
    ];
    add(suite, f, &table);
}

/// How long a failed release may take to settle in the background: its
/// unlock, waited for twice the statement timeout, and one more attempt.
const SETTLE: Duration = Duration::from_millis(3 * OP_TIMEOUT.as_millis() as u64 + 500);

/// Another replica tries to take every name until it has them all or
/// `until` passes. Whenever it gets one, the lease that held that name must
/// already report lost: otherwise two holders believed they held it at
/// once. Returns which names it took (it releases them).
async fn take_over(
    other: &PostgresBackend,
    leases: &[(LockName, LeaseHandle)],
    until: Instant,
) -> Result<Vec<bool>, BoxError> {
    let token = OwnerToken::generate()?;
    let mut taken = vec![false; leases.len()];
    while Instant::now() < until && taken.iter().any(|t| !t) {
        for (i, (n, lease)) in leases.iter().enumerate() {
            if taken[i] {
                continue;
            }
            if let AcquireAttempt::Acquired(_) = other.try_acquire(n, &token, TTL).await? {
                if lease.is_held() {
                    return Err(format!(
                        "another replica took {n} while its lease here still said held"
                    )
                    .into());
                }
                taken[i] = true;
            }
        }
        sleep(Duration::from_millis(2)).await;
    }
    for ((n, _), t) in leases.iter().zip(&taken) {
        if *t {
            other.release(n, &token).await?;
        }
    }
    Ok(taken)
}

/// Two leases A and B on one backend's session; A's release stops waiting
/// for its unlock at once, as a client-side statement timeout on a slow but
/// healthy server does. B must never say "held" while another replica can
/// take its name. The session is kept: B stays held and renewed, and A's
/// name is freed once its unlock completes, within the settle bound.
async fn slow_release_keeps_the_session(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let p = Arc::new(backend_as(&f, "postgres").await?);
    let q = backend_as(&f, "postgres").await?;
    let lp = locker(p.clone())?;
    let opts = LockOptions::new(TTL);
    let (na, nb) = (name(&f, "slow-release-a"), name(&f, "slow-release-b"));
    let a = lp.try_lock(&na, &opts).await?;
    let b = lp.try_lock(&nb, &opts).await?;
    let pid = p.lock_session_pid(&na).await?;
    p.stall_next_release(&na);
    if a.release().await.is_ok() {
        return Err("a release that stopped waiting reported success".into());
    }
    let watched = [(nb.clone(), b.handle())];
    let taken = take_over(&q, &watched, Instant::now() + SETTLE).await?;
    if taken[0] {
        return Err("B's lock was freed by a release of A (B did report lost first)".into());
    }
    b.handle()
        .assert_held()
        .map_err(|e| format!("B was lost over A's slow release: {e}"))?;
    if p.lock_session_pid(&na).await? != pid {
        return Err("the lock session was replaced over a slow release".into());
    }
    if !freed_by(&q, &na, Instant::now() + SETTLE).await? {
        return Err(format!("A's lock was still held {SETTLE:?} after its slow release").into());
    }
    b.release().await?;
    Ok(())
}

/// A second release of a lock whose first release stopped waiting for its
/// slow unlock (as a `Locker` sends when its caller gives up a release)
/// waits for that unlock and answers `NotHeld`: the first one freed it, so
/// another replica takes the name at its first try. It is no error, so
/// nothing warns that the lock was left to its TTL.
async fn second_release_answers_after_the_first(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let p = backend_as(&f, "postgres").await?;
    let q = backend_as(&f, "postgres").await?;
    let n = name(&f, "second-release");
    let owner = OwnerToken::generate()?;
    acquire_free(&p, &n, &owner, "setup: the name was not free").await?;
    p.stall_next_release(&n);
    p.delay_next_unlock(&n, OP_TIMEOUT / 2);
    if p.release(&n, &owner).await.is_ok() {
        return Err("a release that stopped waiting reported success".into());
    }
    let second = timeout(SETTLE, p.release(&n, &owner))
        .await
        .map_err(|_| format!("a second release did not answer within {SETTLE:?}"))?
        .map_err(|e| format!("a second release while the first finishes failed: {e}"))?;
    if second != ReleaseOutcome::NotHeld {
        return Err(format!("a second release answered {second:?}, not NotHeld").into());
    }
    let token = OwnerToken::generate()?;
    match q.try_acquire(&n, &token, TTL).await? {
        AcquireAttempt::Acquired(_) => q.release(&n, &token).await?,
        _ => return Err("the name was still held when the second release answered".into()),
    };
    Ok(())
}

/// Whether another replica can take `n` before `until` (it releases it).
async fn freed_by(other: &PostgresBackend, n: &LockName, until: Instant) -> Result<bool, BoxError> {
    let token = OwnerToken::generate()?;
    loop {
        if let AcquireAttempt::Acquired(_) = other.try_acquire(n, &token, TTL).await? {
            other.release(n, &token).await?;
            return Ok(true);
        }
        if Instant::now() >= until {
            return Ok(false);
        }
        sleep(Duration::from_millis(10)).await;
    }
}

/// A's unlock fails twice (its attempt and the bounded retry): the lock
/// state of the session is unknown, so the backend ends it, and must first
/// mark every lease on it lost (`backend_error`): B says lost before
/// another replica can take its name, and both names are free once the
/// session is gone.
async fn failed_unlock_ends_the_session_after_its_leases(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let p = Arc::new(backend_as(&f, "postgres").await?);
    let q = backend_as(&f, "postgres").await?;
    let lp = locker(p.clone())?;
    let opts = LockOptions::new(TTL);
    let na = name(&f, "failed-unlock-a");
    // B on A's lock session: ending that session must take B with it.
    let pid = p.lock_session_pid(&na).await?;
    let mut nb = name(&f, "failed-unlock-b");
    for _ in 0..256 {
        if p.lock_session_pid(&nb).await? == pid {
            break;
        }
        nb = name(&f, "failed-unlock-b");
    }
    if p.lock_session_pid(&nb).await? != pid {
        return Err("setup: no second name found on A's lock session".into());
    }
    let a = lp.try_lock(&na, &opts).await?;
    let b = lp.try_lock(&nb, &opts).await?;
    let handles = [(na.clone(), a.handle()), (nb.clone(), b.handle())];
    p.fail_next_unlocks(&na, 2);
    if a.release().await.is_ok() {
        return Err("a release whose unlock failed reported success".into());
    }
    let taken = take_over(&q, &handles, Instant::now() + SETTLE).await?;
    if taken != [true, true] {
        return Err(format!("names freed after the session ended: {taken:?}").into());
    }
    match b.handle().loss_reason() {
        Some(LossReason::BackendError) => {}
        other => return Err(format!("B's lease ended as {other:?}").into()),
    }
    if b.release().await.is_ok() {
        return Err("B's release succeeded after its session was ended".into());
    }
    Ok(())
}

/// The lock session dies under three leases: killed by
/// `pg_terminate_backend` from another session, then (a fresh session)
/// reset by the proxy its connection runs through. As soon as the server
/// shows the session gone (its locks are free), another replica tries the
/// names; each lease must already say lost (`expired`) when it gets that
/// name, and it gets them all.
///
/// Why not try from the very instant of the fault: the server tells the
/// session it is ending before it frees the locks, but a replica in this
/// same process polling without pause can have its grant arrive within the
/// same fraction of a millisecond, and the runtime may run that task first.
/// Waiting for the server's own word that the session is gone gives the
/// holder's connection one round trip to be read, and nothing more: a
/// backend that learns of the end at its next renewal (up to a third of the
/// TTL later) still fails.
async fn session_end_marks_every_lease_lost_first(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let port = tokio::task::block_in_place(|| f.private_started())?.port();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    let killer = plain_session(&url, f.application_name()).await?;
    let q = backend_as(&f, "postgres").await?;
    let opts = LockOptions::new(TTL);
    for kind in ["pg_terminate_backend", "proxy reset"] {
        let p = if kind == "proxy reset" {
            let via = format!("postgres://postgres@{}/postgres", proxy.addr());
            Arc::new(f.builder_for(&via)?.connect().await?)
        } else {
            Arc::new(backend_as(&f, "postgres").await?)
        };
        let lp = locker(p.clone())?;
        let mut guards = Vec::new();
        let mut handles = Vec::new();
        for i in 0..3 {
            let n = name(&f, &format!("session-end-{i}"));
            let g = lp.try_lock(&n, &opts).await?;
            handles.push((n, g.handle()));
            guards.push(g);
        }
        // Every lock session that holds one of them ends.
        let mut pids = Vec::new();
        for (n, _) in &handles {
            let pid = p.lock_session_pid(n).await?;
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
        if kind == "proxy reset" {
            proxy.reset_all();
        } else {
            for pid in &pids {
                killer
                    .execute("SELECT pg_terminate_backend($1)", &[pid])
                    .await?;
            }
        }
        for pid in pids {
            wait_gone(&killer, pid, Duration::from_secs(5))
                .await
                .map_err(|e| format!("{kind}: {e}"))?;
        }
        let taken = take_over(&q, &handles, Instant::now() + Duration::from_secs(5))
            .await
            .map_err(|e| format!("{kind}: {e}"))?;
        if taken.iter().any(|t| !t) {
            return Err(format!("{kind}: names freed: {taken:?}").into());
        }
        for (n, h) in &handles {
            if h.loss_reason() != Some(LossReason::Expired) {
                return Err(format!("{kind}: {n} ended as {:?}", h.loss_reason()).into());
            }
        }
        for g in guards {
            let _ = g.release().await;
        }
    }
    Ok(())
}

/// Polls (every millisecond) until server process `pid` has left
/// `pg_stat_activity`.
async fn wait_gone(
    inspector: &tokio_postgres::Client,
    pid: i32,
    within: Duration,
) -> Result<(), BoxError> {
    let give_up = Instant::now() + within;
    while inspector
        .query_opt("SELECT 1 FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await?
        .is_some()
    {
        if Instant::now() >= give_up {
            return Err(format!("session {pid} still there after {within:?}").into());
        }
        sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Kills our lock session with `pg_terminate_backend`, another session then
/// takes the lock; the job must have been told before that (the session's
/// end is pushed, not found by the next renewal), and abort within one
/// renewal interval at the very latest. Prints the measured latency from
/// the kill to the abort.
async fn terminate_backend_aborts_the_job(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let url = tokio::task::block_in_place(|| f.url())?;
    let killer = plain_session(&url, f.application_name()).await?;
    let interval = LockOptions::new(TTL).renew_interval();
    let bound = interval + Duration::from_millis(400);
    let mut latencies = Vec::new();
    for round in 0..8u32 {
        let a = Arc::new(backend_as(&f, "postgres").await?);
        let b = Arc::new(backend_as(&f, "postgres").await?);
        let (la, lb) = (locker(a.clone())?, locker(b.clone())?);
        let n = name(&f, "terminated");
        let (lease, run) = hold(&la, &n).await?;
        // Spread the kills over the renewal cycle.
        sleep(Duration::from_millis(100 + u64::from(round) * 61)).await;
        let pid = a.lock_session_pid(&n).await?;
        let killed_at = Instant::now();
        terminate(&killer, pid).await?;
        let successor = lb.try_lock(&n, &LockOptions::new(TTL)).await?;
        if lease.is_held() {
            return Err(format!(
                "round {round}: another session got the lock while the killed session's lease \
                 still said held"
            )
            .into());
        }
        let reason = timeout(bound * 2, lease.lost())
            .await
            .map_err(|_| format!("round {round}: the job was not told within {:?}", bound * 2))?;
        let latency = killed_at.elapsed();
        if !matches!(reason, LossReason::Stolen | LossReason::Expired) {
            return Err(format!("round {round}: loss reason {reason}").into());
        }
        if latency > bound {
            return Err(format!(
                "round {round}: abort {latency:?} after the kill (bound {bound:?})"
            )
            .into());
        }
        match run.await? {
            Ok(RunOutcome::Aborted(_)) => {}
            other => {
                return Err(format!("round {round}: expected an aborted run, got {other:?}").into())
            }
        }
        successor.release().await?;
        latencies.push(latency);
    }
    latencies.sort();
    println!(
        "postgres: pg_terminate_backend -> job abort over {} kills (renew every {interval:?}): \
         min {:?}, median {:?}, max {:?}",
        latencies.len(),
        latencies[0],
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    Ok(())
}

/// A role with `idle_session_timeout = 300ms`: the server ends the lock
/// session between renewals; the holder learns it at the next renewal.
async fn idle_session_timeout_is_detected(f: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let idle = Duration::from_millis(300);
    let interval = LockOptions::new(TTL).renew_interval();
    let a = Arc::new(backend_as(&f, ROLE_IDLER).await?);
    let la = locker(a.clone())?;
    let n = name(&f, "idle");
    let (lease, run) = hold(&la, &n).await?;
    let acquired = Instant::now();
    let reason = timeout(TTL * 2, lease.lost())
        .await
        .map_err(|_| "the idle-timed-out session was not noticed")?;
    let since_kill = acquired.elapsed().saturating_sub(idle);
    if reason != LossReason::Expired {
        return Err(format!("expected expired, got {reason}").into());
    }
    if since_kill > interval + Duration::from_millis(400) {
        return Err(
            format!("noticed {since_kill:?} after the idle timeout at the earliest").into(),
        );
    }
    if !matches!(run.await?, Ok(RunOutcome::Aborted(LossReason::Expired))) {
        return Err("the run was not aborted".into());
    }
    let b = locker(Arc::new(backend_as(&f, "postgres").await?))?;
    b.try_lock(&n, &LockOptions::new(TTL))
        .await?
        .release()
        .await?;
    println!(
        "postgres: idle_session_timeout loss noticed {since_kill:?} after the server's timeout"
    );
    Ok(())
}
