//! What a service's admin page shows of its scheduler: per job, the last
//! tick that ended here, the last one completed anywhere, the next one, and
//! whether this replica leads.

use std::sync::PoisonError;

use chrono::{DateTime, TimeZone, Utc};
use futures_util::future::join_all;

use crate::{Result, Scheduler, TickOutcome};

/// One job's state, as [`Scheduler::status`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobStatus {
    /// The job's name.
    pub job: String,
    /// The latest tick recorded completed in the tick store, by any replica.
    pub last_completed: Option<DateTime<Utc>>,
    /// The last tick that ended on this replica, and how (a skip included:
    /// another replica ran it, or this one was not the leader).
    pub last_here: Option<(DateTime<Utc>, TickOutcome)>,
    /// The next tick after now by this replica's clock; `None` when the
    /// schedule has no more.
    pub next_tick: Option<DateTime<Utc>>,
    /// Whether this replica fires the job's ticks: always in per-tick mode
    /// (every replica fires, one runs each tick), only while leading in
    /// leader mode.
    pub fires_here: bool,
}

impl Scheduler {
    /// Each job's state, in the order the jobs were added: the last tick
    /// completed by any replica (one batched read of the tick store), the
    /// last that ended here, the next one, and whether this replica fires
    /// it. For a service's own admin page; a snapshot that can be stale the
    /// moment it returns. Cancel safe (reads only).
    ///
    /// # Errors
    ///
    /// [`Error::Lock`](crate::Error::Lock) when the tick store cannot be read.
    pub async fn status(&self) -> Result<Vec<JobStatus>> {
        let now = self.rt.clock.now();
        let fires = match self.mode {
            crate::Mode::PerTick => true,
            crate::Mode::Leader(_) => self.is_leader(),
        };
        // Issued together, so the tick store's batching reads them in one
        // round trip.
        let reads = join_all(
            self.jobs
                .iter()
                .map(|j| self.rt.ticks.last_completed(&j.name)),
        )
        .await;
        let mut out = Vec::with_capacity(self.jobs.len());
        for (job, read) in self.jobs.iter().zip(reads) {
            let last_completed = read
                .map_err(lock_core::Error::Backend)?
                .and_then(|ms| Utc.timestamp_millis_opt(ms).single());
            let last_here = *job.last_run.lock().unwrap_or_else(PoisonError::into_inner);
            out.push(JobStatus {
                job: job.label().to_owned(),
                last_completed,
                last_here,
                next_tick: job.schedule.next_after(now),
                fires_here: fires,
            });
        }
        Ok(out)
    }
}
