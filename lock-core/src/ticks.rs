//! [`TickStore`]: progress that must survive failover, kept apart from
//! `LockBackend` so the lock trait stays lean.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;

use crate::start_check::{StartCheck, StartVerdict};
use crate::tick_record::{TickAnswer, TickRecord, TickWrite};
use crate::{BackendError, BackendErrorKind, LockName};

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
/// - `record_completed` also marks `tick` itself as done, and the mark MUST
///   last at least `keep` (it may be dropped once a tick more than `keep`
///   later is recorded, or `keep` after it was recorded): within that window
///   `is_completed` answers for that one tick, which the latest tick alone
///   cannot (a later tick may have finished while an earlier one never ran).
/// - Values MUST persist as long as the backend's locks do (a server restart
///   without persistence may lose them, like the locks). In particular they
///   MUST outlive the process that recorded them, which a session-scoped
///   lock does not.
/// - The batch methods (`last_completed_many`, `is_completed_many`,
///   `record_completed_many`) MUST answer each item exactly as the single
///   call would, in the order given, one answer per item. A backend may
///   fail a whole batch when its one round trip fails; then every item of it
///   carries an error, as its single call's failure would. The defaults call
///   the single methods concurrently, so an implementation only overrides
///   them to save round trips.
/// - `write_tick` applies one [`TickWrite`] to the tick's [`TickRecord`] in
///   ONE server-side step, exactly as [`TickWrite::apply`] says: a `Start`
///   onto a record that exists is refused unless it is a `Started` of a
///   lower token (then its `on_stale` decides); a `Complete` lands only on
///   the `Started` of its own token, and in the same step does what
///   `record_completed` does for the tick. The answer is
///   [`TickWrite::answer`] of the record after the step, so a write sent
///   again with the same token (a retry after a lost reply) changes nothing
///   and answers as the first did. Records MUST last at least `keep` past
///   their last write (or until a tick more than `keep` later is written),
///   like the marks.
#[async_trait]
pub trait TickStore: fmt::Debug + Send + Sync {
    /// The latest completed tick recorded for `job`, if any.
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError>;

    /// Records `tick` (Unix ms) as completed for `job`: raises the latest
    /// completed tick to it if it is later, and marks `tick` itself as done
    /// for at least `keep`. Not cancel safe in the sense that a cancelled
    /// call may or may not have recorded the tick.
    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError>;

    /// Whether `tick` itself is marked as completed for `job` (see
    /// [`TickStore::record_completed`] for how long marks last). Cancel safe
    /// (a read).
    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError>;

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

    /// Applies `write` to the record of `tick` of `job` in one server-side
    /// step (see the contract) and answers whether it won. Not cancel safe
    /// in the sense that a cancelled call may or may not have applied the
    /// write: send the same write again to learn which.
    ///
    /// The default refuses with a [`BackendErrorKind::Config`] error: a
    /// store that keeps no records cannot run the fenced protocol, and the
    /// scheduler then runs nothing (fail closed).
    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        let _ = (job, tick, write, keep);
        Err(no_records())
    }

    /// The record of `tick` of `job`, if there is one. Cancel safe (a read).
    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        let _ = (job, tick);
        Err(no_records())
    }

    /// [`TickStore::write_tick`] for each `(job, tick, write)` of `writes`,
    /// in as few round trips as the backend allows, one answer per item in
    /// order. Each item is its own step (a batch is not a transaction).
    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        write_ticks_apart(self, writes, keep).await
    }

    /// Whether [`TickStore::start_checked_many`] makes its checks and its
    /// writes in one server-side step (one round trip for a batch), so a
    /// scheduler should call it instead of reading and writing apart.
    /// `false` (the default) where it would only chain the reads and the
    /// writes, as the default method does.
    fn checks_starts_in_one_step(&self) -> bool {
        false
    }

    /// For each `(job, tick, write, check)` of `starts` (`write` a
    /// [`TickWrite::Start`]), makes the checks of `check` and, where they
    /// pass, the write, answering each as [`StartCheck::verdict`] says for
    /// what the store holds, or with the write's answer. One answer per
    /// item, in order; each item is its own step. Not cancel safe in the
    /// sense of [`TickStore::write_tick`].
    ///
    /// The default reads the server's clock, the marks and the latest
    /// ticks (together), then writes the starts that pass: what a scheduler
    /// does itself, in two round trips. A store that can make the checks in
    /// the write's own statement overrides it and says so in
    /// [`TickStore::checks_starts_in_one_step`].
    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        start_checked_apart(self, starts, keep).await
    }

    /// The latest completed tick of each of `jobs`, in order: what
    /// [`TickStore::last_completed`] answers for each, in as few round trips
    /// as the backend allows. Jobs may repeat. Cancel safe (a read).
    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        join_all(jobs.iter().map(|job| self.last_completed(job))).await
    }

    /// Whether each `(job, tick)` of `ticks` is marked as completed, in
    /// order: what [`TickStore::is_completed`] answers for each, in as few
    /// round trips as the backend allows. Cancel safe (a read).
    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        join_all(
            ticks
                .iter()
                .map(|(job, tick)| self.is_completed(job, *tick)),
        )
        .await
    }

    /// Records each `(job, tick)` of `ticks` as completed, keeping its mark
    /// for at least `keep`: what [`TickStore::record_completed`] does for
    /// each, in as few round trips as the backend allows, with one result
    /// per item in order. A job may appear with several ticks; the latest
    /// completed tick still only ever rises. Not cancel safe in the sense
    /// that a cancelled call may have recorded any subset of the ticks; an
    /// item's error likewise leaves its tick recorded or not.
    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        join_all(
            ticks
                .iter()
                .map(|(job, tick)| self.record_completed(job, *tick, keep)),
        )
        .await
    }
}

fn no_records() -> BackendError {
    BackendError::new(
        BackendErrorKind::Config,
        "this tick store keeps no tick records (TickStore::write_tick); use a backend's own tick store",
    )
}

/// Sends each write of `writes` as its own [`TickStore::write_tick`], all
/// at once, one answer per item in order: the default of
/// [`TickStore::write_ticks_many`], and what a store that batches writes
/// only on some deployments (Redis Cluster, whose batches span slots) sends
/// on the others. Not cancel safe in the sense of [`TickStore::write_tick`].
pub async fn write_ticks_apart<S: TickStore + ?Sized>(
    store: &S,
    writes: &[(LockName, i64, TickWrite)],
    keep: Duration,
) -> Vec<Result<TickAnswer, BackendError>> {
    join_all(
        writes
            .iter()
            .map(|(job, tick, write)| store.write_tick(job, *tick, write, keep)),
    )
    .await
}

/// [`TickStore::start_checked_many`] made apart: the server's clock, the
/// marks and the latest ticks read together, then the starts that pass
/// written in one batch; two round trips. The trait's default, and what a
/// store that makes the checks in one step only on some deployments (Redis
/// Cluster, whose batches span slots) sends on the others. Not cancel safe
/// in the sense of [`TickStore::write_tick`].
pub async fn start_checked_apart<S: TickStore + ?Sized>(
    store: &S,
    starts: &[(LockName, i64, TickWrite, StartCheck)],
    keep: Duration,
) -> Vec<Result<StartVerdict, BackendError>> {
    let marks: Vec<(LockName, i64)> = starts
        .iter()
        .map(|(job, tick, _, _)| (job.clone(), *tick))
        .collect();
    let jobs: Vec<LockName> = starts.iter().map(|(job, ..)| job.clone()).collect();
    let (server, marked, last) = futures_util::join!(
        store.server_time(),
        store.is_completed_many(&marks),
        store.last_completed_many(&jobs),
    );
    let mut out: Vec<Option<Result<StartVerdict, BackendError>>> = Vec::new();
    let mut writes = Vec::new();
    for (i, ((job, tick, write, check), (marked, last))) in
        starts.iter().zip(marked.into_iter().zip(last)).enumerate()
    {
        let read = server
            .as_ref()
            .map_err(BackendError::copied)
            .and_then(|server| Ok((*server, marked?, last?)));
        match read {
            Err(e) => out.push(Some(Err(e))),
            Ok((server, marked, last)) => match check.verdict(*tick, server, marked, last) {
                Some(refused) => out.push(Some(Ok(refused))),
                None => {
                    out.push(None);
                    writes.push((i, (job.clone(), *tick, write.clone())));
                }
            },
        }
    }
    let (at, writes): (Vec<usize>, Vec<_>) = writes.into_iter().unzip();
    if !writes.is_empty() {
        for (i, answer) in at
            .into_iter()
            .zip(store.write_ticks_many(&writes, keep).await)
        {
            out[i] = Some(answer.map(StartVerdict::Written));
        }
    }
    out.into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    "the tick store answered fewer writes than it was sent",
                ))
            })
        })
        .collect()
}
