//! The in-process store: one process's buckets, bounded in memory.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Store, StoreDecision, StoreRequest};
use crate::error::StoreError;
use crate::gcra;

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
    hasher: std::collections::hash_map::RandomState,
    max_per_shard: usize,
    start: Instant,
}

#[derive(Debug, Default)]
struct Shard {
    tats: HashMap<Box<str>, u64>,
    sweep_at: usize,
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
                        sweep_at: MIN_SWEEP.min(max_per_shard),
                    })
                })
                .collect(),
            hasher: std::collections::hash_map::RandomState::new(),
            max_per_shard,
            start: Instant::now(),
        }
    }

    /// The number of keys held now (live or not yet swept).
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).tats.len())
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
        let shard = usize::try_from(hash % SHARDS as u64).unwrap_or(0);
        let mut shard = self.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Read the clock under the lock, so decisions on one shard see
        // non-decreasing times.
        let now = self.now_us();
        let stored: Vec<Option<u64>> = request
            .keys
            .iter()
            .map(|k| shard.tats.get(k.as_str()).copied())
            .collect();
        let verdict = gcra::decide(now, &stored, request.cells, request.cost);
        if let Some(tats) = &verdict.new_tats {
            for (key, &tat) in request.keys.iter().zip(tats) {
                if tat > now {
                    // Update in place: a new key costs an allocation, a
                    // known one none.
                    match shard.tats.get_mut(key.as_str()) {
                        Some(slot) => *slot = tat,
                        None => {
                            shard.tats.insert(key.as_str().into(), tat);
                        }
                    }
                }
            }
            if shard.tats.len() >= shard.sweep_at {
                shard.sweep(now, self.max_per_shard);
            }
        }
        StoreDecision::from((verdict, now))
    }
}

impl Shard {
    /// Drops full buckets, then, past the maximum, the keys closest to full
    /// down to half the maximum; schedules the next sweep at twice what is
    /// left, so sweeping costs O(1) per insert amortised.
    fn sweep(&mut self, now: u64, max: usize) {
        self.tats.retain(|_, tat| *tat > now);
        if self.tats.len() > max - max / 4 {
            let keep = max / 2;
            let mut tats: Vec<u64> = self.tats.values().copied().collect();
            let drop = tats.len() - keep;
            let (_, &mut cut, _) = tats.select_nth_unstable(drop.saturating_sub(1));
            let mut to_drop = drop;
            self.tats.retain(|_, tat| {
                if to_drop > 0 && *tat <= cut {
                    to_drop -= 1;
                    false
                } else {
                    true
                }
            });
        }
        self.sweep_at = (self.tats.len() * 2).clamp(MIN_SWEEP.min(max), max);
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
