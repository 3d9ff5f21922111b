//! The loop that waits for each job's ticks and hands them to the runner.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use lock_core::LeaseHandle;
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

/// Fires `job`'s ticks until `stop` is cancelled: first the missed ticks its
/// policy asks for, then every tick after now, on this replica's clock.
pub(crate) async fn drive(
    rt: Arc<Runtime>,
    job: Arc<JobSpec>,
    stop: CancellationToken,
    leader: Option<LeaseHandle>,
) {
    // Every wait of the loop (the store read included) ends with `stop`.
    tokio::select! {
        biased;
        _ = stop.cancelled() => {}
        _ = fire(&rt, &job, &stop, leader.as_ref()) => {}
    }
}

async fn fire(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    stop: &CancellationToken,
    leader: Option<&LeaseHandle>,
) {
    let start = rt.clock.now();
    let last = match rt.ticks.last_completed(&job.name).await {
        Ok(ms) => ms.and_then(DateTime::from_timestamp_millis),
        Err(e) => {
            warn!(job = job.label(), error = %e, "cannot read the last completed tick; not catching up");
            None
        }
    };
    let missed = job.missed.select(&job.schedule, last, start);
    if !missed.is_empty() && !stop.is_cancelled() {
        info!(
            job = job.label(),
            count = missed.len(),
            "catching up missed ticks"
        );
        let batch = missed.into_iter().map(|at| Tick { at, catch_up: true });
        launch(rt, job, batch.collect(), leader);
    }
    let mut cursor = start;
    let mut following = job.schedule.next_after(start);
    loop {
        let Some(next) = following else {
            info!(job = job.label(), "the schedule has no further ticks");
            return;
        };
        // Sleep on tokio's clock, but decide on the wall clock, re-read after
        // every wake: a clock stepped back just means sleeping longer.
        loop {
            let now = rt.clock.now();
            if now >= next {
                break;
            }
            tokio::time::sleep(clock::until(now, next).min(MAX_NAP)).await;
        }
        let now = rt.clock.now();
        // `next` is the first tick after `cursor`, and now is at or past it.
        let (due, after_now) = job.schedule.due_from(next, now);
        following = after_now;
        let latest = due.last().copied().unwrap_or(next);
        let batch = due_batch(rt, job, cursor, &due, now);
        cursor = latest;
        if stop.is_cancelled() {
            return;
        }
        launch(rt, job, batch, leader);
    }
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
