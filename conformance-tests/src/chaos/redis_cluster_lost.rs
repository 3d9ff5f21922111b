//! `redis_cluster::chaos_cluster_primary_lost`: a primary is killed
//! (SIGKILL) while locks in its slots are held, and its replica is
//! promoted. The locks were acknowledged by the replica (`WAIT`) before the
//! kill, so none may be lost: the holder keeps renewing them on the promoted
//! replica, a contender is never granted one, and the next tokens are
//! higher. Also measured: the time from the kill to the first new lock in
//! those slots.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_core::backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome};
use lock_core::{LockBackend, LockName, OwnerToken};
use lock_redis::cluster_key_slot;

use super::figures::{self, Row};
use crate::backends::redis::ClusterFactory;
use crate::{BoxError, Ctx};

/// Well above the failover time (about 2.5 s here, more when loaded).
const TTL: Duration = Duration::from_secs(15);
/// Locks held in the victim's slots.
const HELD: usize = 6;
/// Bound of the wait for the promotion.
const PROMOTED_WITHIN: Duration = Duration::from_secs(30);

/// The case body; panics (fails the trial) on any violation.
pub(super) async fn primary_lost(ctx: Ctx, factory: Arc<ClusterFactory>) {
    if let Err(e) = run(&ctx, factory).await {
        panic!("chaos_cluster_primary_lost: {e}");
    }
}

async fn run(ctx: &Ctx, factory: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let f = Arc::clone(&factory);
    let set = tokio::task::spawn_blocking(move || f.set().map(Arc::clone)).await??;
    let holder = factory.connect().await?;
    let contender = factory.connect().await?;
    let s = Arc::clone(&set);
    let victim = tokio::task::spawn_blocking(move || s.primaries()).await??;
    let victim = *victim.first().ok_or("no primary")?;
    let in_victim = |name: &LockName| -> Result<bool, BoxError> {
        Ok(set.owner_of(cluster_key_slot(holder.key_for(name).as_bytes()))? == victim)
    };
    let mut held = Vec::new();
    let mut fresh = None;
    for i in 0..1_000 {
        let name = ctx.name(&format!("lost-{i}"));
        if !in_victim(&name)? {
            continue;
        }
        if held.len() < HELD {
            let owner = OwnerToken::generate()?;
            match holder.try_acquire(&name, &owner, TTL).await? {
                AcquireAttempt::Acquired(l) => held.push((name, owner, l.fencing_token)),
                other => return Err(format!("{name}: {other:?}").into()),
            }
        } else {
            fresh = Some(name);
            break;
        }
    }
    let fresh = fresh.ok_or("no free name in the victim's slots")?;
    // The locks (and counters) reached the replica before the kill: what
    // this case tests is the promotion, not asynchronous replication.
    let acked: i64 = {
        let client = redis::Client::open(format!("redis://127.0.0.1:{victim}"))?;
        let mut c = client.get_multiplexed_async_connection().await?;
        redis::cmd("WAIT")
            .arg(1)
            .arg(5_000)
            .query_async(&mut c)
            .await?
    };
    if acked < 1 {
        return Err("the victim's replica did not acknowledge the locks".into());
    }
    let killed_at = Instant::now();
    set.node(victim)?.kill()?;

    // Until the promotion: the contender is never granted a held lock, and
    // the first new lock in those slots is timed.
    let (mut denied, mut errors) = (0usize, 0usize);
    let mut first_new: Option<Duration> = None;
    let fresh_owner = OwnerToken::generate()?;
    while killed_at.elapsed() < PROMOTED_WITHIN {
        for (name, _, _) in &held {
            match contender
                .try_acquire(name, &OwnerToken::generate()?, TTL)
                .await
            {
                Ok(AcquireAttempt::HeldElsewhere) => denied += 1,
                Ok(got) => return Err(format!("{name} granted to the contender: {got:?}").into()),
                Err(_) => errors += 1,
            }
        }
        if let Ok(AcquireAttempt::Acquired(_)) =
            contender.try_acquire(&fresh, &fresh_owner, TTL).await
        {
            first_new = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_new = first_new.ok_or("no new lock in the victim's slots within the bound")?;
    let _ = contender.release(&fresh, &fresh_owner).await?;

    // After it: every lock is still the holder's, renewals find it held.
    let mut next_tokens = Vec::new();
    for (name, owner, token) in &held {
        match contender
            .try_acquire(name, &OwnerToken::generate()?, TTL)
            .await?
        {
            AcquireAttempt::HeldElsewhere => denied += 1,
            got => return Err(format!("{name} granted after the promotion: {got:?}").into()),
        }
        match holder.renew(name, owner, TTL).await? {
            LeaseStatus::Held => {}
            got => return Err(format!("{name} after the promotion: {got:?}").into()),
        }
        match holder.release(name, owner).await? {
            ReleaseOutcome::Released => {}
            got => return Err(format!("release of {name}: {got:?}").into()),
        }
        let next = OwnerToken::generate()?;
        match contender.try_acquire(name, &next, TTL).await? {
            AcquireAttempt::Acquired(l) if l.fencing_token > *token => {
                next_tokens.push(l.fencing_token);
            }
            got => return Err(format!("{name} after release: {got:?} (was {token:?})").into()),
        }
        let _ = contender.release(name, &next).await?;
    }
    eprintln!(
        "    [redis_cluster] primary {victim} killed with {HELD} locks: first new lock in its slots {first_new:?} later; {denied} contender attempts denied, {errors} failed closed, 0 granted; all {HELD} still held after the promotion, next tokens higher"
    );
    figures::record(Row {
        backend: "redis_cluster".into(),
        case: "chaos_cluster_primary_lost".into(),
        iterations: 1,
        faults: 1,
        leaked: 0,
        reconnect: vec![first_new],
        ..Row::default()
    });
    Ok(())
}
