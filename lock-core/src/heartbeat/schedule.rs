//! The heartbeat's deadline heap: when each lease, or each renewal batch in
//! flight, next needs attention.
//!
//! Finding the next wake-up and the leases due at it costs a logarithm of the
//! number of leases held, not a look at every one of them, so a `Locker`
//! holding 10,000 leases does work only for the leases due.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tokio::time::Instant;

/// What an entry of the schedule is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Key {
    /// One lease not being renewed right now: its renewal, local deadline or
    /// `max_hold`, whichever comes first.
    Lease(u64),
    /// One renewal call in flight: the earliest local deadline or `max_hold`
    /// of the leases it renews. One entry per batch instead of one per lease,
    /// because the answer almost always comes first and makes it stale.
    Batch(u64),
}

/// Deadlines by key, with lazy deletion: rescheduling a lease pushes a new
/// entry under a new generation, and an entry whose generation is no longer
/// its key's (or whose lease is forgotten, or whose batch has answered) is
/// dropped when it reaches the top, or when stale entries outnumber live
/// ones.
#[derive(Debug, Default)]
pub(super) struct Schedule {
    heap: BinaryHeap<Reverse<(Instant, Key, u64)>>,
}

impl Schedule {
    /// `key` (at `generation`) needs attention at `at`.
    pub(super) fn push(&mut self, at: Instant, key: Key, generation: u64) {
        self.heap.push(Reverse((at, key, generation)));
    }

    /// The earliest deadline still current, dropping stale ones on the way.
    /// `current(key, generation)` says whether an entry is its key's latest.
    pub(super) fn next(&mut self, current: impl Fn(Key, u64) -> bool) -> Option<Instant> {
        while let Some(Reverse((at, key, generation))) = self.heap.peek().copied() {
            if current(key, generation) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Takes the earliest current entry due at or before `bound`, if any.
    pub(super) fn pop_due(
        &mut self,
        bound: Instant,
        current: impl Fn(Key, u64) -> bool,
    ) -> Option<Key> {
        let at = self.next(&current)?;
        if at > bound {
            return None;
        }
        self.heap.pop().map(|Reverse((_, key, _))| key)
    }

    /// Drops every stale entry once they outnumber the `live` leases (plus
    /// some slack), so a stream of short leases cannot grow the heap: each
    /// one leaves an entry behind when it is released long before its
    /// deadline.
    pub(super) fn compact(&mut self, live: usize, current: impl Fn(Key, u64) -> bool) {
        if self.heap.len() <= live.saturating_mul(2).saturating_add(1024) {
            return;
        }
        self.heap
            .retain(|Reverse((_, key, generation))| current(*key, *generation));
    }

    /// Entries in the heap, stale ones included.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.heap.len()
    }

    pub(super) fn clear(&mut self) {
        self.heap.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn yields_current_entries_in_deadline_order_and_skips_stale_ones() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut s = Schedule::default();
        // Lease id -> its current generation; 2 is rescheduled, 4 forgotten.
        let live: HashMap<Key, u64> = [
            (Key::Lease(1), 1),
            (Key::Lease(2), 3),
            (Key::Lease(3), 1),
            (Key::Batch(1), 0),
        ]
        .into();
        let current = |key, g| live.get(&key) == Some(&g);
        s.push(at(30), Key::Lease(1), 1);
        s.push(at(10), Key::Lease(2), 1);
        s.push(at(40), Key::Lease(2), 3);
        s.push(at(20), Key::Lease(3), 1);
        s.push(at(5), Key::Lease(4), 1);
        s.push(at(7), Key::Batch(2), 0);
        s.push(at(35), Key::Batch(1), 0);
        assert_eq!(
            s.next(current),
            Some(at(20)),
            "stale 4, 2@10 and answered batch 2 dropped"
        );
        assert_eq!(s.pop_due(at(25), current), Some(Key::Lease(3)));
        assert_eq!(s.pop_due(at(25), current), None, "1 is due at 30");
        assert_eq!(s.pop_due(at(100), current), Some(Key::Lease(1)));
        assert_eq!(s.pop_due(at(100), current), Some(Key::Batch(1)));
        assert_eq!(s.pop_due(at(100), current), Some(Key::Lease(2)));
        assert_eq!(s.next(current), None);
    }

    #[test]
    fn compaction_keeps_only_current_entries() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        for id in 0..5000 {
            s.push(t0 + Duration::from_millis(id), Key::Lease(id), 1);
        }
        // Only even ids are still held.
        let current = |key, _| matches!(key, Key::Lease(id) if id % 2 == 0);
        s.compact(2500, current);
        assert_eq!(s.len(), 5000, "below the threshold nothing is done");
        s.compact(10, current);
        assert_eq!(s.len(), 2500);
        assert_eq!(s.next(current), Some(t0));
    }
}
