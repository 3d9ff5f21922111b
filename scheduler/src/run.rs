//! Running one tick whose lock this replica holds: the handler, its abort
//! on loss or shutdown, and the completion mark a finished tick leaves.

use std::sync::Arc;
use std::time::Duration;

use chrono::TimeDelta;
use lock_core::{Error as LockError, LeaseHandle, LockGuard, TickAnswer, TickWrite};
use tokio::task::JoinError;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::job::JobSpec;
use crate::pause::{self, ProtocolPoint};
use crate::per_tick::Tick;
use crate::runtime::Runtime;
use crate::{clock, JobContext, JobError, TickOutcome};

/// Runs the handler under `guard`, whose `Started` record with `token` won,
/// unless shutdown has begun, and writes its `Completed` record when it
/// returns. The outcome is the handler's (`Success`, `Failure`, `Panicked`)
/// only when that record landed: `FencedOut` when it was refused,
/// `Unrecorded` when the store could not be written.
pub(crate) async fn execute(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    tick: Tick,
    leader: Option<&LeaseHandle>,
    guard: LockGuard,
    token: u64,
) -> TickOutcome {
    let label = job.label();
    let lease = guard.handle();
    let cancel = rt.soft_stop.child_token();
    let ctx = JobContext {
        job: label.to_owned(),
        scheduled: tick.at,
        lease: lease.clone(),
        leader: leader.cloned(),
        cancel: cancel.clone(),
        catch_up: tick.catch_up,
    };
    // The handler is called inside its task, so a panic in the code it runs
    // before its first await is caught and counted like any other.
    let handler = Arc::clone(&job.handler);
    let Some(mut task) = rt.start_run(async move { handler(ctx).await }) else {
        debug!(job = label, tick = %tick.at, "shutting down; not starting the run");
        let _ = guard.release().await;
        return TickOutcome::Skipped;
    };
    let lag = rt.clock.now() - tick.at;
    job.metrics
        .observe_lag(lag.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6);
    let started = Instant::now();
    let leader_lost = async {
        match leader {
            Some(l) => l.lost().await,
            None => std::future::pending().await,
        }
    };
    // A handler that has returned has done its work, even if the lock's loss
    // arrives in the same wake-up: its result wins, so the tick is marked
    // finished instead of being left for another replica to run again.
    let joined: Option<Result<Result<(), JobError>, JoinError>> = tokio::select! {
        biased;
        joined = &mut task => Some(joined),
        reason = lease.lost() => {
            warn!(job = label, tick = %tick.at, %reason, "tick lock lost; aborting the run");
            None
        }
        reason = leader_lost => {
            warn!(job = label, tick = %tick.at, %reason, "leadership lost; aborting the run");
            None
        }
        _ = rt.hard_stop.cancelled() => {
            warn!(job = label, tick = %tick.at, "shutdown deadline passed; aborting the run");
            None
        }
    };
    let Some(joined) = joined else {
        cancel.cancel();
        task.abort();
        // Wait until the handler's future is really dropped, so "aborted"
        // means nothing of it runs any more; then free the tick at once.
        let _ = task.await;
        let _ = guard.release().await;
        job.metrics
            .observe_duration(started.elapsed().as_secs_f64());
        return TickOutcome::Aborted;
    };
    job.metrics
        .observe_duration(started.elapsed().as_secs_f64());
    let outcome = match joined {
        Ok(Ok(())) => TickOutcome::Success,
        Ok(Err(e)) => {
            warn!(job = label, tick = %tick.at, error = %e, "job failed");
            TickOutcome::Failure
        }
        Err(e) if e.is_panic() => {
            warn!(job = label, tick = %tick.at, "job panicked; the panic was caught");
            TickOutcome::Panicked
        }
        Err(_) => return TickOutcome::Aborted,
    };
    pause::at(rt, ProtocolPoint::HandlerReturned, label, tick.at).await;
    // The handler finished: record it before anything else, under the
    // token. If this replica stalled past its lock meanwhile, another one
    // has marked the tick abandoned or taken it over, and the write is
    // refused (fenced out) instead of landing on a record no longer ours.
    // A write that could not be made leaves the tick `Started`: the run is
    // then reported `Unrecorded`, whatever the handler returned (an error or
    // a panic is in the log line above), since the store does not show the
    // tick done.
    let (recorded, outcome) = match complete(rt, job, tick, token).await {
        Completion::Recorded => (true, outcome),
        Completion::Failed => (false, TickOutcome::Unrecorded),
        Completion::FencedOut => {
            let _ = guard.release().await;
            return TickOutcome::FencedOut;
        }
    };
    let lost = match lease.verify().await {
        Ok(()) => false,
        Err(LockError::LockLost { reason, .. }) => {
            warn!(job = label, tick = %tick.at, %reason, "tick lock found lost after the run finished and was recorded complete");
            true
        }
        Err(e) => {
            warn!(job = label, error = %e, "could not re-verify the tick lock; relying on its local deadline");
            lease.assert_held().is_err()
        }
    };
    // A panicked run's lock is freed at once (the crate's documented
    // contract): its `Completed` record alone keeps the tick from running
    // again, so no mark is needed.
    if lost || outcome == TickOutcome::Panicked {
        let _ = guard.release().await;
    } else {
        mark_done(rt, job, tick, guard, recorded).await;
    }
    outcome
}

/// How long a tick's completion mark is kept in the store: past every
/// replica's firing of the tick (the skew tolerance, twice for margin), and
/// at least a minute. Older ticks are covered by the latest completed one.
fn mark_keep(rt: &Runtime) -> Duration {
    rt.tolerance.saturating_mul(2).max(Duration::from_secs(60))
}

/// How long a tick's record is kept: as long as its mark, and for a job
/// that catches up every missed tick in a window, as long as the window, so
/// a catch-up never finds a started tick's record gone.
pub(crate) fn record_keep(rt: &Runtime, job: &JobSpec) -> Duration {
    match job.missed {
        crate::MissedTicks::RunAll { window, .. } => mark_keep(rt).max(window),
        _ => mark_keep(rt),
    }
}

/// How a run's `Completed` write ended.
enum Completion {
    /// Completed under this run's token (the tick is marked done too).
    Recorded,
    /// Refused: another replica took the tick over or marked it abandoned.
    FencedOut,
    /// The store could not be written, on any of [`COMPLETE_ATTEMPTS`].
    Failed,
}

/// How many times a run sends its `Completed` write before giving up on
/// it. The write is conditional on the run's token, so sending it again is
/// safe: after a reply lost to a timeout, the retry finds the record
/// already `Completed` with this token and answers as the first write did.
const COMPLETE_ATTEMPTS: u32 = 3;

/// The wait before the first retry of a failed `Completed` write; doubled
/// before each further one.
const COMPLETE_RETRY: Duration = Duration::from_millis(100);

/// Writes the `Completed` record of `tick` under `token`, which in the same
/// step marks the tick done for the missed-tick logic. A write the store
/// fails (an error or a timeout) is sent again, up to
/// [`COMPLETE_ATTEMPTS`] in all, unless the shutdown deadline passes first.
async fn complete(rt: &Arc<Runtime>, job: &JobSpec, tick: Tick, token: u64) -> Completion {
    let label = job.label();
    let mut wait = COMPLETE_RETRY;
    let mut attempt = 1;
    loop {
        let answer = rt
            .ticks
            .write_tick(
                &job.name,
                tick.at.timestamp_millis(),
                TickWrite::Complete { token },
                record_keep(rt, job),
            )
            .await;
        pause::at(rt, ProtocolPoint::CompletedSent, label, tick.at).await;
        match answer {
            Ok(TickAnswer::Completed) => return Completion::Recorded,
            Ok(other) => {
                warn!(job = label, tick = %tick.at, token, answer = ?other, "the tick's completion was refused: this replica stalled past its lock, and another replica took the tick over or marked it abandoned (fenced out)");
                return Completion::FencedOut;
            }
            Err(e) if attempt < COMPLETE_ATTEMPTS => {
                info!(job = label, tick = %tick.at, attempt, error = %e, "could not record the completed tick; sending the write again");
            }
            Err(e) => {
                warn!(job = label, tick = %tick.at, attempts = attempt, error = %e, "could not record the completed tick: it stays Started in the store (outcome unrecorded); keeping its lock as its only mark");
                return Completion::Failed;
            }
        }
        // Past the shutdown deadline the write is not sent again: shutdown
        // returns within its grace, and the tick is left `Started` under
        // its lock, as for a write that failed every time.
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = rt.hard_stop.cancelled() => {
                warn!(job = label, tick = %tick.at, attempts = attempt, "shutdown deadline passed before the completed tick could be recorded: it stays Started in the store (outcome unrecorded)");
                return Completion::Failed;
            }
        }
        wait = wait.saturating_mul(2);
        attempt += 1;
    }
}

/// Keeps the tick's lock until every replica within the skew tolerance has
/// passed the tick, instead of releasing it: released at once, a lock lets
/// a replica whose clock is behind take the same tick again.
async fn mark_done(rt: &Arc<Runtime>, job: &JobSpec, tick: Tick, guard: LockGuard, recorded: bool) {
    let tolerance = TimeDelta::from_std(rt.tolerance).unwrap_or(TimeDelta::MAX);
    let remaining = tick
        .at
        .checked_add_signed(tolerance)
        .map_or(rt.tolerance, |until| clock::until(rt.clock.now(), until));
    let hold = if recorded {
        remaining
    } else {
        rt.tolerance.max(remaining)
    };
    // A hold is a TTL on the server, which refuses one below its minimum
    // (whole seconds on etcd): a mark kept slightly long is harmless, one
    // refused is no mark at all.
    let min = rt
        .locker
        .backend()
        .map_or(Duration::ZERO, |b| b.capabilities().min_ttl);
    let hold = if hold.is_zero() { hold } else { hold.max(min) };
    let result = if hold.is_zero() {
        guard.release().await
    } else {
        guard.retain_for(hold).await
    };
    match result {
        Ok(()) => {
            debug!(job = job.label(), tick = %tick.at, ?hold, "tick done; lock kept as its completion mark")
        }
        Err(e) => {
            info!(job = job.label(), tick = %tick.at, error = %e, "could not keep the completion mark; the recorded tick still guards it")
        }
    }
}
