//! One shard of the store: its maps, the decisions made on them under its
//! write lock, and its sweep.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash};
use std::sync::atomic::AtomicU64;

use super::id::{BucketId, IdHasher};
use super::MIN_SWEEP;
use crate::gcra::{self, Cell};
use crate::store::StoreDecision;

/// One shard: the buckets of the store's string keys (decided under the
/// write lock), and those of limiters deciding in process, by bucket id
/// (see [`MemoryStore::decide_subject`]): each an atomic TAT that a
/// single-limit decision updates by compare-and-swap under the read lock.
/// The write lock is taken to add a bucket, to sweep, and to decide over
/// several limits at once. The maximum applies to each map.
#[derive(Debug)]
pub(super) struct Shard {
    pub(super) tats: HashMap<Box<str>, u64>,
    pub(super) by_id: HashMap<BucketId, AtomicU64, BuildHasherDefault<IdHasher>>,
    pub(super) sweep_at: usize,
}

/// A stored TAT: a plain number where a write lock guards it, an atomic
/// where single-limit decisions swap it under a read lock.
pub(super) trait Tat {
    fn new(tat: u64) -> Self;
    fn get(&mut self) -> u64;
    fn set(&mut self, tat: u64);
}

impl Tat for u64 {
    fn new(tat: u64) -> Self {
        tat
    }
    fn get(&mut self) -> u64 {
        *self
    }
    fn set(&mut self, tat: u64) {
        *self = tat;
    }
}

impl Tat for AtomicU64 {
    fn new(tat: u64) -> Self {
        AtomicU64::new(tat)
    }
    fn get(&mut self) -> u64 {
        *self.get_mut()
    }
    fn set(&mut self, tat: u64) {
        *self.get_mut() = tat;
    }
}

impl AsRef<BucketId> for BucketId {
    fn as_ref(&self) -> &BucketId {
        self
    }
}

impl From<&BucketId> for BucketId {
    fn from(id: &BucketId) -> Self {
        *id
    }
}

/// Requests with up to this many limits are decided with buffers on the
/// stack: a decision then allocates nothing unless it adds a key.
pub(super) const INLINE_LIMITS: usize = 4;

/// One limit, the common case: one map lookup serves both the read and the
/// write.
pub(super) fn decide_one<K, Q, S, V>(
    tats: &mut HashMap<K, V, S>,
    key: &Q,
    now: u64,
    cells: &[Cell],
    cost: u64,
) -> StoreDecision
where
    K: Borrow<Q> + for<'q> From<&'q Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    S: BuildHasher,
    V: Tat,
{
    let mut new_tat = [0];
    let mut slot = tats.get_mut(key);
    let stored = [slot.as_deref_mut().map(Tat::get)];
    let summary = gcra::decide_into(now, &stored, cells, cost, &mut new_tat);
    let [tat] = new_tat;
    if summary.allowed && tat > now {
        // Update in place: a new key costs an allocation, a known one none.
        match slot {
            Some(slot) => slot.set(tat),
            None => {
                tats.insert(K::from(key), V::new(tat));
            }
        }
    }
    summary.at(now)
}

/// Several limits, all read before any is written, so a refusal by one
/// charges none. `stored` and `new_tats` hold at least one entry per key and
/// per cell (entries past those are left alone).
pub(super) fn decide_many<K, Q, R, S, V>(
    tats: &mut HashMap<K, V, S>,
    now: u64,
    keys: &[R],
    cells: &[Cell],
    cost: u64,
    stored: &mut [Option<u64>],
    new_tats: &mut [u64],
) -> StoreDecision
where
    K: Borrow<Q> + for<'q> From<&'q Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    R: AsRef<Q>,
    S: BuildHasher,
    V: Tat,
{
    for (slot, key) in stored.iter_mut().zip(keys) {
        *slot = tats.get_mut(key.as_ref()).map(Tat::get);
    }
    let summary = gcra::decide_into(now, stored, cells, cost, new_tats);
    if summary.allowed {
        for (key, &tat) in keys.iter().zip(new_tats.iter()) {
            if tat > now {
                match tats.get_mut(key.as_ref()) {
                    Some(slot) => slot.set(tat),
                    None => {
                        tats.insert(K::from(key.as_ref()), V::new(tat));
                    }
                }
            }
        }
    }
    summary.at(now)
}

impl Shard {
    pub(super) fn len(&self) -> usize {
        self.tats.len() + self.by_id.len()
    }

    /// Sweeps once the shard holds as many keys as the last sweep allowed.
    pub(super) fn sweep_if_due(&mut self, now: u64, max: usize) {
        if self.len() >= self.sweep_at {
            self.sweep(now, max);
        }
    }

    /// Drops full buckets, then, past the maximum, the keys closest to full
    /// down to half the maximum; schedules the next sweep at twice what is
    /// left, so sweeping costs O(1) per insert amortised.
    pub(super) fn sweep(&mut self, now: u64, max: usize) {
        sweep_map(&mut self.tats, now, max);
        sweep_map(&mut self.by_id, now, max);
        self.sweep_at = (self.len() * 2).clamp(MIN_SWEEP.min(max), max);
    }
}

/// [`Shard::sweep`] on one map.
fn sweep_map<K, S, V: Tat>(tats: &mut HashMap<K, V, S>, now: u64, max: usize) {
    tats.retain(|_, tat| tat.get() > now);
    if tats.len() > max - max / 4 {
        let keep = max / 2;
        let mut values: Vec<u64> = tats.values_mut().map(Tat::get).collect();
        let drop = values.len() - keep;
        let (_, &mut cut, _) = values.select_nth_unstable(drop.saturating_sub(1));
        let mut to_drop = drop;
        tats.retain(|_, tat| {
            if to_drop > 0 && tat.get() <= cut {
                to_drop -= 1;
                false
            } else {
                true
            }
        });
    }
}
