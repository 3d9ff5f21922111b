//! Running one tick under its own lock: exactly one replica runs it, and a
//! finished tick stays marked so a replica with a slower clock cannot run it
//! again.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use lock_core::{Error as LockError, LeaseHandle, LockGuard, LockName};
use tokio::task::JoinError;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::job::JobSpec;
use crate::runtime::{RunReport, Runtime};
use crate::{clock, JobContext, JobError, TickOutcome};

/// One tick to run, and whether it catches up a missed one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tick {
    pub(crate) at: DateTime<Utc>,
    pub(crate) catch_up: bool,
}

/// The lock of one tick: `<job>/<scheduled instant in Unix ms>`. Every
/// replica derives the same name from the schedule, whatever its clock.
pub(crate) fn tick_lock_name(job: &JobSpec, at: DateTime<Utc>) -> Result<LockName, LockError> {
    LockName::new(format!("{}/{}", job.name, at.timestamp_millis()))
}

/// Runs `tick` of `job` if this replica wins its lock, and reports the outcome.
pub(crate) async fn run_tick(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    tick: Tick,
    leader: Option<&LeaseHandle>,
) -> TickOutcome {
    let outcome = attempt(rt, job, tick, leader).await;
    rt.report(RunReport {
        job: job.name.as_str().to_owned(),
        scheduled: tick.at,
        outcome,
        catch_up: tick.catch_up,
    });
    outcome
}

async fn attempt(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    tick: Tick,
    leader: Option<&LeaseHandle>,
) -> TickOutcome {
    let label = job.label();
    if leader.is_some_and(|l| !l.is_held()) {
        debug!(job = label, tick = %tick.at, "not the leader any more; not firing");
        return TickOutcome::Skipped;
    }
    let name = match tick_lock_name(job, tick.at) {
        Ok(n) => n,
        Err(e) => {
            warn!(job = label, error = %e, "cannot name the tick's lock");
            return TickOutcome::Skipped;
        }
    };
    // A missed tick's lock may still be held by a replica that died running
    // it; waiting up to one TTL lets that lease run out instead of dropping
    // the tick. A live holder keeps it, and then the tick is skipped.
    let acquired = if tick.catch_up {
        let opts = job.options.clone().with_acquire_timeout(job.options.ttl());
        rt.locker.lock(&name, &opts).await
    } else {
        rt.locker.try_lock(&name, &job.options).await
    };
    let guard = match acquired {
        Ok(g) => g,
        Err(
            LockError::Contended { .. } | LockError::HeldLocally { .. } | LockError::Timeout { .. },
        ) => {
            debug!(job = label, tick = %tick.at, "another replica has this tick");
            return TickOutcome::Skipped;
        }
        Err(e) => {
            warn!(job = label, tick = %tick.at, error = %e, "could not take the tick's lock; not running (fail closed)");
            return TickOutcome::Skipped;
        }
    };
    if let Some(outcome) = ahead_of_server(rt, label, tick.at).await {
        let _ = guard.release().await;
        return outcome;
    }
    // Checked while holding the lock, so a replica that finished this tick
    // either still holds its completion mark or has recorded it. The
    // recorded mark is what counts when that replica has since died on a
    // session backend (Postgres), whose locks die with their session.
    match rt
        .ticks
        .is_completed(&job.name, tick.at.timestamp_millis())
        .await
    {
        Ok(true) => {
            debug!(job = label, tick = %tick.at, "tick marked completed by a replica");
            let _ = guard.release().await;
            return TickOutcome::Skipped;
        }
        Ok(false) => {}
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the tick's completion mark; not running (fail closed)");
            let _ = guard.release().await;
            return TickOutcome::Skipped;
        }
    }
    match rt.ticks.last_completed(&job.name).await {
        Ok(Some(last)) if already_done(rt, tick.at, last) => {
            debug!(job = label, tick = %tick.at, "tick already completed by a replica");
            let _ = guard.release().await;
            return TickOutcome::Skipped;
        }
        Ok(_) => {}
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the last completed tick; not running (fail closed)");
            let _ = guard.release().await;
            return TickOutcome::Skipped;
        }
    }
    execute(rt, job, tick, leader, guard).await
}

/// Refuses a tick that lies beyond the server's clock plus the skew
/// tolerance: this replica's clock is then far ahead (stepped, or never
/// synchronised). Running it would record a far-future tick as the latest
/// completed one, and every replica with a true clock would skip its ticks
/// as past until real time caught up. `Some(Skipped)` means do not run;
/// an unreadable server clock fails closed like the tick store does.
async fn ahead_of_server(rt: &Runtime, label: &str, tick: DateTime<Utc>) -> Option<TickOutcome> {
    let server_ms = match rt.ticks.server_time().await {
        Ok(Some(ms)) => ms,
        Ok(None) => return None,
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the server's clock; not running (fail closed)");
            return Some(TickOutcome::Skipped);
        }
    };
    let tolerance_ms = i64::try_from(rt.tolerance.as_millis()).unwrap_or(i64::MAX);
    let ahead_ms = tick.timestamp_millis().saturating_sub(server_ms);
    if ahead_ms <= tolerance_ms {
        return None;
    }
    warn!(
        job = label,
        tick = %tick,
        ahead_ms,
        tolerance_ms,
        "this tick is further ahead of the server's clock than the skew tolerance: this replica's clock is wrong; not running"
    );
    Some(TickOutcome::Skipped)
}

/// Whether the tick store shows `tick` as done, given the latest completed
/// tick `last` (Unix ms).
///
/// The store keeps only the latest tick, so `last > tick` does not prove that
/// `tick` itself ran: a replica whose clock is ahead may have finished a
/// later tick while this one (which it skipped, being busy or stalled) is
/// still due on slower replicas. Within the skew tolerance the tick's own
/// lock decides (a finished tick keeps it as a completion mark); a later
/// record only counts once the tick is older than the tolerance, on this
/// replica's clock or by the record itself.
fn already_done(rt: &Runtime, tick: DateTime<Utc>, last: i64) -> bool {
    let tick_ms = tick.timestamp_millis();
    let tolerance_ms = i64::try_from(rt.tolerance.as_millis()).unwrap_or(i64::MAX);
    let late = (rt.clock.now() - tick).num_milliseconds() > tolerance_ms;
    last == tick_ms || (last > tick_ms && (late || last.saturating_sub(tick_ms) > tolerance_ms))
}

async fn execute(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    tick: Tick,
    leader: Option<&LeaseHandle>,
    guard: LockGuard,
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
    let lag = rt.clock.now() - tick.at;
    rt.metrics.observe_lag(
        label,
        lag.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6,
    );
    let started = Instant::now();
    let mut task = rt.tracker.spawn((job.handler)(ctx));
    let leader_lost = async {
        match leader {
            Some(l) => l.lost().await,
            None => std::future::pending().await,
        }
    };
    let joined: Option<Result<Result<(), JobError>, JoinError>> = tokio::select! {
        biased;
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
        joined = &mut task => Some(joined),
    };
    let Some(joined) = joined else {
        cancel.cancel();
        task.abort();
        // Wait until the handler's future is really dropped, so "aborted"
        // means nothing of it runs any more; then free the tick at once.
        let _ = task.await;
        let _ = guard.release().await;
        rt.metrics
            .observe_duration(label, started.elapsed().as_secs_f64());
        return TickOutcome::Aborted;
    };
    rt.metrics
        .observe_duration(label, started.elapsed().as_secs_f64());
    let outcome = match joined {
        Ok(Ok(())) => TickOutcome::Success,
        Ok(Err(e)) => {
            warn!(job = label, tick = %tick.at, error = %e, "job failed");
            TickOutcome::Failure
        }
        Err(e) if e.is_panic() => {
            warn!(job = label, tick = %tick.at, "job panicked; the panic was caught");
            record(rt, job, tick).await;
            let _ = guard.release().await;
            return TickOutcome::Panicked;
        }
        Err(_) => return TickOutcome::Aborted,
    };
    match lease.verify().await {
        Ok(()) => {}
        Err(LockError::LockLost { reason, .. }) => {
            warn!(job = label, tick = %tick.at, %reason, "tick lock lost before the run was confirmed; counting it aborted");
            return TickOutcome::Aborted;
        }
        Err(e) => {
            warn!(job = label, error = %e, "could not re-verify the tick lock; relying on its local deadline");
            if lease.assert_held().is_err() {
                return TickOutcome::Aborted;
            }
        }
    }
    let recorded = record(rt, job, tick).await;
    mark_done(rt, job, tick, guard, recorded).await;
    outcome
}

/// How long a tick's completion mark is kept in the store: past every
/// replica's firing of the tick (the skew tolerance, twice for margin), and
/// at least a minute. Older ticks are covered by the latest completed one.
fn mark_keep(rt: &Runtime) -> Duration {
    rt.tolerance.saturating_mul(2).max(Duration::from_secs(60))
}

async fn record(rt: &Arc<Runtime>, job: &JobSpec, tick: Tick) -> bool {
    match rt
        .ticks
        .record_completed(&job.name, tick.at.timestamp_millis(), mark_keep(rt))
        .await
    {
        Ok(()) => true,
        Err(e) => {
            warn!(job = job.label(), error = %e, "could not record the completed tick; keeping its lock as the only mark");
            false
        }
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
