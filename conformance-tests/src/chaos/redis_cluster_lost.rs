//! `redis_cluster::chaos_cluster_primary_lost`: a primary is killed
//! (SIGKILL) while locks in its slots are held, and its replica is
//! promoted. The locks were acknowledged by the replica (`WAIT`) before the
//! kill, so none may be lost: the holder keeps renewing them on the promoted
//! replica, a contender is never granted one, and the next tokens are
//! higher. Also measured: the time from the kill to the first new lock in
//! those slots.
//!
//! The holder renews all through the failover: until the promotion every
//! renewal must end as "not decided" (an unavailable or timed-out error:
//! `MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN` or no node for the slot),
//! never as lost, and within the operation timeout. A second connection of
//! the holder's stays idle from the kill on, so its slot map still names
//! the dead primary when it renews first thing after the promotion: the
//! nodes that have not yet heard of the promotion redirect it to the dead
//! primary, which redis-rs alone follows only three times.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_core::backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome};
use lock_core::{LockBackend, LockName, OwnerToken};
use lock_redis::{cluster_key_slot, RedisBackend};

use super::figures::{self, Row};
use crate::backends::redis::{ClusterFactory, OP_TIMEOUT};
use crate::{BoxError, Ctx};

/// Well above the failover time (about 2.5 s here, more when loaded).
const TTL: Duration = Duration::from_secs(15);
/// Locks held in the victim's slots.
const HELD: usize = 6;
/// Bound of the wait for the promotion.
const PROMOTED_WITHIN: Duration = Duration::from_secs(30);
/// How long after the promotion a renewal may keep ending as not decided
/// (the nodes still converging on the new slot owner) before the trial
/// fails: well inside the TTL, as a heartbeat would keep retrying.
const CONVERGED_WITHIN: Duration = Duration::from_secs(5);

/// The case body; an error names the violation.
pub(super) async fn primary_lost(ctx: Ctx, factory: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let set = super::cluster_of(&factory).await?;
    let holder = factory.connect().await?;
    let idle = factory.connect().await?;
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
    // The idle connection learns the slot map (the victim's slots on the
    // victim) and then says nothing until after the promotion.
    for (name, owner, _) in &held {
        match idle.renew(name, owner, TTL).await? {
            LeaseStatus::Held => {}
            got => return Err(format!("{name} before the kill: {got:?}").into()),
        }
    }
    let tolerance = ctx.timing().tolerance;
    let mut renewals = Renewals::default();
    let killed_at = Instant::now();
    set.node(victim)?.kill()?;

    // Until the promotion: the contender is never granted a held lock, and
    // the first new lock in those slots is timed.
    let (mut denied, mut errors) = (0usize, 0usize);
    let mut first_new: Option<Duration> = None;
    let fresh_owner = OwnerToken::generate()?;
    for round in 0.. {
        if killed_at.elapsed() >= PROMOTED_WITHIN {
            break;
        }
        let (name, owner, _) = held.get(round % HELD).ok_or("no held lock")?;
        // Side by side: while the victim's slots are unserved each call
        // may wait out the operation timeout, and the first new lock is
        // timed to within one round.
        let stranger = OwnerToken::generate()?;
        let (renewed, probed, tried) = tokio::join!(
            renewals.renew(&holder, name, owner, tolerance),
            contender.try_acquire(name, &stranger, TTL),
            contender.try_acquire(&fresh, &fresh_owner, TTL),
        );
        renewed?;
        match probed {
            Ok(AcquireAttempt::HeldElsewhere) => denied += 1,
            Ok(got) => return Err(format!("{name} granted to the contender: {got:?}").into()),
            Err(_) => errors += 1,
        }
        if let Ok(AcquireAttempt::Acquired(_)) = tried {
            first_new = Some(killed_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_new = first_new.ok_or("no new lock in the victim's slots within the bound")?;

    // First thing after the promotion, from the connection whose slot map
    // is as old as the kill: every lock is found held, and any call that
    // ends before that ends as not decided.
    let promoted_at = Instant::now();
    let mut stale_map = Renewals::default();
    for (name, owner, _) in &held {
        stale_map
            .held_by(&idle, name, owner, tolerance, promoted_at)
            .await?;
    }
    let stale_map_held = promoted_at.elapsed();
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
        renewals
            .held_by(&holder, name, owner, tolerance, promoted_at)
            .await?;
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
        "    [redis_cluster] primary {victim} killed with {HELD} locks: first new lock in its slots {first_new:?} later; {denied} contender attempts denied, {errors} failed closed, 0 granted; holder renewals {renewals:?}; the idle connection found all {HELD} held {stale_map_held:?} after the promotion ({stale_map:?}); next tokens higher"
    );
    figures::record(Row {
        backend: "redis_cluster".into(),
        case: "chaos_cluster_primary_lost".into(),
        iterations: 1,
        faults: 1,
        leaked: 0,
        reconnect: vec![first_new],
        max_blocked: Some(renewals.longest.max(stale_map.longest)),
        ..Row::default()
    });
    Ok(())
}

/// What the holder's renewals across the failover answered.
#[derive(Debug, Default)]
struct Renewals {
    held: usize,
    not_decided: usize,
    longest: Duration,
}

impl Renewals {
    /// Renews `name` through `backend`: `Ok(true)` when held, `Ok(false)`
    /// when not decided. Anything else fails the trial: a lock the replica
    /// acknowledged is never lost, a redirect is never an answer, and no
    /// call outlasts the operation timeout.
    async fn renew(
        &mut self,
        backend: &RedisBackend,
        name: &LockName,
        owner: &OwnerToken,
        tolerance: Duration,
    ) -> Result<bool, BoxError> {
        let started = Instant::now();
        let got = backend.renew(name, owner, TTL).await;
        let took = started.elapsed();
        self.longest = self.longest.max(took);
        if took > OP_TIMEOUT + tolerance {
            return Err(format!("a renewal of {name} took {took:?}: {got:?}").into());
        }
        match got {
            Ok(LeaseStatus::Held) => {
                self.held += 1;
                Ok(true)
            }
            Err(e) if e.kind().is_unavailable() => {
                self.not_decided += 1;
                Ok(false)
            }
            Err(e) => Err(format!("a renewal of {name} failed as decided: {e} ({e:?})").into()),
            Ok(got) => Err(format!("{name} renewed across the failover: {got:?}").into()),
        }
    }

    /// Renews `name` until it is found held, as a heartbeat retries a
    /// renewal that was not decided; fails once [`CONVERGED_WITHIN`] has
    /// passed since `promoted_at`.
    async fn held_by(
        &mut self,
        backend: &RedisBackend,
        name: &LockName,
        owner: &OwnerToken,
        tolerance: Duration,
        promoted_at: Instant,
    ) -> Result<(), BoxError> {
        while !self.renew(backend, name, owner, tolerance).await? {
            if promoted_at.elapsed() > CONVERGED_WITHIN {
                return Err(format!(
                    "{name}: renewals after the promotion still not decided after {CONVERGED_WITHIN:?} ({self:?})"
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}
