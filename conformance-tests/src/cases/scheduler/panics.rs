//! Counts panics per thread. tokio catches a panic in a spawned task and
//! only prints it; on a current-thread runtime every task runs on the
//! case's own thread, so this count tells whether any of them panicked.

use std::cell::Cell;
use std::sync::Once;

thread_local! {
    static PANICS: Cell<u64> = const { Cell::new(0) };
}

static HOOK: Once = Once::new();

/// Starts counting (once per process); the previous hook still prints.
pub(crate) fn count_panics() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.with(|p| p.set(p.get().saturating_add(1)));
            previous(info);
        }));
    });
}

/// Panics on this thread since the process started counting.
pub(crate) fn panics_on_this_thread() -> u64 {
    PANICS.with(Cell::get)
}
