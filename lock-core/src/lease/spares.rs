//! The allocation of an ended lease, kept per thread for the next acquire.
//!
//! An acquire + release through a `Locker` allocates one lease state and
//! frees it; the allocator's two calls were about a tenth of the cycle's
//! instructions. A released guard that holds the last reference to its
//! lease leaves the allocation here instead, and the next acquire on the
//! same thread builds its lease in it. Per thread, so neither side takes a
//! lock; one per thread, as acquires and releases alternate on a thread (a
//! burst of releases frees all but the last).

use std::cell::Cell;
use std::sync::Arc;

use super::LeaseState;

thread_local! {
    static SPARE: Cell<Option<Arc<LeaseState>>> = const { Cell::new(None) };
}

/// An ended lease whose allocation a new one may be built in (the caller
/// still checks that it is unshared, with `Arc::get_mut`).
pub(super) fn take() -> Option<Arc<LeaseState>> {
    // `try_with`: during the thread's teardown there is simply no spare.
    SPARE.try_with(Cell::take).ok().flatten()
}

/// Keeps `lease`'s allocation if nothing but the caller holds it (in place
/// of the one kept before, if any). What holds resources beyond memory (the
/// backend, the loss feed's registry) is dropped now, not when the
/// allocation is next used.
pub(super) fn keep(lease: &mut Arc<LeaseState>) {
    let Some(state) = Arc::get_mut(lease) else {
        return;
    };
    state.backend = None;
    state.registry = None;
    let spare = Arc::clone(lease);
    let _ = SPARE.try_with(|slot| slot.set(Some(spare)));
}
