//! `redis_cluster::chaos_cluster_slot_migration`: the slot of a held lock is
//! moved to another primary by hand (`CLUSTER SETSLOT` IMPORTING/MIGRATING,
//! `MIGRATE`, `SETSLOT NODE`) while a contender keeps trying to take it.
//! The contender is never granted the lock; the holder renews through the
//! `ASK` and `MOVED` redirects and releases on the new primary; the next
//! holder's fencing token is higher, since the counter moved with the slot.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_core::backend::{AcquireAttempt, LeaseStatus, ReleaseOutcome};
use lock_core::{LockBackend, LockName, OwnerToken};
use lock_redis::{cluster_key_slot, RedisBackend};

use super::figures::{self, Row};
use crate::backends::redis::cluster::{nodes_of, query, ClusterSet};
use crate::backends::redis::ClusterFactory;
use crate::{BoxError, Ctx};

const TTL: Duration = Duration::from_secs(3);

/// The case body; an error names the violation.
pub(super) async fn slot_migration(ctx: Ctx, factory: Arc<ClusterFactory>) -> Result<(), BoxError> {
    let set = super::cluster_of(&factory).await?;
    let holder = factory.connect().await?;
    let contender = factory.connect().await?;
    let name = ctx.name("migrated");
    let owner = OwnerToken::generate()?;
    let first = match holder.try_acquire(&name, &owner, TTL).await? {
        AcquireAttempt::Acquired(l) => l.fencing_token.ok_or("no fencing token")?,
        other => return Err(format!("the first acquire got {other:?}").into()),
    };
    let slot = cluster_key_slot(holder.key_for(&name).as_bytes());
    let mut probe = Probe {
        holder: &holder,
        contender: &contender,
        name: &name,
        owner: &owner,
        denied: 0,
        renewed: 0,
    };
    let started = Instant::now();

    // Phase 1: the slot is marked importing on the target and migrating on
    // the source; the keys are still on the source.
    let s = Arc::clone(&set);
    let (src, dst) = tokio::task::spawn_blocking(move || begin_migration(&s, slot)).await??;
    probe.check("marked migrating").await?;

    // Phase 2: every key of the slot (lock and counter) moved; the source
    // answers ASK for them, the target accepts them after ASKING.
    let moved = tokio::task::spawn_blocking(move || move_keys(slot, src, dst)).await??;
    probe.check("keys migrated (ASK)").await?;

    // Phase 3: the slot assigned to the target everywhere (MOVED).
    let s = Arc::clone(&set);
    tokio::task::spawn_blocking(move || finish_migration(&s, slot, dst)).await??;
    probe.check("slot moved (MOVED)").await?;
    let migrated_in = started.elapsed();
    let Probe {
        denied, renewed, ..
    } = probe;

    match holder.release(&name, &owner).await? {
        ReleaseOutcome::Released => {}
        other => return Err(format!("release after the migration: {other:?}").into()),
    }
    let second_owner = OwnerToken::generate()?;
    let second = match contender.try_acquire(&name, &second_owner, TTL).await? {
        AcquireAttempt::Acquired(l) => l.fencing_token.ok_or("no fencing token")?,
        other => return Err(format!("the acquire after release got {other:?}").into()),
    };
    if second <= first {
        return Err(format!("token {second} after the migration, {first} before").into());
    }
    let _ = contender.release(&name, &second_owner).await?;
    eprintln!(
        "    [redis_cluster] slot {slot} moved {src} -> {dst} ({moved} keys) in {migrated_in:?}: {denied} contender attempts all denied, {renewed} holder renewals all held, token {first} -> {second}"
    );
    figures::record(Row {
        backend: "redis_cluster".into(),
        case: "chaos_cluster_slot_migration".into(),
        iterations: 1,
        faults: 1,
        leaked: 0,
        ..Row::default()
    });
    Ok(())
}

/// What is asked of the cluster at each phase of the migration, and how
/// often the contender was denied and the holder renewed so far.
struct Probe<'a> {
    holder: &'a RedisBackend,
    contender: &'a RedisBackend,
    name: &'a LockName,
    owner: &'a OwnerToken,
    denied: usize,
    renewed: usize,
}

impl Probe<'_> {
    /// Several contender attempts and one holder renewal: none granted, held.
    async fn check(&mut self, phase: &str) -> Result<(), BoxError> {
        for _ in 0..5 {
            let other = OwnerToken::generate()?;
            match self.contender.try_acquire(self.name, &other, TTL).await? {
                AcquireAttempt::HeldElsewhere => self.denied += 1,
                got => return Err(format!("{phase}: the contender got {got:?}").into()),
            }
        }
        match self.holder.renew(self.name, self.owner, TTL).await? {
            LeaseStatus::Held => self.renewed += 1,
            got => return Err(format!("{phase}: the holder's renewal found {got:?}").into()),
        }
        match self.holder.check(self.name, self.owner).await? {
            LeaseStatus::Held => Ok(()),
            got => Err(format!("{phase}: the holder's check found {got:?}").into()),
        }
    }
}

fn id_of(port: u16) -> Result<String, BoxError> {
    nodes_of(port)?
        .into_iter()
        .find(|n| n.port == port)
        .map(|n| n.id)
        .ok_or_else(|| format!("node {port} does not list itself").into())
}

/// Marks `slot` importing on another primary and migrating on its owner;
/// returns `(source, target)` ports.
fn begin_migration(set: &ClusterSet, slot: u16) -> Result<(u16, u16), BoxError> {
    let src = set.owner_of(slot)?;
    let dst = set
        .primaries()?
        .into_iter()
        .find(|p| *p != src)
        .ok_or("no other primary")?;
    let (src_id, dst_id) = (id_of(src)?, id_of(dst)?);
    let slot_s = slot.to_string();
    query(dst, &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &src_id])?;
    query(src, &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &dst_id])?;
    Ok((src, dst))
}

/// Moves every key of `slot` from `src` to `dst`; returns how many.
fn move_keys(slot: u16, src: u16, dst: u16) -> Result<usize, BoxError> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{src}"))?;
    let mut c = client.get_connection_with_timeout(Duration::from_secs(1))?;
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut c)?;
    if keys.is_empty() {
        return Err(format!("slot {slot} holds no key on {src}").into());
    }
    let _: String = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(dst)
        .arg("")
        .arg(0)
        .arg(5_000)
        .arg("KEYS")
        .arg(&keys)
        .query(&mut c)?;
    Ok(keys.len())
}

/// Assigns `slot` to `dst` on the target, then on every other primary.
fn finish_migration(set: &ClusterSet, slot: u16, dst: u16) -> Result<(), BoxError> {
    let dst_id = id_of(dst)?;
    let slot_s = slot.to_string();
    query(dst, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &dst_id])?;
    for p in set.primaries()?.into_iter().filter(|p| *p != dst) {
        query(p, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &dst_id])?;
    }
    set.wait_settled(Duration::from_secs(20))
}
