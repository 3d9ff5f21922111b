//! Batch renewal over one keep-alive stream and chunked read transactions.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Failed;
use lock_core::{
    backend::{AcquireAttempt, LeaseStatus, RenewRequest},
    LockBackend, OwnerToken,
};
use tokio::time::{sleep, Instant};

use super::ensure;
use crate::backends::etcd::EtcdFactory;
use crate::{Ctx, Saboteur};

/// More leases than one read transaction may carry (etcd allows 128 ops).
const LEASES: usize = 300;
const STOLEN: usize = 7;
const EXPIRED: usize = 200;

/// `renew_many` over 300 leases answers each one in order (held, stolen,
/// expired), and really extends the held ones: they outlive the TTL
/// counted from their acquisition.
pub(super) async fn batch_renewal_reports_each_lease(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let (backend, sab) = f.connect_with_saboteur().await?;
    // Long enough that acquiring 300 locks on a loaded machine fits in it
    // (5 s did not, with a load average of 10 on 2 cores).
    let ttl = Duration::from_secs(10);
    let requests = acquire_each(&backend, &ctx, "many", LEASES, ttl).await?;
    sab.steal(&requests[STOLEN].name, ttl * 4).await?;
    sab.expire(&requests[EXPIRED].name).await?;
    let expected = |i: usize| match i {
        STOLEN => LeaseStatus::Stolen,
        EXPIRED => LeaseStatus::Expired,
        _ => LeaseStatus::Held,
    };
    for round in 0..2 {
        let statuses = backend.renew_many(&requests).await?;
        ensure(statuses.len() == LEASES, || {
            format!("{} statuses for {LEASES} leases", statuses.len())
        })?;
        for (i, status) in statuses.iter().enumerate() {
            ensure(*status == expected(i), || {
                format!(
                    "round {round}, lease {i}: {status:?}, expected {:?}",
                    expected(i)
                )
            })?;
        }
        if round == 0 {
            sleep(ttl * 3 / 5).await;
        }
    }
    let renewed_at = Instant::now();
    // Past the TTL counted from the first renewal (plus etcd's 500 ms
    // expiry sweep), but within the one from the second.
    sleep(ttl * 4 / 5).await;
    for (i, r) in requests.iter().enumerate() {
        let status = backend.check(&r.name, &r.owner).await?;
        ensure(status == expected(i), || {
            format!(
                "lease {i} {:?} after the last renewal: {status:?}",
                renewed_at.elapsed()
            )
        })?;
    }
    for r in &requests {
        backend.release(&r.name, &r.owner).await?;
    }
    sab.clear(&requests[STOLEN].name).await?;
    Ok(())
}

/// A key rewritten on the lease it is on (`etcdctl put --ignore-lease`)
/// is caught by the batch renewal: with another value it is stolen, with
/// the holder's own value (what a late-answered earlier put of the holder
/// leaves) it stays held, in the renewal after too. The other locks of
/// the same read transaction stay held.
pub(super) async fn batch_renewal_sees_rewrites_on_the_lease(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let (backend, sab) = f.connect_with_saboteur().await?;
    let ttl = Duration::from_secs(10);
    let requests = acquire_each(&backend, &ctx, "rewrite", 3, ttl).await?;
    let lease = sab.lease_of(&requests[0].name).await?;
    sab.overwrite_keeping_lease(&requests[0].name, "stolen-in-place")
        .await?;
    sab.overwrite_keeping_lease(&requests[1].name, &requests[1].owner.to_hex())
        .await?;
    let after = sab.lease_of(&requests[0].name).await?;
    ensure(after == lease, || {
        format!("the overwrite moved the key from lease {lease:?} to {after:?}")
    })?;
    let expected = [LeaseStatus::Stolen, LeaseStatus::Held, LeaseStatus::Held];
    for round in 0..2 {
        let statuses = backend.renew_many(&requests).await?;
        for (i, want) in expected.iter().enumerate() {
            let got = statuses.get(i).copied();
            ensure(got == Some(*want), || {
                format!("round {round}, lock {i}: {got:?}, expected {want:?}")
            })?;
        }
    }
    for r in &requests[1..] {
        backend.release(&r.name, &r.owner).await?;
    }
    // The stolen-in-place key is nobody's: delete it.
    sab.expire(&requests[0].name).await?;
    Ok(())
}

/// Acquires `count` fresh locks named `<stem>-<i>` for `ttl`, each with its
/// own owner, as renewal requests.
async fn acquire_each(
    backend: &impl LockBackend,
    ctx: &Ctx,
    stem: &str,
    count: usize,
    ttl: Duration,
) -> Result<Vec<RenewRequest>, Failed> {
    let mut requests = Vec::with_capacity(count);
    for i in 0..count {
        let name = ctx.name(&format!("{stem}-{i}"));
        let owner = OwnerToken::generate()?;
        let got = backend.try_acquire(&name, &owner, ttl).await?;
        ensure(matches!(got, AcquireAttempt::Acquired(_)), || {
            format!("lock {stem}-{i}: {got:?}")
        })?;
        requests.push(RenewRequest { name, owner, ttl });
    }
    Ok(requests)
}
