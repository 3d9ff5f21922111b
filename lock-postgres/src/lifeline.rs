//! The end of a lock session, told once to the backend that holds locks on
//! it: the server freed every one of them at that instant.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use lock_core::LossReason;

/// Identifies a lock session within this process.
pub(crate) type SessionId = u64;

/// Called once when a lock session ends, with why; the backend then marks
/// every lease on that session lost. It calls [`Lifeline::mark_ended`]
/// once it has collected them (or the lifeline does it after the call).
pub(crate) type OnEnd = Arc<dyn Fn(&Lifeline, LossReason) + Send + Sync>;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Shared by a lock session and the task that drives its connection, so
/// that whichever learns first that the session is over reports it: the
/// driver when the connection ends, a statement that fails with a
/// connection or shutdown error, or the backend ending it on purpose.
pub(crate) struct Lifeline {
    id: SessionId,
    /// Set by the first `end`: only that call reports.
    reporting: AtomicBool,
    /// Set once the leases to report are known; the session counts as dead
    /// from then on.
    ended: AtomicBool,
    on_end: OnEnd,
}

impl fmt::Debug for Lifeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lifeline")
            .field("id", &self.id)
            .field("ended", &self.has_ended())
            .finish()
    }
}

impl Lifeline {
    /// A lifeline for a new session, reporting its end to `on_end`.
    pub(crate) fn new(on_end: OnEnd) -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            reporting: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            on_end,
        })
    }

    /// The session's id.
    pub(crate) fn id(&self) -> SessionId {
        self.id
    }

    /// Whether the session ended: its locks are gone.
    pub(crate) fn has_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Marks the session dead. The backend does it in the same critical
    /// section in which it collects the leases on the session, so that no
    /// code that sees the session dead (and forgets its leases) can take a
    /// lease away before it is reported.
    pub(crate) fn mark_ended(&self) {
        self.ended.store(true, Ordering::SeqCst);
    }

    /// The session ended. The first call tells the backend, which marks
    /// every lease on it lost before this returns; later calls do nothing.
    pub(crate) fn end(&self, reason: LossReason) {
        if !self.reporting.swap(true, Ordering::SeqCst) {
            (self.on_end)(self, reason);
            self.mark_ended();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn the_end_is_told_once_with_the_first_reason() {
        let told = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&told);
        let line = Lifeline::new(Arc::new(move |line: &Lifeline, reason| {
            assert!(!line.has_ended(), "dead only once its leases are collected");
            sink.lock().expect("sink").push((line.id(), reason));
        }));
        assert!(!line.has_ended());
        line.end(LossReason::Expired);
        line.end(LossReason::BackendError);
        assert!(line.has_ended());
        assert_eq!(
            *told.lock().expect("told"),
            [(line.id(), LossReason::Expired)]
        );
        let other = Lifeline::new(Arc::new(|_, _| {}));
        assert_ne!(other.id(), line.id(), "ids are unique");
    }
}
