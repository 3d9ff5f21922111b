//! In-process instruments: an overlap observer and a deliberately racy counter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Records critical sections and counts any two that overlap.
#[derive(Debug, Default)]
pub struct OverlapObserver {
    inside: AtomicU64,
    overlaps: AtomicU64,
    sections: AtomicU64,
}

impl OverlapObserver {
    /// Marks entry into a critical section.
    pub fn enter(&self) {
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        self.sections.fetch_add(1, Ordering::SeqCst);
    }

    /// Marks exit from a critical section.
    pub fn exit(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sections that began while another was in progress.
    pub fn overlaps(&self) -> u64 {
        self.overlaps.load(Ordering::SeqCst)
    }

    /// Sections entered.
    pub fn sections(&self) -> u64 {
        self.sections.load(Ordering::SeqCst)
    }
}

/// A counter updated by read, pause, write: it ends exact only if no two
/// updates ever interleave (ShedLock's check).
#[derive(Debug, Default)]
pub struct RacyCounter {
    value: Mutex<u64>,
}

impl RacyCounter {
    /// Reads, waits `pause`, then writes the value plus one.
    pub async fn increment(&self, pause: Duration) {
        let read = *self.value.lock().expect("counter lock");
        tokio::time::sleep(pause).await;
        *self.value.lock().expect("counter lock") = read + 1;
    }

    /// The current value.
    pub fn value(&self) -> u64 {
        *self.value.lock().expect("counter lock")
    }
}
