//! Deciding whether this replica runs one tick: exactly one replica takes
//! its lock, and a finished tick stays marked so a replica with a slower
//! clock cannot run it again.

use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use lock_core::{
    BackendError, Error as LockError, LeaseHandle, LockGuard, LockName, StartCheck, StartVerdict,
    TickAnswer, TickWrite,
};
use tracing::{debug, warn};

use crate::job::JobSpec;
use crate::pause::{self, ProtocolPoint};
use crate::run::{execute, record_keep};
use crate::runtime::Runtime;
use crate::TickOutcome;

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
    rt.report(job, tick, outcome);
    outcome
}

async fn attempt(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    tick: Tick,
    leader: Option<&LeaseHandle>,
) -> TickOutcome {
    let label = job.label();
    if rt.is_stopping() {
        debug!(job = label, tick = %tick.at, "shutting down; not firing");
        return TickOutcome::Skipped;
    }
    if leader.is_some_and(|l| !l.is_held()) {
        debug!(job = label, tick = %tick.at, "not the leader any more; not firing");
        return TickOutcome::Skipped;
    }
    pause::at(rt, ProtocolPoint::Fired, label, tick.at).await;
    let name = match tick_lock_name(job, tick.at) {
        Ok(n) => n,
        Err(e) => {
            warn!(job = label, error = %e, "cannot name the tick's lock");
            return TickOutcome::Skipped;
        }
    };
    // Shutdown (or a lost leadership) abandons the acquire: a catch-up's
    // wait could otherwise outlast the shutdown deadline by a TTL, and then
    // start a run after shutdown was called. Dropping the acquire is cancel
    // safe: a lock granted meanwhile is released in the background.
    let Some(acquired) = unless_stopped(rt, leader, acquire(rt, job, tick, &name)).await else {
        debug!(job = label, tick = %tick.at, "stopping; not firing");
        return TickOutcome::Skipped;
    };
    let guard = match acquired {
        Ok(g) => g,
        Err(
            LockError::HeldElsewhere { .. }
            | LockError::HeldLocally { .. }
            | LockError::Timeout { .. },
        ) => {
            debug!(job = label, tick = %tick.at, "another replica has this tick");
            return TickOutcome::Skipped;
        }
        Err(e) => {
            warn!(job = label, tick = %tick.at, error = %e, "could not take the tick's lock; not running (fail closed)");
            return TickOutcome::Skipped;
        }
    };
    let started = if rt.ticks.checks_starts() {
        // The store makes the checks in the write's own step: one round
        // trip between the lock and the handler instead of two.
        if rt.is_stopping() {
            debug!(job = label, tick = %tick.at, "stopping; not running");
            let _ = guard.release().await;
            return TickOutcome::Skipped;
        }
        pause::at(rt, ProtocolPoint::Claimed, label, tick.at).await;
        checked_start(rt, job, tick, &guard).await
    } else {
        let refused = unless_stopped(rt, leader, refusal(rt, job, tick))
            .await
            .unwrap_or_else(|| {
                debug!(job = label, tick = %tick.at, "stopping; not running");
                Some(TickOutcome::Skipped)
            });
        if let Some(outcome) = refused {
            let _ = guard.release().await;
            return outcome;
        }
        pause::at(rt, ProtocolPoint::Claimed, label, tick.at).await;
        start(rt, job, tick, &guard).await
    };
    match started {
        Ok(token) => {
            pause::at(rt, ProtocolPoint::Started, label, tick.at).await;
            execute(rt, job, tick, leader, guard, token).await
        }
        Err(outcome) => {
            let _ = guard.release().await;
            outcome
        }
    }
}

/// Writes the tick's `Started` record under the fencing token of `guard`,
/// and answers the token to complete it with if this replica's write won
/// (run the handler), else the outcome to report.
///
/// The write is not raced against shutdown: dropped midway it may have
/// landed, and a `Started` record whose runner never ran is then marked
/// abandoned later, which is the answer at most once owes a tick started by
/// a run that stopped.
async fn start(
    rt: &Runtime,
    job: &JobSpec,
    tick: Tick,
    guard: &LockGuard,
) -> Result<u64, TickOutcome> {
    let (token, write) = start_write(rt, job, guard);
    let answer = rt
        .ticks
        .write_tick(
            &job.name,
            tick.at.timestamp_millis(),
            write,
            record_keep(rt, job),
        )
        .await;
    started(job, tick, token, answer)
}

/// [`start`] and the checks of [`refusal`] in one call, for a store that
/// makes them in the write's own step. Not raced against shutdown, like
/// [`start`].
async fn checked_start(
    rt: &Runtime,
    job: &JobSpec,
    tick: Tick,
    guard: &LockGuard,
) -> Result<u64, TickOutcome> {
    let label = job.label();
    let (token, write) = start_write(rt, job, guard);
    let verdict = rt
        .ticks
        .start_checked(
            &job.name,
            tick.at.timestamp_millis(),
            write,
            start_check(rt, tick),
            record_keep(rt, job),
        )
        .await;
    match verdict {
        Ok(StartVerdict::Written(answer)) => started(job, tick, token, Ok(answer)),
        Ok(refused) => Err(refused_outcome(rt, label, tick, &refused)),
        Err(e) => {
            warn!(job = label, tick = %tick.at, error = %e, "could not check the tick and write its start record; not running (fail closed)");
            Err(TickOutcome::Skipped)
        }
    }
}

/// The token of this run and its `Started` write.
fn start_write(rt: &Runtime, job: &JobSpec, guard: &LockGuard) -> (u64, TickWrite) {
    let fencing = guard.handle().fencing_token();
    let token = fencing.unwrap_or(0);
    let replica = match fencing {
        Some(_) => rt.replica.clone(),
        // Without tokens every run's token is 0: the replica field tells
        // this run's record from another's (a retry finds its own).
        None => {
            let n = rt.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("{}#{n}", rt.replica)
        }
    };
    let write = TickWrite::Start {
        token,
        replica,
        at: rt.clock.now().timestamp_millis(),
        on_stale: job.delivery.on_stale(fencing.is_some()),
    };
    (token, write)
}

/// What a `Started` write's answer means for this run: its token if the
/// write won, else the outcome to report.
fn started(
    job: &JobSpec,
    tick: Tick,
    token: u64,
    answer: Result<TickAnswer, BackendError>,
) -> Result<u64, TickOutcome> {
    let label = job.label();
    match answer {
        Ok(TickAnswer::Started) => Ok(token),
        Ok(TickAnswer::Abandoned) => {
            warn!(job = label, tick = %tick.at, token, "this tick was started by a replica whose lock expired before it completed; marked abandoned, not run again (at most once)");
            Err(TickOutcome::Abandoned)
        }
        Ok(TickAnswer::Completed) => Err(TickOutcome::Skipped),
        Ok(TickAnswer::Refused(record)) => {
            debug!(job = label, tick = %tick.at, ?record, "tick already started, completed or abandoned; not running");
            Err(TickOutcome::Skipped)
        }
        Err(e) => {
            warn!(job = label, tick = %tick.at, error = %e, "could not write the tick's start record; not running (fail closed)");
            Err(TickOutcome::Skipped)
        }
    }
}

/// Takes the tick's lock: at once, or for a missed tick, waiting up to one
/// TTL.
async fn acquire(
    rt: &Runtime,
    job: &JobSpec,
    tick: Tick,
    name: &LockName,
) -> Result<LockGuard, LockError> {
    // A missed tick's lock may still be held by a replica that died running
    // it; waiting up to one TTL lets that lease run out instead of dropping
    // the tick. A live holder keeps it, and then the tick is skipped.
    if tick.catch_up {
        let opts = job.options.clone().with_acquire_timeout(job.options.ttl());
        rt.locker.lock(name, &opts).await
    } else {
        rt.locker.try_lock(name, &job.options).await
    }
}

/// `work`'s output, or `None` as soon as shutdown begins or, in leader
/// mode, the leadership is lost (`work` is then dropped).
async fn unless_stopped<T>(
    rt: &Runtime,
    leader: Option<&LeaseHandle>,
    work: impl Future<Output = T>,
) -> Option<T> {
    let leader_lost = async {
        match leader {
            Some(l) => {
                l.lost().await;
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        _ = rt.soft_stop.cancelled() => None,
        _ = leader_lost => None,
        out = work => Some(out),
    }
}

/// Why this replica must not run `tick` although it holds its lock, if it
/// must not: ahead of the server's clock, or already completed
/// ([`StartCheck::verdict`]). `None` means run it.
///
/// The three reads go out together (each joins its kind's batch): they are
/// independent reads taken while holding the lock, so their order does not
/// matter, and the verdict is the same as reading them one after another.
/// Checked while holding the lock, so a replica that finished this tick
/// either still holds its completion mark or has recorded it; the recorded
/// mark is what counts when that replica has since died on a session
/// backend (Postgres), whose locks die with their session.
async fn refusal(rt: &Runtime, job: &JobSpec, tick: Tick) -> Option<TickOutcome> {
    let label = job.label();
    let tick_ms = tick.at.timestamp_millis();
    let (server, marked, last) = tokio::join!(
        rt.ticks.server_time(),
        rt.ticks.is_completed(&job.name, tick_ms),
        rt.ticks.last_completed(&job.name),
    );
    let server = match server {
        Ok(server) => server,
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the server's clock; not running (fail closed)");
            return Some(TickOutcome::Skipped);
        }
    };
    let marked = match marked {
        Ok(marked) => marked,
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the tick's completion mark; not running (fail closed)");
            return Some(TickOutcome::Skipped);
        }
    };
    let last = match last {
        Ok(last) => last,
        Err(e) => {
            warn!(job = label, error = %e, "cannot read the last completed tick; not running (fail closed)");
            return Some(TickOutcome::Skipped);
        }
    };
    start_check(rt, tick)
        .verdict(tick_ms, server, marked, last)
        .map(|refused| refused_outcome(rt, label, tick, &refused))
}

/// The checks of `tick` as this replica makes them now: its skew tolerance,
/// and whether the tick is past it on this replica's clock.
fn start_check(rt: &Runtime, tick: Tick) -> StartCheck {
    let tolerance_ms = i64::try_from(rt.tolerance.as_millis()).unwrap_or(i64::MAX);
    StartCheck {
        tolerance_ms,
        late: (rt.clock.now() - tick.at).num_milliseconds() > tolerance_ms,
    }
}

/// Logs why a tick the checks refused is not run, and the outcome to report.
///
/// A tick ahead of the server's clock plus the skew tolerance means this
/// replica's clock is far ahead (stepped, or never synchronised). Running
/// it would record a far-future tick as the latest completed one, and every
/// replica with a true clock would skip its ticks as past until real time
/// caught up.
fn refused_outcome(rt: &Runtime, label: &str, tick: Tick, refused: &StartVerdict) -> TickOutcome {
    match refused {
        StartVerdict::Ahead { server_ms } => {
            let tolerance_ms = i64::try_from(rt.tolerance.as_millis()).unwrap_or(i64::MAX);
            let ahead_ms = tick.at.timestamp_millis().saturating_sub(*server_ms);
            warn!(
                job = label,
                tick = %tick.at,
                ahead_ms,
                tolerance_ms,
                "this tick is further ahead of the server's clock than the skew tolerance: this replica's clock is wrong; not running"
            );
        }
        StartVerdict::Marked => {
            debug!(job = label, tick = %tick.at, "tick marked completed by a replica");
        }
        StartVerdict::Covered { last } => {
            debug!(job = label, tick = %tick.at, last, "tick already completed by a replica");
        }
        StartVerdict::Written(answer) => {
            debug!(job = label, tick = %tick.at, ?answer, "not running");
        }
    }
    TickOutcome::Skipped
}
