//! The loop that waits for the jobs' ticks and runs them: one task for every
//! job of a scheduler (or of a leader's term), one timer for the next
//! instant any job is due, and the jobs' runs polled as futures of that task.
//!
//! A task and a timer per job cost each replica a spawn, a task allocation
//! and a timer per job per tick: with a thousand jobs due at the same
//! instant, that bookkeeping was a share of the burst every tick's lag waits
//! behind. The handlers still run in tasks of their own (`execute`), so a
//! slow handler holds up nothing here.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use futures_util::stream::{FuturesUnordered, StreamExt};
use lock_core::LeaseHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock;
use crate::job::JobSpec;
use crate::overlap::launch;
use crate::per_tick::Tick;
use crate::runtime::Runtime;

/// The longest single sleep: the wall clock is re-read at least this often,
/// so a clock stepped forward is noticed within it.
const MAX_NAP: Duration = Duration::from_secs(1);

/// Where one job's schedule stands.
struct Cursor {
    job: Arc<JobSpec>,
    /// The latest tick handed to its runs (or the moment it started).
    after: DateTime<Utc>,
}

/// Fires every job's ticks until `stop` is cancelled, then waits for the
/// runs it started: first the missed ticks each job's policy asks for, then
/// every tick after now, on this replica's clock.
pub(crate) async fn drive(
    rt: Arc<Runtime>,
    jobs: Vec<Arc<JobSpec>>,
    stop: CancellationToken,
    leader: Option<LeaseHandle>,
) {
    let leader = leader.as_ref();
    let mut runs = FuturesUnordered::new();
    let mut starting: FuturesUnordered<_> = jobs
        .into_iter()
        .enumerate()
        .map(|(index, job)| catch_up(&rt, index, job))
        .collect();
    let mut cursors: Vec<Option<Cursor>> = (0..starting.len()).map(|_| None).collect();
    let mut due = Due::new();
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    let nap = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(nap);
    // The tick the timer is set for; reset only when the earliest changes,
    // so that a run ending costs no timer.
    let mut armed: Option<DateTime<Utc>> = None;
    loop {
        let earliest = due.peek().map(|Reverse((at, _))| *at);
        if earliest != armed {
            if let Some(at) = earliest {
                nap.as_mut().reset(wake_for(&rt, at));
            }
            armed = earliest;
        }
        tokio::select! {
            biased;
            () = &mut stopped => break,
            Some(started) = starting.next(), if !starting.is_empty() => {
                let Started { index, job, at, missed } = started;
                if !missed.is_empty() {
                    info!(job = job.label(), count = missed.len(), "catching up missed ticks");
                    let batch = missed.into_iter().map(|at| Tick { at, catch_up: true });
                    runs.extend(launch(&rt, &job, batch.collect(), leader));
                }
                queue_next(&mut due, index, &job, job.schedule.next_after(at));
                if let Some(slot) = cursors.get_mut(index) {
                    *slot = Some(Cursor { job, after: at });
                }
            }
            Some(()) = runs.next(), if !runs.is_empty() => {}
            () = &mut nap, if armed.is_some() => {
                let now = rt.clock.now();
                // Sleep on tokio's clock, but decide on the wall clock: a
                // clock stepped back just means sleeping longer.
                if armed.is_some_and(|at| now < at) {
                    armed = None;
                    continue;
                }
                while let Some(&Reverse((next, index))) = due.peek() {
                    if next > now {
                        break;
                    }
                    due.pop();
                    let Some(Some(cursor)) = cursors.get_mut(index) else {
                        continue;
                    };
                    let (batch, following) = fire(&rt, cursor, next, now);
                    runs.extend(launch(&rt, &cursor.job, batch, leader));
                    queue_next(&mut due, index, &cursor.job, following);
                }
                armed = None;
            }
        }
    }
    // Nothing fires any more; the runs already going end on their own (they
    // watch shutdown and the leadership themselves).
    drop(starting);
    while runs.next().await.is_some() {}
}

/// Every job's next tick as (tick, job index), earliest first.
type Due = BinaryHeap<Reverse<(DateTime<Utc>, usize)>>;

/// Queues the next tick of job `index`, or notes that its schedule has none.
fn queue_next(due: &mut Due, index: usize, job: &JobSpec, next: Option<DateTime<Utc>>) {
    match next {
        Some(next) => due.push(Reverse((next, index))),
        None => info!(job = job.label(), "the schedule has no further ticks"),
    }
}

/// When to wake for a tick at `at`: then, or after `MAX_NAP` to re-read
/// the wall clock.
fn wake_for(rt: &Runtime, at: DateTime<Utc>) -> Instant {
    let nap = clock::until(rt.clock.now(), at).min(MAX_NAP);
    let now = Instant::now();
    now.checked_add(nap).unwrap_or(now)
}

/// A job ready to fire: where it starts, and the missed ticks to catch up.
struct Started {
    index: usize,
    job: Arc<JobSpec>,
    at: DateTime<Utc>,
    missed: Vec<DateTime<Utc>>,
}

/// Reads the job's last completed tick and picks the missed ticks its policy
/// asks for.
fn catch_up(rt: &Arc<Runtime>, index: usize, job: Arc<JobSpec>) -> impl Future<Output = Started> {
    let rt = Arc::clone(rt);
    async move {
        let at = rt.clock.now();
        let last = match rt.ticks.last_completed(&job.name).await {
            Ok(ms) => ms.and_then(DateTime::from_timestamp_millis),
            Err(e) => {
                warn!(job = job.label(), error = %e, "cannot read the last completed tick; not catching up");
                None
            }
        };
        let missed = job.missed.select(&job.schedule, last, at);
        Started {
            index,
            job,
            at,
            missed,
        }
    }
}

/// The ticks of `cursor`'s job to run now that the wall clock is at `now`,
/// at or past its tick `next`; moves the cursor past them and gives the
/// job's first tick after now.
fn fire(
    rt: &Runtime,
    cursor: &mut Cursor,
    next: DateTime<Utc>,
    now: DateTime<Utc>,
) -> (Vec<Tick>, Option<DateTime<Utc>>) {
    let job = &cursor.job;
    let (due, following) = job.schedule.due_from(next, now);
    let latest = due.last().copied().unwrap_or(next);
    let batch = due_batch(rt, job, cursor.after, &due, now);
    cursor.after = latest;
    (batch, following)
}

/// The ticks to run after a wake that found `due` (oldest first, not empty)
/// passed since `after`.
///
/// Ticks within the skew tolerance of now run as usual, only late: a timer
/// that fired late (a process starved of CPU) or a clock stepped forward a
/// little leaves them, and a replica whose clock is behind by that much
/// would still be firing them, so they are not missed. The latest due tick
/// always runs. Older ones were missed and follow the job's policy.
fn due_batch(
    rt: &Runtime,
    job: &JobSpec,
    after: DateTime<Utc>,
    due: &[DateTime<Utc>],
    now: DateTime<Utc>,
) -> Vec<Tick> {
    let tolerance = TimeDelta::from_std(rt.tolerance).unwrap_or(TimeDelta::MAX);
    let first_open = now
        .checked_sub_signed(tolerance)
        .map_or(0, |open_from| due.partition_point(|t| *t < open_from))
        .min(due.len().saturating_sub(1));
    let (missed, open) = due.split_at(first_open);
    let mut batch: Vec<Tick> = Vec::new();
    if let Some(&last_missed) = missed.last() {
        // The process stalled, or the clock jumped, past the tolerance.
        let caught_up = job
            .missed
            .select_at(&job.schedule, Some(after), last_missed, now);
        warn!(
            job = job.label(),
            passed = missed.len(),
            running = caught_up.len(),
            "ticks passed unrun"
        );
        batch.extend(caught_up.into_iter().map(|at| Tick { at, catch_up: true }));
    }
    if open.len() > 1 {
        warn!(
            job = job.label(),
            late = open.len() - 1,
            "woke late; running the ticks still within the skew tolerance"
        );
    }
    batch.extend(open.iter().map(|&at| Tick {
        at,
        catch_up: false,
    }));
    batch
}
