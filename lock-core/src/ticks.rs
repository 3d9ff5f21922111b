//! [`TickStore`]: progress that must survive failover, kept apart from
//! `LockBackend` so the lock trait stays lean.

use std::fmt;

use async_trait::async_trait;

use crate::{BackendError, LockName};

/// Records, per job, the latest scheduled tick that completed, in the same
/// server as the locks, so a replica taking over after a failover knows which
/// ticks were missed.
///
/// Ticks are Unix timestamps in milliseconds of the *scheduled* instant (not
/// when the run happened), so every replica names a tick the same way
/// whatever its clock.
///
/// # Contract
///
/// - `record_completed` MUST keep the maximum: recording an older tick than
///   the stored one leaves the stored one in place (atomically, so two
///   replicas recording at once cannot move it backwards).
/// - Values MUST persist as long as the backend's locks do (a server restart
///   without persistence may lose them, like the locks).
#[async_trait]
pub trait TickStore: fmt::Debug + Send + Sync {
    /// The latest completed tick recorded for `job`, if any.
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError>;

    /// Records `tick` (Unix ms) as completed for `job`, keeping the maximum.
    async fn record_completed(&self, job: &LockName, tick: i64) -> Result<(), BackendError>;

    /// The server's wall clock in Unix milliseconds, where the backend has
    /// one to read (`None` otherwise, the default).
    ///
    /// The scheduler compares a tick against it before running, so that a
    /// replica whose own clock was stepped far ahead cannot run (and record
    /// as done) ticks that every other replica would then skip as past. One
    /// round trip; cancel safe (a read).
    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        Ok(None)
    }
}
