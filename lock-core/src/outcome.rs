//! What a guarded run came to.

use std::fmt;

use crate::{BackendError, LossReason};

/// The result of [`Locker::with_lock`](crate::Locker::with_lock).
///
/// Exhaustive on purpose: a `match` names all three cases, so a caller
/// cannot swallow a run that did not complete in a catch-all arm.
/// [`RunOutcome::into_result`] folds it into the shape most callers want.
#[derive(Debug)]
#[must_use = "a skipped or aborted run usually needs reporting"]
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
            Self::Skipped(_) | Self::Aborted(_) => None,
        }
    }

    /// Whether the job completed.
    pub fn is_completed(&self) -> bool {
        matches!(self, Self::Completed(_))
    }

    /// The outcome as a `Result`: `Ok(Some(value))` when the job completed,
    /// `Ok(None)` when the lock was held (elsewhere, or by an overlapping run
    /// here) so the job was rightly not run, and `Err` when it could not run
    /// for lack of a working backend or was aborted by the loss of its lock.
    ///
    /// # Errors
    ///
    /// [`RunError::NotRun`] for an unavailable backend or a missing required
    /// one; [`RunError::Aborted`] when the lock was lost during the run.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use lock_core::{LockName, LockOptions, Locker};
    ///
    /// let locker = Locker::unlocked()?;
    /// let name = LockName::new("reports/daily")?;
    /// let opts = LockOptions::new(Duration::from_secs(30));
    /// match locker.with_lock(&name, &opts, |_lease| async { 42 }).await?.into_result()? {
    ///     Some(value) => println!("ran: {value}"),
    ///     None => println!("another replica has it"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn into_result(self) -> Result<Option<T>, RunError> {
        match self {
            Self::Completed(v) => Ok(Some(v)),
            Self::Skipped(SkipReason::HeldElsewhere | SkipReason::HeldLocally) => Ok(None),
            Self::Skipped(reason) => Err(RunError::NotRun(reason)),
            Self::Aborted(reason) => Err(RunError::Aborted(reason)),
        }
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

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HeldElsewhere => f.write_str("another owner holds the lock"),
            Self::HeldLocally => {
                f.write_str("this process already holds the lock (an overlapping run)")
            }
            Self::Unavailable(e) => write!(f, "the lock backend is unavailable ({e})"),
            Self::LockRequired => {
                f.write_str("no lock backend is configured and a lock is required")
            }
        }
    }
}

impl std::error::Error for SkipReason {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(e),
            Self::HeldElsewhere | Self::HeldLocally | Self::LockRequired => None,
        }
    }
}

/// A run [`RunOutcome::into_result`] reports as failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The job did not run although it should have: the backend was
    /// unavailable (fail closed) or none was configured where one is required.
    #[error("the job did not run: {0}")]
    NotRun(#[source] SkipReason),
    /// The lock was lost while the job ran; its effects must be treated as
    /// unsafe (they may overlap another holder's).
    #[error("the job was aborted: its lock was lost ({0})")]
    Aborted(LossReason),
}

impl RunError {
    /// True for [`RunError::Aborted`]: the run stopped because its lock was
    /// lost, a correct and safe outcome to report as aborted, not failed.
    pub fn is_lock_lost(&self) -> bool {
        matches!(self, Self::Aborted(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BackendErrorKind;

    #[test]
    fn into_result_separates_held_from_failed() {
        assert!(matches!(
            RunOutcome::Completed(7).into_result(),
            Ok(Some(7))
        ));
        for held in [SkipReason::HeldElsewhere, SkipReason::HeldLocally] {
            assert!(matches!(
                RunOutcome::<()>::Skipped(held).into_result(),
                Ok(None)
            ));
        }
        let down = BackendError::new(BackendErrorKind::Unavailable, "connection refused");
        let err = RunOutcome::<()>::Skipped(SkipReason::Unavailable(down))
            .into_result()
            .expect_err("unavailable is an error");
        assert!(!err.is_lock_lost());
        assert_eq!(
            err.to_string(),
            "the job did not run: the lock backend is unavailable (unavailable: connection refused)"
        );
        assert!(std::error::Error::source(&err).is_some());
        let err = RunOutcome::<()>::Aborted(LossReason::Stolen)
            .into_result()
            .expect_err("aborted is an error");
        assert!(err.is_lock_lost());
        assert_eq!(
            err.to_string(),
            "the job was aborted: its lock was lost (stolen)"
        );
        let err = RunOutcome::<()>::Skipped(SkipReason::LockRequired)
            .into_result()
            .expect_err("a missing required backend is an error");
        assert_eq!(
            err.to_string(),
            "the job did not run: no lock backend is configured and a lock is required"
        );
    }
}
