//! What a guarded run came to.

use crate::{BackendError, LossReason};

/// The result of [`Locker::with_lock`](crate::Locker::with_lock).
#[derive(Debug)]
#[must_use = "a skipped or aborted run usually needs reporting"]
#[non_exhaustive]
pub enum RunOutcome<T> {
    /// The job ran to completion while holding the lock, confirmed afterwards.
    Completed(T),
    /// The job did not run.
    Skipped(SkipReason),
    /// The lock was lost while the job ran; the job was stopped (or had just
    /// finished, unconfirmed) and its effects must be treated as unsafe.
    Aborted(LossReason),
}

impl<T> RunOutcome<T> {
    /// The job's value if it completed.
    pub fn completed(self) -> Option<T> {
        match self {
            Self::Completed(v) => Some(v),
            _ => None,
        }
    }

    /// Whether the job completed.
    pub fn is_completed(&self) -> bool {
        matches!(self, Self::Completed(_))
    }
}

/// Why a job was not run.
#[derive(Debug)]
#[non_exhaustive]
pub enum SkipReason {
    /// Another owner holds the lock (the normal outcome on N−1 of N replicas).
    HeldElsewhere,
    /// This process already holds or is acquiring the lock (an overlapping run).
    HeldLocally,
    /// The backend failed; the job was not run (fail closed).
    Unavailable(BackendError),
    /// No backend is configured and `lock_required` is set.
    LockRequired,
}
