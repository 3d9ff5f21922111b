//! The in-process store: one process's buckets, bounded in memory.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Store, StoreDecision, StoreRequest};
use crate::error::StoreError;
use crate::gcra::{self, Cell};

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
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_per_shard: usize,
    start: Instant,
}

/// One shard: the buckets of the store's string keys, and those of the
/// limiter that owns this store, by subject id (see
/// [`MemoryStore::decide_subject`]). A store is used one way or the other,
/// never both; the maximum applies to each map.
#[derive(Debug)]
struct Shard {
    tats: HashMap<Box<str>, u64>,
    by_id: HashMap<BucketId, u64, BuildHasherDefault<IdHasher>>,
    sweep_at: usize,
}

/// A bucket of the owning limiter: its subject's 128-bit keyed hash and the
/// limit's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BucketId {
    subject: [u64; 2],
    limit: usize,
}

impl Hash for BucketId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The subject's words are already keyed SipHash outputs: uniform and
        // unpredictable without this process's random key, so one of them
        // (mixed with the limit) is the map hash, with no second hashing.
        let limit = u64::try_from(self.limit).unwrap_or(u64::MAX);
        state.write_u64(self.subject[0] ^ limit.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
}

/// Passes a [`BucketId`]'s hash through. Other input (none is hashed with
/// it) is folded in byte by byte, so it would still be a hash.
#[derive(Debug, Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
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
                    Mutex::new(Shard {
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
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no key is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Decides synchronously; [`Store::decide`] is this behind an `async fn`.
    pub fn decide_now(&self, request: &StoreRequest<'_>) -> StoreDecision {
        let hash = self.hasher.hash_one(request.subject);
        self.decide_in(
            hash,
            |shard| &mut shard.tats,
            request.keys,
            request.cells,
            request.cost,
        )
    }

    /// The id of `subject`: two SipHash outputs under this store's random
    /// key, on inputs told apart by a leading byte, so 128 bits that no one
    /// without the key can make collide. It stands for the subject as the
    /// SHA-256 prefix does in a shared store's keys (neither keeps the
    /// caller's text), at a third of the cost.
    pub(crate) fn subject_id(&self, subject: &str) -> [u64; 2] {
        [
            self.hasher.hash_one((0u8, subject)),
            self.hasher.hash_one((1u8, subject)),
        ]
    }

    /// Decides for the limiter that owns this store (its only user), keyed
    /// by [`subject_id`](Self::subject_id) and the limit's index rather than
    /// by strings: no key to build or hash again, nothing to allocate but a
    /// new bucket. The decision is [`decide_now`](Self::decide_now)'s.
    pub(crate) fn decide_subject(
        &self,
        subject: [u64; 2],
        cells: &[Cell],
        cost: u64,
    ) -> StoreDecision {
        let id = |limit| BucketId { subject, limit };
        match cells.len() {
            1 => self.decide_in(subject[1], |s| &mut s.by_id, &[id(0)], cells, cost),
            n if n <= INLINE_LIMITS => {
                let ids = [id(0), id(1), id(2), id(3)];
                let ids = ids.get(..n).unwrap_or(&ids);
                self.decide_in(subject[1], |s| &mut s.by_id, ids, cells, cost)
            }
            n => {
                let ids: Vec<BucketId> = (0..n).map(id).collect();
                self.decide_in(subject[1], |s| &mut s.by_id, &ids, cells, cost)
            }
        }
    }

    /// Locks the shard `hash` picks and decides over `keys` in the map
    /// `map` picks in it.
    fn decide_in<K, Q, R, S>(
        &self,
        hash: u64,
        map: impl FnOnce(&mut Shard) -> &mut HashMap<K, u64, S>,
        keys: &[R],
        cells: &[Cell],
        cost: u64,
    ) -> StoreDecision
    where
        K: Borrow<Q> + for<'q> From<&'q Q> + Hash + Eq,
        Q: Hash + Eq + ?Sized,
        R: AsRef<Q>,
        S: BuildHasher,
    {
        let shard = usize::try_from(hash % SHARDS as u64).unwrap_or(0);
        let mut shard = self.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Read the clock under the lock, so decisions on one shard see
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
        if decision.allowed && shard.len() >= shard.sweep_at {
            shard.sweep(now, self.max_per_shard);
        }
        decision
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
const INLINE_LIMITS: usize = 4;

/// One limit, the common case: one map lookup serves both the read and the
/// write.
fn decide_one<K, Q, S>(
    tats: &mut HashMap<K, u64, S>,
    key: &Q,
    now: u64,
    cells: &[Cell],
    cost: u64,
) -> StoreDecision
where
    K: Borrow<Q> + for<'q> From<&'q Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    S: BuildHasher,
{
    let mut new_tat = [0];
    let slot = tats.get_mut(key);
    let stored = [slot.as_deref().copied()];
    let summary = gcra::decide_into(now, &stored, cells, cost, &mut new_tat);
    let [tat] = new_tat;
    if summary.allowed && tat > now {
        // Update in place: a new key costs an allocation, a known one none.
        match slot {
            Some(slot) => *slot = tat,
            None => {
                tats.insert(K::from(key), tat);
            }
        }
    }
    summary.at(now)
}

/// Several limits, all read before any is written, so a refusal by one
/// charges none. `stored` and `new_tats` hold at least one entry per key and
/// per cell (entries past those are left alone).
fn decide_many<K, Q, R, S>(
    tats: &mut HashMap<K, u64, S>,
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
{
    for (slot, key) in stored.iter_mut().zip(keys) {
        *slot = tats.get(key.as_ref()).copied();
    }
    let summary = gcra::decide_into(now, stored, cells, cost, new_tats);
    if summary.allowed {
        for (key, &tat) in keys.iter().zip(new_tats.iter()) {
            if tat > now {
                match tats.get_mut(key.as_ref()) {
                    Some(slot) => *slot = tat,
                    None => {
                        tats.insert(K::from(key.as_ref()), tat);
                    }
                }
            }
        }
    }
    summary.at(now)
}

impl Shard {
    fn len(&self) -> usize {
        self.tats.len() + self.by_id.len()
    }

    /// Drops full buckets, then, past the maximum, the keys closest to full
    /// down to half the maximum; schedules the next sweep at twice what is
    /// left, so sweeping costs O(1) per insert amortised.
    fn sweep(&mut self, now: u64, max: usize) {
        sweep_map(&mut self.tats, now, max);
        sweep_map(&mut self.by_id, now, max);
        self.sweep_at = (self.len() * 2).clamp(MIN_SWEEP.min(max), max);
    }
}

/// [`Shard::sweep`] on one map.
fn sweep_map<K, S>(tats: &mut HashMap<K, u64, S>, now: u64, max: usize) {
    tats.retain(|_, tat| *tat > now);
    if tats.len() > max - max / 4 {
        let keep = max / 2;
        let mut values: Vec<u64> = tats.values().copied().collect();
        let drop = values.len() - keep;
        let (_, &mut cut, _) = values.select_nth_unstable(drop.saturating_sub(1));
        let mut to_drop = drop;
        tats.retain(|_, tat| {
            if to_drop > 0 && *tat <= cut {
                to_drop -= 1;
                false
            } else {
                true
            }
        });
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError> {
        Ok(self.decide_now(request))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
