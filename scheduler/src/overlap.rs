//! One run of a job at a time in this process: a tick that fires while the
//! job's previous run is still going waits for it, and only the newest one
//! waits.
//!
//! In leader mode the previous run may belong to an earlier term: a leader
//! that lost and won back its leadership while a run was still ending. The
//! waiting tick therefore carries the leadership it fired under, and runs
//! under that, not under the term of the run it waited for.

use std::future::Future;
use std::sync::{Arc, MutexGuard, PoisonError};

use lock_core::LeaseHandle;
use tracing::warn;

use crate::job::JobSpec;
use crate::per_tick::{run_tick, Tick};
use crate::runtime::Runtime;
use crate::{clock, TickOutcome};

/// A job's runs in this process.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    /// A batch of the job's ticks is going.
    busy: bool,
    /// The newest tick that fired while it was going, to run after it.
    waiting: Option<Waiting>,
}

/// A tick waiting for the job's runs, with the leadership it fired under.
#[derive(Debug)]
struct Waiting {
    tick: Tick,
    leader: Option<LeaseHandle>,
}

fn runs(job: &JobSpec) -> MutexGuard<'_, Runs> {
    job.runs.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a batch of `job`'s ticks is going in this process.
pub(crate) fn is_busy(job: &JobSpec) -> bool {
    runs(job).busy
}

/// The run of `batch`, in order, under `leader`, for the caller to poll to
/// its end. If a batch of the job is already going here, the newest tick of
/// `batch` waits for it instead (with `leader`), replacing any tick that
/// waited before, the others are skipped, and there is nothing to run
/// (`None`).
///
/// Waiting rather than skipping at once keeps a run that started late (its
/// process starved of CPU) from costing the next tick: when every replica
/// was starved together, each is still running a late tick as the next one
/// fires. A job slower than its schedule runs back to back, each time on the
/// newest tick, and never twice at once.
pub(crate) fn launch(
    rt: &Arc<Runtime>,
    job: &Arc<JobSpec>,
    batch: Vec<Tick>,
    leader: Option<&LeaseHandle>,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let mut superseded = Vec::new();
    let was_busy = {
        let mut runs = runs(job);
        let was_busy = std::mem::replace(&mut runs.busy, true);
        if was_busy {
            if let Some((&newest, older)) = batch.split_last() {
                let waiting = Waiting {
                    tick: newest,
                    leader: leader.cloned(),
                };
                superseded.extend(runs.waiting.replace(waiting).map(|w| w.tick));
                superseded.extend_from_slice(older);
            }
        }
        was_busy
    };
    if was_busy {
        for tick in superseded {
            skip(
                rt,
                job,
                tick,
                "a newer tick fired while it waited for the previous run",
            );
        }
        return None;
    }
    // Dropped before the batch ends (with its driver, at the runtime's
    // end), it frees the job.
    let busy = Busy {
        rt: Arc::clone(rt),
        job: Arc::clone(job),
        armed: true,
    };
    let (rt, job) = (Arc::clone(rt), Arc::clone(job));
    let mut leader = leader.cloned();
    Some(async move {
        let mut batch = batch;
        loop {
            for tick in batch {
                run_tick(&rt, &job, tick, leader.as_ref()).await;
            }
            match next_waiting(&rt, &job) {
                Some(waiting) => {
                    batch = vec![waiting.tick];
                    leader = waiting.leader;
                }
                None => break,
            }
        }
        busy.disarm();
    })
}

/// The tick that waited for the batch that just ended, while it is still
/// within the skew tolerance (later than that, other replicas within the
/// tolerance have all fired it: it is skipped). `None` frees the job.
fn next_waiting(rt: &Runtime, job: &JobSpec) -> Option<Waiting> {
    loop {
        let waiting = {
            let mut runs = runs(job);
            match runs.waiting.take() {
                Some(waiting) => waiting,
                None => {
                    runs.busy = false;
                    return None;
                }
            }
        };
        if clock::until(waiting.tick.at, rt.clock.now()) <= rt.tolerance {
            return Some(waiting);
        }
        skip(
            rt,
            job,
            waiting.tick,
            "the previous run outlasted this tick's skew window",
        );
    }
}

fn skip(rt: &Runtime, job: &JobSpec, tick: Tick, why: &'static str) {
    warn!(job = job.label(), tick = %tick.at, reason = why, "skipping a tick");
    rt.report(job, tick, TickOutcome::Skipped);
}

/// Frees the job if its batch is dropped before it ends (with the runtime),
/// skipping the tick that waited for it.
struct Busy {
    rt: Arc<Runtime>,
    job: Arc<JobSpec>,
    armed: bool,
}

impl Busy {
    /// The batch ended normally and `next_waiting` freed the job.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let waiting = {
            let mut runs = runs(&self.job);
            runs.busy = false;
            runs.waiting.take()
        };
        if let Some(waiting) = waiting {
            skip(
                &self.rt,
                &self.job,
                waiting.tick,
                "the job's runs ended early",
            );
        }
    }
}
