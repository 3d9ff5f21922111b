//! What a job handler receives.

use chrono::{DateTime, Utc};
use lock_core::{LeaseHandle, LossReason};
use tokio_util::sync::CancellationToken;

/// The context of one run: which job and tick, and the lock it runs under.
///
/// Call [`JobContext::assert_held`] before every unsafe write: it fails once
/// the tick's lock (or, in leader mode, the leadership) is lost or its local
/// validity deadline has passed, whether or not the heartbeat has run. The
/// scheduler also drops the handler's future at once on such a loss; the
/// check covers work the handler hands to other tasks.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub(crate) job: String,
    pub(crate) scheduled: DateTime<Utc>,
    pub(crate) lease: LeaseHandle,
    pub(crate) leader: Option<LeaseHandle>,
    pub(crate) cancel: CancellationToken,
    pub(crate) catch_up: bool,
}

impl JobContext {
    /// The job's name.
    pub fn job_name(&self) -> &str {
        &self.job
    }

    /// The instant this run was scheduled for (the cron tick, in UTC).
    pub fn scheduled_at(&self) -> DateTime<Utc> {
        self.scheduled
    }

    /// Whether this run catches up a missed tick (see [`MissedTicks`](crate::MissedTicks)).
    pub fn is_catch_up(&self) -> bool {
        self.catch_up
    }

    /// The lease on this tick's lock.
    pub fn lease(&self) -> &LeaseHandle {
        &self.lease
    }

    /// The fencing token of this tick's lock, if the backend issues them; pass
    /// it to the resource the job writes, which should reject lower tokens.
    pub fn fencing_token(&self) -> Option<u64> {
        self.lease.fencing_token()
    }

    /// `Ok` while this run may still write: the tick's lock is held and, in
    /// leader mode, so is the leadership.
    ///
    /// # Errors
    ///
    /// [`lock_core::Error::LockLost`] naming the lost lock and why.
    pub fn assert_held(&self) -> lock_core::Result<()> {
        self.lease.assert_held()?;
        match &self.leader {
            Some(leader) => leader.assert_held(),
            None => Ok(()),
        }
    }

    /// Completes when the tick's lock or the leadership is lost.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn lost(&self) -> LossReason {
        match &self.leader {
            Some(leader) => tokio::select! {
                r = self.lease.lost() => r,
                r = leader.lost() => r,
            },
            None => self.lease.lost().await,
        }
    }

    /// A token cancelled when the run must stop: lock or leadership lost, or
    /// the scheduler shutting down. A handler that wants to finish a unit of
    /// work cleanly on shutdown watches it; the scheduler aborts the handler
    /// at the shutdown deadline regardless.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
}
