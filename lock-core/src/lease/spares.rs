//! Allocations of ended leases, kept per thread for the next acquires.
//!
//! An acquire + release through a `Locker` allocates one lease state and
//! frees it; the allocator's two calls were about a tenth of the cycle's
//! instructions. A released guard that holds the last reference to its
//! lease leaves the allocation here instead, and the next acquire on the
//! same thread builds its lease in it. Per thread, so neither side takes a
//! lock; bounded, so a burst of releases keeps at most [`MAX_SPARES`].

use std::cell::RefCell;
use std::sync::Arc;

use super::LeaseState;

/// Most ended leases one thread keeps: one per hold running at once covers
/// a steady stream of acquires; the rest are freed.
const MAX_SPARES: usize = 32;

thread_local! {
    static SPARES: RefCell<Vec<Arc<LeaseState>>> = const { RefCell::new(Vec::new()) };
}

/// An ended lease whose allocation a new one may be built in (the caller
/// still checks that it is unshared, with `Arc::get_mut`).
pub(super) fn take() -> Option<Arc<LeaseState>> {
    // `try_with`: during the thread's teardown there is simply no spare.
    SPARES
        .try_with(|spares| spares.try_borrow_mut().ok()?.pop())
        .ok()
        .flatten()
}

/// Keeps `lease`'s allocation if nothing but the caller holds it. What
/// holds resources beyond memory (the backend, the loss feed's registry)
/// is dropped now, not when the allocation is next used.
pub(super) fn keep(lease: &mut Arc<LeaseState>) {
    let Some(state) = Arc::get_mut(lease) else {
        return;
    };
    state.backend = None;
    state.registry = None;
    let _ = SPARES.try_with(|spares| {
        if let Ok(mut spares) = spares.try_borrow_mut() {
            if spares.len() < MAX_SPARES {
                spares.push(Arc::clone(lease));
            }
        }
    });
}
