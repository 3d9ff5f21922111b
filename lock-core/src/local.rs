//! The in-process guard: names held or being acquired through one `Locker`.
//!
//! Each name has a slot that stays in the table after its claim is dropped,
//! so taking the same name again is one lookup and dropping a claim touches
//! no table at all (a set insert and removal per hold cost more than the
//! rest of the guard). Slots of names no longer held are swept out when the
//! table has doubled since the last sweep, so names used once (per-tick
//! names) cost amortised constant time and the table stays within twice the
//! names held (and at least [`MIN_SWEEP`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::Notify;

use crate::metrics::LabelMetrics;
use crate::LockName;

/// Below this many slots the table is never swept.
const MIN_SWEEP: usize = 64;

type Slots = HashMap<LockName, Arc<Slot>, foldhash::fast::RandomState>;

/// Names claimed through one `Locker`, shared by its clones.
#[derive(Debug)]
pub(crate) struct LocalClaims {
    table: Mutex<Table>,
    freed: Notify,
    /// Acquires waiting for some local claim to go: a claim dropped while
    /// this is 0 wakes no one, and skips [`Notify::notify_waiters`].
    waiting: AtomicUsize,
}

#[derive(Debug)]
struct Table {
    slots: Slots,
    /// The size at which slots of unheld names are next swept out.
    sweep_at: usize,
}

/// One name's place in the table.
#[derive(Debug)]
pub(crate) struct Slot {
    /// Set by a claim (under the table's lock), cleared by its drop (without it).
    held: AtomicBool,
    /// The series of the name's own `lock` label, once resolved: most
    /// acquires label their metrics with the name.
    name_label: OnceLock<Arc<LabelMetrics>>,
}

impl Default for LocalClaims {
    fn default() -> Self {
        Self {
            table: Mutex::new(Table {
                slots: Slots::default(),
                sweep_at: MIN_SWEEP,
            }),
            freed: Notify::new(),
            waiting: AtomicUsize::new(0),
        }
    }
}

impl LocalClaims {
    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock cannot leave the table half-updated
        // (each operation is one lookup, insert or sweep), so poisoning is ignored.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `name` for this process, or returns `None` if it is already claimed.
    pub(crate) fn claim(self: &Arc<Self>, name: &LockName) -> Option<LocalClaim> {
        let mut table = self.table();
        let slot = match table.slots.get(name) {
            Some(slot) => {
                // SeqCst, with the waiter count's: see `LocalClaims::waiting`.
                if slot.held.swap(true, Ordering::SeqCst) {
                    return None;
                }
                Arc::clone(slot)
            }
            None => {
                table.sweep_if_grown();
                let slot = Arc::new(Slot {
                    held: AtomicBool::new(true),
                    name_label: OnceLock::new(),
                });
                table.slots.insert(name.clone(), Arc::clone(&slot));
                slot
            }
        };
        drop(table);
        Some(LocalClaim {
            claims: Arc::clone(self),
            slot,
        })
    }

    /// Counts one waiting acquire until the returned guard is dropped. Take
    /// it before the first attempt to claim. The count's increment and a
    /// claim's test of its slot, and a drop's clearing of the slot and its
    /// read of the count, are all sequentially consistent: so an attempt that
    /// found the name held is followed by a drop that sees the waiter, and
    /// the wake-up cannot be skipped.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting { claims: self }
    }

    /// Resolves after some claim is dropped while a [`Waiting`] guard is
    /// held. Create it before checking, so a release in between is not missed.
    pub(crate) fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    #[cfg(test)]
    fn slots(&self) -> usize {
        self.table().slots.len()
    }
}

impl Table {
    /// Drops the slots of unheld names once the table has doubled since the
    /// last sweep. A slot swept while its name is being released is only
    /// forgotten: the claim keeps its own reference, and the name's next
    /// claim makes a new slot.
    fn sweep_if_grown(&mut self) {
        if self.slots.len() < self.sweep_at {
            return;
        }
        self.slots
            .retain(|_, slot| slot.held.load(Ordering::SeqCst));
        self.sweep_at = (2 * self.slots.len()).max(MIN_SWEEP);
    }
}

/// One acquire waiting for local claims to be dropped.
#[derive(Debug)]
pub(crate) struct Waiting<'a> {
    claims: &'a LocalClaims,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.claims.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A claimed name; dropping it frees the name and wakes local waiters.
#[derive(Debug)]
pub(crate) struct LocalClaim {
    claims: Arc<LocalClaims>,
    slot: Arc<Slot>,
}

impl LocalClaim {
    /// The series of the name's own label, resolved by `resolve` the first
    /// time and kept with the name's slot after that.
    pub(crate) fn name_label(
        &self,
        resolve: impl FnOnce() -> Arc<LabelMetrics>,
    ) -> Arc<LabelMetrics> {
        Arc::clone(self.slot.name_label.get_or_init(resolve))
    }
}

impl Drop for LocalClaim {
    fn drop(&mut self) {
        self.slot.held.store(false, Ordering::SeqCst);
        if self.claims.waiting.load(Ordering::SeqCst) > 0 {
            self.claims.freed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn name(text: &str) -> LockName {
        LockName::new(text).expect("a valid name")
    }

    #[test]
    fn a_name_is_claimed_once_at_a_time() {
        let claims = Arc::new(LocalClaims::default());
        let first = claims.claim(&name("a")).expect("free");
        assert!(claims.claim(&name("a")).is_none(), "claimed twice");
        let other = claims.claim(&name("b")).expect("another name is free");
        drop(first);
        let again = claims.claim(&name("a")).expect("free after the drop");
        assert!(claims.claim(&name("a")).is_none());
        drop((again, other));
        assert_eq!(claims.slots(), 2, "slots stay for the next claim");
    }

    #[test]
    fn slots_of_names_no_longer_held_are_swept_out() {
        let claims = Arc::new(LocalClaims::default());
        let held: Vec<_> = (0..10)
            .map(|i| claims.claim(&name(&format!("held/{i}"))).expect("free"))
            .collect();
        for i in 0..10_000 {
            drop(claims.claim(&name(&format!("once/{i}"))).expect("free"));
            assert!(claims.slots() <= 2 * MIN_SWEEP, "{} slots", claims.slots());
        }
        for i in 0..held.len() {
            assert!(
                claims.claim(&name(&format!("held/{i}"))).is_none(),
                "a sweep freed a held name"
            );
        }
        drop(held);
        assert!(claims.claim(&name("held/0")).is_some());
    }

    #[test]
    fn a_dropped_claim_wakes_only_while_someone_waits() {
        let claims = Arc::new(LocalClaims::default());
        let mut cx = Context::from_waker(Waker::noop());

        let unwatched = claims.claim(&name("a")).expect("free");
        let mut missed = pin!(claims.freed());
        missed.as_mut().enable();
        drop(unwatched);
        assert_eq!(
            missed.as_mut().poll(&mut cx),
            Poll::Pending,
            "no one counted as waiting, so no wake-up was sent"
        );

        let held = claims.claim(&name("a")).expect("free again");
        let waiting = claims.waiting();
        let mut freed = pin!(claims.freed());
        freed.as_mut().enable();
        assert!(claims.claim(&name("a")).is_none(), "claimed twice");
        drop(held);
        assert_eq!(freed.as_mut().poll(&mut cx), Poll::Ready(()));
        drop(waiting);
        assert_eq!(claims.waiting.load(Ordering::SeqCst), 0);
    }
}
