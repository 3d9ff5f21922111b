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

/// A resource that checks fencing tokens: it accepts a write only if its
/// token is at least the highest it has seen, and counts both kinds.
#[derive(Debug, Default)]
pub struct FencedStore {
    state: Mutex<FencedState>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct FencedState {
    max_seen: u64,
    accepted: u64,
    rejected_stale: u64,
}

impl FencedStore {
    /// Offers a write under `token`; returns whether it was accepted.
    pub fn write(&self, token: u64) -> bool {
        let mut st = self.state.lock().expect("fenced store lock");
        if token >= st.max_seen {
            st.max_seen = token;
            st.accepted += 1;
            true
        } else {
            st.rejected_stale += 1;
            false
        }
    }

    /// Writes accepted.
    pub fn accepted(&self) -> u64 {
        self.state.lock().expect("fenced store lock").accepted
    }

    /// Writes rejected because a newer token had already written.
    pub fn rejected_stale(&self) -> u64 {
        self.state.lock().expect("fenced store lock").rejected_stale
    }
}

/// Every guarded write: when it was allowed, and the holder's deadline then.
/// A write is unsafe if it was allowed at or after the deadline.
#[derive(Debug, Default)]
pub struct GuardLog {
    entries: Mutex<Vec<(tokio::time::Instant, Option<tokio::time::Instant>)>>,
}

impl GuardLog {
    /// Records a write allowed at `at`, under a lease valid until `deadline`.
    pub fn record(&self, at: tokio::time::Instant, deadline: Option<tokio::time::Instant>) {
        self.entries
            .lock()
            .expect("guard log lock")
            .push((at, deadline));
    }

    /// Writes recorded.
    pub fn writes(&self) -> usize {
        self.entries.lock().expect("guard log lock").len()
    }

    /// Writes allowed at or after their lease's local deadline.
    pub fn after_deadline(&self) -> usize {
        self.entries
            .lock()
            .expect("guard log lock")
            .iter()
            .filter(|(at, deadline)| deadline.is_some_and(|d| *at >= d))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_store_rejects_only_older_tokens() {
        let store = FencedStore::default();
        assert!(store.write(3));
        assert!(store.write(3), "the same holder writes again");
        assert!(store.write(5));
        assert!(!store.write(4));
        assert_eq!((store.accepted(), store.rejected_stale()), (3, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn guard_log_counts_writes_at_or_after_the_deadline() {
        let log = GuardLog::default();
        let now = tokio::time::Instant::now();
        let deadline = now + Duration::from_secs(1);
        log.record(now, Some(deadline));
        log.record(deadline, Some(deadline));
        log.record(deadline, None);
        assert_eq!((log.writes(), log.after_deadline()), (3, 1));
    }
}
