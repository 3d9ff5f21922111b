//! The in-process store: one process's buckets, bounded in memory.
//!
//! - [`id`]: the ids of in-process buckets and their hashers;
//! - [`shard`]: one shard's maps, the decisions made on them under its
//!   write lock, and its sweep.

mod id;
mod shard;
#[cfg(test)]
mod tests;

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::Ordering;
use std::sync::{PoisonError, RwLock, RwLockWriteGuard};

use async_trait::async_trait;
use siphasher::sip128::SipHasher13;
use tokio::time::Instant;

use super::{Store, StoreDecision, StoreRequest};
use crate::error::StoreError;
use crate::gcra::{self, Cell};
use id::BucketId;
pub(crate) use id::SubjectHasher;
use shard::{decide_many, decide_one, Shard, Tat, INLINE_LIMITS};

/// The number of keys a [`MemoryStore`] keeps at most, by default.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

const SHARDS: usize = 16;
/// No sweep before a shard holds this many keys.
const MIN_SWEEP: usize = 256;

/// Buckets in this process's memory: for one replica, tests, and the
/// per-process fallback when a shared store is down.
///
/// Time is tokio's monotonic clock (so tests can pause it). A key is dropped
/// once its bucket is full again, which is the same as never having seen it.
/// Memory stays bounded: when live keys pass the configured maximum, the
/// keys closest to full are dropped first, which can admit those subjects a
/// little early; it never refuses a request it should admit.
///
/// A [`Limiter`](crate::Limiter) on this store (given with `with_store`,
/// named by `memory://` or by no URL at all, or its default) decides against
/// it directly, without the store call, timeout and breaker a store that can
/// wait or fail needs (see [`Store::in_process`]). Its buckets are kept by a
/// keyed hash of the limiter's key prefix and name, the subject and the
/// limit's name, apart from those of [`Store::decide`] (kept by store key),
/// so limiters of different names never share buckets and limiters of one
/// name share them, as on a shared store.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[RwLock<Shard>]>,
    hasher: RandomState,
    max_per_shard: usize,
    start: Instant,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store keeping at most [`DEFAULT_MAX_KEYS`] keys.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_keys(DEFAULT_MAX_KEYS)
    }

    /// A store keeping at most `max_keys` keys (at least one per shard).
    #[must_use]
    pub fn with_max_keys(max_keys: usize) -> Self {
        let max_per_shard = (max_keys / SHARDS).max(1);
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    RwLock::new(Shard {
                        tats: HashMap::new(),
                        by_id: HashMap::default(),
                        sweep_at: MIN_SWEEP.min(max_per_shard),
                    })
                })
                .collect(),
            hasher: RandomState::new(),
            max_per_shard,
            start: Instant::now(),
        }
    }

    /// The number of keys held now (live or not yet swept).
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no key is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Microseconds since the store was made: `as_micros` truncated to
    /// `u64`, in `u64` arithmetic (saturating where that would overflow, after
    /// half a million years).
    fn now_us(&self) -> u64 {
        let elapsed = self.start.elapsed();
        elapsed
            .as_secs()
            .saturating_mul(1_000_000)
            .saturating_add(u64::from(elapsed.subsec_micros()))
    }

    /// Decides synchronously; [`Store::decide`] is this behind an `async fn`.
    pub fn decide_now(&self, request: &StoreRequest<'_>) -> StoreDecision {
        let hash = self.hasher.hash_one(request.subject);
        self.decide_locked(
            &self.shards[shard_of(hash)],
            |shard| &mut shard.tats,
            request.keys,
            request.cells,
            request.cost,
        )
    }

    /// The hasher of the buckets of the limiter whose keys start with
    /// `key_base` (its prefix and name), with limits named `limits`, in the
    /// limiter's order. `None` when two of the limits' names hash alike
    /// (odds of 2^-64 per pair); the limiter then decides through
    /// [`Store::decide`] instead.
    pub(crate) fn subject_hasher<'a>(
        &self,
        key_base: &str,
        limits: impl IntoIterator<Item = &'a str>,
    ) -> Option<SubjectHasher> {
        let sip = SipHasher13::new_with_keys(
            self.hasher.hash_one((0u8, key_base)),
            self.hasher.hash_one((1u8, key_base)),
        );
        let limits: Vec<u64> = limits
            .into_iter()
            .map(|name| self.hasher.hash_one((2u8, key_base, name)))
            .collect();
        let distinct = limits
            .iter()
            .enumerate()
            .all(|(i, l)| !limits[..i].contains(l));
        distinct.then_some(SubjectHasher { sip, limits })
    }

    /// The id of `subject` under `hasher`.
    pub(crate) fn subject_id(hasher: &SubjectHasher, subject: &str) -> [u64; 2] {
        let h = hasher.sip.hash(subject.as_bytes());
        [h.h1, h.h2]
    }

    /// Decides for a limiter deciding in process, keyed by
    /// [`subject_id`](Self::subject_id) and the limits of `hasher` rather
    /// than by strings: no key to build or hash again, nothing to allocate
    /// but a new bucket. The decision is [`decide_now`](Self::decide_now)'s.
    ///
    /// One limit, the common case, takes the shard's read lock and updates
    /// the bucket by compare-and-swap, so decisions on one subject never
    /// wait for each other; a new bucket takes the write lock. Several limits
    /// take the write lock, so all are charged or none.
    pub(crate) fn decide_subject(
        &self,
        hasher: &SubjectHasher,
        subject: [u64; 2],
        cells: &[Cell],
        cost: u64,
    ) -> StoreDecision {
        let id = |limit: &u64| BucketId {
            subject,
            limit: *limit,
        };
        let shard = &self.shards[shard_of(subject[1])];
        match (hasher.limits.as_slice(), cells) {
            ([limit], [cell]) => self.decide_one_id(shard, id(limit), *cell, cost),
            (limits, _) if limits.len() <= INLINE_LIMITS => {
                let mut ids = [id(&0); INLINE_LIMITS];
                for (slot, limit) in ids.iter_mut().zip(limits) {
                    *slot = id(limit);
                }
                let ids = ids.get(..limits.len()).unwrap_or(&ids);
                self.decide_locked(shard, |s| &mut s.by_id, ids, cells, cost)
            }
            (limits, _) => {
                let ids: Vec<BucketId> = limits.iter().map(id).collect();
                self.decide_locked(shard, |s| &mut s.by_id, &ids, cells, cost)
            }
        }
    }

    /// One limit of a limiter deciding in process: a compare-and-swap on the
    /// bucket under the read lock; the write lock only for a new bucket.
    ///
    /// The clock is read once, before the swap: a decision that loses a race
    /// to one that read the clock later decides again against the newer TAT
    /// at its own, earlier time, which can only refuse sooner. Every
    /// admission still moves the TAT a full interval past the greater of the
    /// TAT and the time it read, so no more than burst + rate × elapsed are
    /// ever admitted.
    fn decide_one_id(
        &self,
        shard: &RwLock<Shard>,
        id: BucketId,
        cell: Cell,
        cost: u64,
    ) -> StoreDecision {
        let cells = [cell];
        {
            let guard = shard.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(slot) = guard.by_id.get(&id) {
                let now = self.now_us();
                let mut current = slot.load(Ordering::Acquire);
                loop {
                    let mut new_tat = [0];
                    let summary =
                        gcra::decide_into(now, &[Some(current)], &cells, cost, &mut new_tat);
                    let [tat] = new_tat;
                    if !summary.allowed || tat <= now || tat == current {
                        return summary.at(now);
                    }
                    match slot.compare_exchange_weak(
                        current,
                        tat,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return summary.at(now),
                        Err(actual) => current = actual,
                    }
                }
            }
        }
        // A bucket not seen yet (or swept): add it under the write lock, where
        // no swap runs.
        let mut guard = self.write(shard);
        let now = self.now_us();
        let decision = decide_one(&mut guard.by_id, &id, now, &cells, cost);
        guard.sweep_if_due(now, self.max_per_shard);
        decision
    }

    fn write<'s>(&self, shard: &'s RwLock<Shard>) -> RwLockWriteGuard<'s, Shard> {
        shard.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides over `keys` in the map `map` picks in `shard`, under its write
    /// lock: every key is read before any is written, and no compare-and-swap
    /// runs meanwhile.
    fn decide_locked<K, Q, R, S, V>(
        &self,
        shard: &RwLock<Shard>,
        map: impl FnOnce(&mut Shard) -> &mut HashMap<K, V, S>,
        keys: &[R],
        cells: &[Cell],
        cost: u64,
    ) -> StoreDecision
    where
        K: Borrow<Q> + for<'q> From<&'q Q> + Hash + Eq,
        Q: Hash + Eq + ?Sized,
        R: AsRef<Q>,
        S: BuildHasher,
        V: Tat,
    {
        let mut shard = self.write(shard);
        // Read the clock under the lock, so decisions under it see
        // non-decreasing times.
        let now = self.now_us();
        let tats = map(&mut shard);
        // One buffer entry per limit; a request with fewer keys than cells
        // (which the limiter never builds) still decides over every cell.
        let n = keys.len().max(cells.len());
        let decision = match keys {
            [key] if n == 1 => decide_one(tats, key.as_ref(), now, cells, cost),
            _ if n <= INLINE_LIMITS => {
                let mut stored = [None; INLINE_LIMITS];
                let mut new_tats = [0; INLINE_LIMITS];
                decide_many(tats, now, keys, cells, cost, &mut stored, &mut new_tats)
            }
            _ => {
                let mut stored = vec![None; n];
                let mut new_tats = vec![0; n];
                decide_many(tats, now, keys, cells, cost, &mut stored, &mut new_tats)
            }
        };
        if decision.allowed {
            shard.sweep_if_due(now, self.max_per_shard);
        }
        decision
    }
}

/// The shard of a subject's hash.
fn shard_of(hash: u64) -> usize {
    usize::try_from(hash % SHARDS as u64).unwrap_or(0)
}

#[async_trait]
impl Store for MemoryStore {
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError> {
        Ok(self.decide_now(request))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn in_process(&self) -> Option<&MemoryStore> {
        Some(self)
    }
}
