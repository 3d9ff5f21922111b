//! A backend told to spread its locks over several lock sessions (the
//! default is one): the end of one loses exactly the leases on it, at once,
//! and the others keep renewing.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LeaseHandle, LockGuard, LockName, LockOptions, LossReason};
use tokio::time::{sleep, timeout, Instant};

use super::specific::{locker, name, private_url};
use super::{holder_pid, plain_session, terminate, PostgresFactory, TTL};
use crate::BoxError;

/// How many names at most are taken to find two sessions with two leases each.
const MAX_NAMES: usize = 64;

/// The lock sessions each backend of this case spreads its locks over.
const SESSIONS: usize = 4;

/// A lease, the pid of the lock session its name maps to, and its guard.
struct Taken {
    name: LockName,
    pid: i32,
    handle: LeaseHandle,
    guard: LockGuard,
}

/// Terminates one lock session's server process with `pg_terminate_backend`
/// from another connection: exactly the leases on it are lost (`expired`,
/// within a renewal interval: pushed, not found at the next renewal), their
/// names are free for another replica, and the leases on the other
/// sessions stay held and keep renewing for two TTLs (only renewals keep a
/// lease valid that long) while the server still shows their locks on their
/// own sessions.
pub(super) async fn one_session_end_loses_only_its_leases(
    f: Arc<PostgresFactory>,
) -> Result<(), BoxError> {
    let url = private_url(&f, "postgres")?;
    let connect = || async {
        let builder = f.builder_for(&url)?.with_lock_sessions(SESSIONS);
        Ok::<_, BoxError>(builder.connect().await?)
    };
    let p = Arc::new(connect().await?);
    let q = connect().await?;
    let (lp, lq) = (locker(p.clone())?, locker(Arc::new(q))?);
    let opts = LockOptions::new(TTL);
    let mut taken: Vec<Taken> = Vec::new();
    // Names until two sessions hold at least two leases each.
    for i in 0..MAX_NAMES {
        let n = name(&f, &format!("spread-{i}"));
        let guard = lp.try_lock(&n, &opts).await?;
        let pid = p.lock_session_pid(&n).await?;
        taken.push(Taken {
            handle: guard.handle(),
            name: n,
            pid,
            guard,
        });
        let mut pids: Vec<i32> = taken.iter().map(|t| t.pid).collect();
        pids.sort_unstable();
        let busy = pids
            .chunk_by(|a, b| a == b)
            .filter(|c| c.len() >= 2)
            .count();
        if busy >= 2 {
            break;
        }
    }
    let victim = taken.first().map(|t| t.pid).ok_or("no lease taken")?;
    let (on_victim, others): (Vec<Taken>, Vec<Taken>) =
        taken.into_iter().partition(|t| t.pid == victim);
    if others.len() < 2 {
        return Err(format!("setup: {MAX_NAMES} names did not spread over two sessions").into());
    }

    let url = tokio::task::block_in_place(|| f.url())?;
    let killer = plain_session(&url, f.application_name()).await?;
    terminate(&killer, victim).await?;
    for t in &on_victim {
        let reason = timeout(
            opts.renew_interval() + Duration::from_secs(1),
            t.handle.lost(),
        )
        .await
        .map_err(|_| format!("{}: not lost after its session ended", t.name))?;
        if reason != LossReason::Expired {
            return Err(format!("{}: lost as {reason}, expected expired", t.name).into());
        }
        // Its name is free: the server freed it with the session.
        lq.try_lock(&t.name, &opts)
            .await
            .map_err(|e| format!("{}: not free after its session ended: {e}", t.name))?
            .release()
            .await?;
    }

    // The others: held now and still held two TTLs on, which only renewals
    // can do (a lease is valid one TTL from its last renewal).
    let until = Instant::now() + TTL * 2;
    while Instant::now() < until {
        for t in &others {
            t.handle.assert_held().map_err(|e| {
                format!("{} (another session) was lost with the victim: {e}", t.name)
            })?;
        }
        sleep(Duration::from_millis(100)).await;
    }
    for t in &others {
        t.handle.assert_held()?;
        let key = p.config().key_for(&t.name);
        if holder_pid(&killer, key).await? != Some(t.pid) {
            return Err(format!("{}: the server no longer shows it on {}", t.name, t.pid).into());
        }
    }
    let names: Vec<LockName> = on_victim.iter().map(|t| t.name.clone()).collect();
    for t in on_victim {
        // Already lost: the release only ends the guard.
        let _ = t.guard.release().await;
    }
    // The victim's slot connects a fresh session for the next acquire.
    let again = names.first().ok_or("no lease on the victim")?;
    let guard = lp.try_lock(again, &opts).await?;
    let fresh = p.lock_session_pid(again).await?;
    if fresh == victim {
        return Err("the terminated session was reused".into());
    }
    guard.release().await?;
    for t in others {
        t.guard.release().await?;
    }
    Ok(())
}
