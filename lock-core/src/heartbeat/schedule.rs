//! The heartbeat's deadline heap: when each lease next needs attention.
//!
//! Finding the next wake-up and the leases due at it costs a logarithm of the
//! number of leases held, not a look at every one of them, so a `Locker`
//! holding 10,000 leases does work only for the leases due.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tokio::time::Instant;

/// Deadlines by lease id, with lazy deletion: rescheduling a lease pushes a
/// new entry under a new generation, and an entry whose generation is no
/// longer its lease's (or whose lease is forgotten) is dropped when it
/// reaches the top, or when stale entries outnumber live ones.
#[derive(Debug, Default)]
pub(super) struct Schedule {
    heap: BinaryHeap<Reverse<(Instant, u64, u64)>>,
}

impl Schedule {
    /// Lease `id` (at `generation`) needs attention at `at`.
    pub(super) fn push(&mut self, at: Instant, id: u64, generation: u64) {
        self.heap.push(Reverse((at, id, generation)));
    }

    /// The earliest deadline still current, dropping stale ones on the way.
    /// `current(id, generation)` says whether an entry is its lease's latest.
    pub(super) fn next(&mut self, current: impl Fn(u64, u64) -> bool) -> Option<Instant> {
        while let Some(Reverse((at, id, generation))) = self.heap.peek().copied() {
            if current(id, generation) {
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
        current: impl Fn(u64, u64) -> bool,
    ) -> Option<u64> {
        let at = self.next(&current)?;
        if at > bound {
            return None;
        }
        self.heap.pop().map(|Reverse((_, id, _))| id)
    }

    /// Drops every stale entry once they outnumber the `live` leases (plus
    /// some slack), so a stream of short leases cannot grow the heap: each
    /// one leaves an entry behind when it is released long before its
    /// deadline.
    pub(super) fn compact(&mut self, live: usize, current: impl Fn(u64, u64) -> bool) {
        if self.heap.len() <= live.saturating_mul(2).saturating_add(1024) {
            return;
        }
        self.heap
            .retain(|Reverse((_, id, generation))| current(*id, *generation));
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
        let live: HashMap<u64, u64> = [(1, 1), (2, 3), (3, 1)].into();
        let current = |id, g| live.get(&id) == Some(&g);
        s.push(at(30), 1, 1);
        s.push(at(10), 2, 1);
        s.push(at(40), 2, 3);
        s.push(at(20), 3, 1);
        s.push(at(5), 4, 1);
        assert_eq!(s.next(current), Some(at(20)), "stale 4 and 2@10 dropped");
        assert_eq!(s.pop_due(at(25), current), Some(3));
        assert_eq!(s.pop_due(at(25), current), None, "1 is due at 30");
        assert_eq!(s.pop_due(at(100), current), Some(1));
        assert_eq!(s.pop_due(at(100), current), Some(2));
        assert_eq!(s.next(current), None);
    }

    #[test]
    fn compaction_keeps_only_current_entries() {
        let t0 = Instant::now();
        let mut s = Schedule::default();
        for id in 0..5000 {
            s.push(t0 + Duration::from_millis(id), id, 1);
        }
        // Only even ids are still held.
        let current = |id: u64, _| id.is_multiple_of(2);
        s.compact(2500, current);
        assert_eq!(s.len(), 5000, "below the threshold nothing is done");
        s.compact(10, current);
        assert_eq!(s.len(), 2500);
        assert_eq!(s.next(current), Some(t0));
    }
}
