//! The generic cell rate algorithm as a pure function over integer
//! microseconds: the one definition of a decision. The Redis script and the
//! Postgres function are transcriptions of [`decide`]; the memory store calls
//! it directly.
//!
//! Each limit keeps one number per subject, the theoretical arrival time
//! (TAT): the instant at which its bucket is full again. A request of cost
//! `n` moves it `n × interval` later; it is admitted when the new TAT is at
//! most `capacity` (`burst × interval`) ahead of now.

/// One limit's parameters, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    /// Microseconds per unit (T).
    pub interval: u64,
    /// Microseconds an empty bucket takes to fill (burst × T).
    pub capacity: u64,
}

/// The result of [`decide`] over every limit of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Admitted by every limit (and then charged to every limit).
    pub allowed: bool,
    /// Units left, over the tightest limit, after this request.
    pub remaining: u64,
    /// Microseconds until this request could be admitted (0 when it was).
    pub retry_after: u64,
    /// Microseconds until the bucket of the limit at `limiting` is full
    /// again.
    pub reset_after: u64,
    /// The index of the limit that decided `remaining` (admitted) or
    /// `retry_after` (refused).
    pub limiting: usize,
    /// The TATs to store when admitted (one per limit); `None` when refused,
    /// so nothing is charged.
    pub new_tats: Option<Vec<u64>>,
}

/// Decides one request of `cost` units at `now` against `cells`, given each
/// limit's stored TAT (`None` for a subject never seen or expired).
///
/// A stored TAT more than a full bucket ahead of `now` can only come from a
/// clock that stepped back; it is clamped to `now + capacity`, so a subject
/// waits at most its own refill time, never the size of the step.
///
/// `stored` and `cells` have the same length; a missing stored entry counts
/// as `None`. Arithmetic saturates: no input panics.
#[must_use]
pub fn decide(now: u64, stored: &[Option<u64>], cells: &[Cell], cost: u64) -> Verdict {
    let mut new_tats = vec![0; cells.len()];
    let s = decide_into(now, stored, cells, cost, &mut new_tats);
    Verdict {
        allowed: s.allowed,
        remaining: s.remaining,
        retry_after: s.retry_after,
        reset_after: s.reset_after,
        limiting: s.limiting,
        new_tats: s.allowed.then_some(new_tats),
    }
}

/// A [`Verdict`] without its TATs, which [`decide_into`] writes into the
/// caller's buffer instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) retry_after: u64,
    pub(crate) reset_after: u64,
    pub(crate) limiting: usize,
}

impl Summary {
    /// The store's answer for this summary, decided at `now_us`.
    pub(crate) fn at(self, now_us: u64) -> crate::store::StoreDecision {
        crate::store::StoreDecision {
            allowed: self.allowed,
            remaining: self.remaining,
            retry_after_us: self.retry_after,
            reset_after_us: self.reset_after,
            limiting: self.limiting,
            now_us,
        }
    }
}

/// [`decide`] without allocating: the new TAT of limit `i` goes to
/// `new_tats[i]` (meaningful only when the summary says admitted). The
/// in-memory store calls this once per request with a buffer on its stack;
/// [`decide`] is this with a `Vec`, so there is still one definition.
///
/// `new_tats` must be at least as long as `cells`; limits past its end are
/// not considered (no caller passes a shorter one).
pub(crate) fn decide_into(
    now: u64,
    stored: &[Option<u64>],
    cells: &[Cell],
    cost: u64,
    new_tats: &mut [u64],
) -> Summary {
    let tat_of = |i: usize, cell: &Cell| {
        stored
            .get(i)
            .copied()
            .flatten()
            .unwrap_or(now)
            .clamp(now, now.saturating_add(cell.capacity))
    };
    let mut allowed = true;
    let mut retry_after = 0;
    let mut refused_by = 0;
    for (i, (cell, slot)) in cells.iter().zip(new_tats.iter_mut()).enumerate() {
        let full_at = now.saturating_add(cell.capacity);
        let new_tat = tat_of(i, cell).saturating_add(cost.saturating_mul(cell.interval));
        if new_tat > full_at {
            allowed = false;
            let wait = new_tat - full_at;
            if wait > retry_after {
                retry_after = wait;
                refused_by = i;
            }
        }
        *slot = new_tat;
    }
    // Remaining is the least over the limits (the first of equals); the
    // reset reported is that of the limiting one. Starting from the first
    // limit is the same as starting from "u64::MAX, none yet".
    let mut remaining = 0;
    let mut least = 0;
    let mut least_reset = 0;
    let mut refused_reset = 0;
    for (i, (cell, &new_tat)) in cells.iter().zip(new_tats.iter()).enumerate() {
        let after = if allowed { new_tat } else { tat_of(i, cell) };
        let left = now.saturating_add(cell.capacity).saturating_sub(after) / cell.interval.max(1);
        let reset = after - now;
        if i == 0 || left < remaining {
            remaining = left;
            least = i;
            least_reset = reset;
        }
        if i == refused_by {
            refused_reset = reset;
        }
    }
    let (limiting, reset_after) = if allowed {
        (least, least_reset)
    } else {
        (refused_by, refused_reset)
    };
    Summary {
        allowed,
        remaining,
        retry_after,
        reset_after,
        limiting,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A token bucket counted in whole microsecond credits: the textbook
    /// model GCRA is equivalent to, written the other way round.
    #[derive(Clone, Debug)]
    struct Bucket {
        credit: u64,
        last: u64,
    }

    impl Bucket {
        fn admit(&mut self, now: u64, cell: Cell, cost: u64) -> bool {
            self.credit = (self.credit + now.saturating_sub(self.last)).min(cell.capacity);
            self.last = self.last.max(now);
            let need = cost * cell.interval;
            if need <= self.credit {
                self.credit -= need;
                true
            } else {
                false
            }
        }
    }

    /// The allocating definition `decide` had before `decide_into`, kept
    /// as the reference the new one must match exactly.
    fn reference(now: u64, stored: &[Option<u64>], cells: &[Cell], cost: u64) -> Verdict {
        let mut allowed = true;
        let mut retry_after = 0;
        let mut refused_by = 0;
        let mut tats = Vec::with_capacity(cells.len());
        for (i, cell) in cells.iter().enumerate() {
            let full_at = now.saturating_add(cell.capacity);
            let tat = stored
                .get(i)
                .copied()
                .flatten()
                .unwrap_or(now)
                .clamp(now, full_at);
            let new_tat = tat.saturating_add(cost.saturating_mul(cell.interval));
            if new_tat > full_at {
                allowed = false;
                let wait = new_tat - full_at;
                if wait > retry_after {
                    retry_after = wait;
                    refused_by = i;
                }
            }
            tats.push((tat, new_tat));
        }
        let mut remaining = u64::MAX;
        let mut least = 0;
        let mut resets = Vec::with_capacity(cells.len());
        for (i, (cell, &(tat, new_tat))) in cells.iter().zip(&tats).enumerate() {
            let after = if allowed { new_tat } else { tat };
            let left =
                now.saturating_add(cell.capacity).saturating_sub(after) / cell.interval.max(1);
            if left < remaining {
                remaining = left;
                least = i;
            }
            resets.push(after - now);
        }
        if cells.is_empty() {
            remaining = 0;
        }
        let limiting = if allowed { least } else { refused_by };
        Verdict {
            allowed,
            remaining,
            retry_after,
            reset_after: resets.get(limiting).copied().unwrap_or(0),
            limiting,
            new_tats: allowed.then(|| tats.iter().map(|&(_, new_tat)| new_tat).collect()),
        }
    }

    fn cell() -> impl Strategy<Value = Cell> {
        (1u64..5_000, 1u64..20).prop_map(|(interval, burst)| Cell {
            interval,
            capacity: interval * burst,
        })
    }

    proptest! {
        #[test]
        fn matches_a_token_bucket(cell in cell(), steps in prop::collection::vec((0u64..10_000, 0u64..4), 1..200)) {
            let mut model = Bucket { credit: cell.capacity, last: 0 };
            let mut tat = None;
            let mut now = 0;
            for (gap, cost) in steps {
                now += gap;
                let burst = cell.capacity / cell.interval;
                let cost = cost.min(burst);
                let v = decide(now, &[tat], &[cell], cost);
                prop_assert_eq!(v.allowed, model.admit(now, cell, cost));
                if let Some(t) = v.new_tats.as_ref() {
                    tat = Some(t[0]);
                }
                prop_assert_eq!(v.remaining, model.credit / cell.interval);
                prop_assert!(v.reset_after <= cell.capacity);
                prop_assert!(v.retry_after <= cost * cell.interval);
            }
        }

        #[test]
        fn admits_at_most_burst_plus_rate_times_elapsed(cells in prop::collection::vec(cell(), 1..4), gaps in prop::collection::vec(0u64..3_000, 1..300)) {
            let mut tats: Vec<Option<u64>> = vec![None; cells.len()];
            let mut admitted = 0u64;
            let mut now = 0;
            for gap in gaps {
                now += gap;
                let v = decide(now, &tats, &cells, 1);
                if let Some(t) = v.new_tats {
                    admitted += 1;
                    tats = t.into_iter().map(Some).collect();
                }
            }
            for c in &cells {
                prop_assert!(admitted <= c.capacity / c.interval + now / c.interval);
            }
        }

        #[test]
        fn refused_requests_charge_no_limit(cells in prop::collection::vec(cell(), 2..4), stored in prop::collection::vec(prop::option::of(0u64..200_000), 4), cost in 1u64..5) {
            let v = decide(100_000, &stored, &cells, cost);
            if !v.allowed {
                prop_assert!(v.new_tats.is_none());
                prop_assert!(v.retry_after > 0);
            }
        }

        #[test]
        fn a_clock_stepped_back_waits_at_most_one_refill(cell in cell(), back in 0u64..u64::MAX / 4, cost in 0u64..4) {
            let burst = cell.capacity / cell.interval;
            let cost = cost.min(burst);
            let stored = Some(1_000_000_000u64.saturating_add(back));
            let v = decide(1_000_000_000, &[stored], &[cell], cost);
            prop_assert!(v.retry_after <= cell.capacity);
            prop_assert!(v.reset_after <= cell.capacity);
        }

        #[test]
        fn matches_the_allocating_reference(now in 0u64..1u64 << 40, stored in prop::collection::vec(prop::option::of(0u64..1u64 << 41), 0..5), cells in prop::collection::vec(cell(), 0..5), cost in 0u64..30) {
            prop_assert_eq!(decide(now, &stored, &cells, cost), reference(now, &stored, &cells, cost));
        }

        #[test]
        fn matches_the_reference_at_the_extremes(now in any::<u64>(), stored in prop::collection::vec(prop::option::of(any::<u64>()), 0..4), cells in prop::collection::vec((any::<u64>(), any::<u64>()).prop_map(|(interval, capacity)| Cell { interval, capacity }), 0..4), cost in any::<u64>()) {
            prop_assert_eq!(decide(now, &stored, &cells, cost), reference(now, &stored, &cells, cost));
        }

        #[test]
        fn never_panics(now in any::<u64>(), stored in prop::collection::vec(prop::option::of(any::<u64>()), 0..4), cells in prop::collection::vec((any::<u64>(), any::<u64>()).prop_map(|(interval, capacity)| Cell { interval, capacity }), 0..4), cost in any::<u64>()) {
            let _ = decide(now, &stored, &cells, cost);
        }
    }

    #[test]
    fn several_limits_report_the_tightest() {
        let minute = Cell {
            interval: 12,
            capacity: 60,
        }; // 5 at once
        let day = Cell {
            interval: 1,
            capacity: 3,
        }; // 3 at once
        let v = decide(0, &[None, None], &[minute, day], 1);
        assert!(v.allowed);
        assert_eq!((v.remaining, v.limiting), (2, 1));
        assert_eq!(v.new_tats, Some(vec![12, 1]));
    }
}
