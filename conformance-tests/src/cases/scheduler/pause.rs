//! The pause matrix on a real server: a replica frozen at each point of the
//! tick protocol for 3 × the tick's TTL (its renewals stalled too, so its
//! lock runs out on the server as a frozen process's would), beside a
//! replica whose clock is 3 s behind, in both delivery modes. One tick per
//! cell; the twelve cells run at once, each with its own two replicas.
//!
//! Asserted on every row: at most once, no tick's handler is called twice;
//! at least once, a `Completed` record carries the highest token any run of
//! the tick held. That every at-least-once tick completes is asserted on the
//! paused clock only: in real time it needs the replica behind to fire after
//! the frozen one's lock ran out (1 s of margin here), which a loaded
//! machine may not give, and the tick is then left `Started` with nobody to
//! take it over. The matrix printed (`--nocapture`) shows it per row.
//!
//! The harness (steps, the one-tick cell, its replicas' jobs and schedulers,
//! the verdict and the printed table) is shared with the crash matrix in
//! `crash.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use lock_core::{LockName, Locker, TickRecord, TickStore};
use scheduler::{
    Delivery, Job, Mode, PauseHook, ProtocolPoint, RunReport, Scheduler, TickOutcome, WallClock,
};
use tokio::time::sleep;

use super::fleet::{tolerance, Fleet};
use crate::faulty::{Fault, FaultyBackend};
use crate::Ctx;

/// The tick lock's TTL in these cells: whole seconds (etcd's minimum), short
/// enough that the replica 3 s behind fires after it ran out.
pub(super) const TTL: Duration = Duration::from_secs(2);
pub(super) const BEHIND_MS: i64 = -3_000;

/// How much longer than its timeline a cell waits for its reports: a loaded
/// machine delays them; a missing one then shows in the verdict.
pub(super) const REPORT_SLACK: Duration = Duration::from_secs(10);

/// Where the replica under test stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    At(ProtocolPoint),
    /// Inside the handler, after it was called.
    MidHandler,
}

pub(super) const STEPS: [(Step, &str); 6] = [
    (Step::At(ProtocolPoint::Fired), "fired, not claimed"),
    (Step::At(ProtocolPoint::Claimed), "claimed, not Started"),
    (
        Step::At(ProtocolPoint::Started),
        "Started, handler not called",
    ),
    (Step::MidHandler, "mid-handler"),
    (
        Step::At(ProtocolPoint::HandlerReturned),
        "handler returned, not Completed",
    ),
    (
        Step::At(ProtocolPoint::CompletedSent),
        "Completed sent, reply not read",
    ),
];

/// What a replica under test does when it reaches its step.
pub(super) type Action =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> + Send + Sync>;

/// The one tick of a cell: its job's name, its instant and a cron that
/// fires it (and next a minute later).
#[derive(Debug, Clone)]
pub(super) struct OneTick {
    pub(super) name: LockName,
    pub(super) at: DateTime<Utc>,
    cron: String,
}

impl OneTick {
    /// A tick at least 2 s ahead on the true clock: a fixed second of the
    /// minute, so the next one is a minute away.
    pub(super) fn new(ctx: &Ctx, job: &str) -> Self {
        let tick = Utc::now() + chrono::TimeDelta::seconds(3);
        let at = tick.with_nanosecond(0).unwrap_or(tick);
        Self {
            name: ctx.name(job),
            at,
            cron: format!("{} * * * * *", at.second()),
        }
    }

    /// How long until the tick, on the true clock.
    pub(super) fn until(&self) -> Duration {
        (self.at - Utc::now()).to_std().unwrap_or_default()
    }
}

/// The replicas of a cell: the one tick, and what each replica's job
/// (logging each handler call's token in `calls`, and doing `mid` inside
/// the handler if given) and scheduler (logging its reports) write to.
/// Clones share the logs.
#[derive(Clone)]
pub(super) struct ReplicaPlan {
    pub(super) tick: OneTick,
    delivery: Delivery,
    calls: Arc<Mutex<Vec<u64>>>,
    reports: Arc<Mutex<Vec<RunReport>>>,
    tolerance: Duration,
}

impl ReplicaPlan {
    /// A cell of one tick named after `job`, its replicas delivering it in
    /// `delivery`.
    pub(super) fn new(ctx: &Ctx, job: &str, delivery: Delivery) -> Self {
        Self {
            tick: OneTick::new(ctx, job),
            delivery,
            calls: Arc::default(),
            reports: Arc::default(),
            tolerance: tolerance(ctx),
        }
    }

    /// Waits until `replicas` reports of the tick have come in (each
    /// replica that fires it reports once, whatever the outcome, after its
    /// record was written), or `bound` passed; says whether they came.
    /// Polled: the reports come from the schedulers' outcome hook.
    pub(super) async fn reported(&self, replicas: usize, bound: Duration) -> bool {
        let tick = &self.tick;
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let seen = self
                .reports
                .lock()
                .expect("log")
                .iter()
                .filter(|r| r.scheduled == tick.at)
                .count();
            if seen >= replicas {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                println!(
                    "{}: {seen} of {replicas} reports within {bound:?}",
                    tick.name
                );
                return false;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// What the cell saw, once its replicas are done.
    pub(super) async fn read(&self, ticks: &dyn TickStore) -> Cell {
        Cell::read(ticks, &self.tick, &self.calls, &self.reports).await
    }

    /// The replica's scheduler over `locker` and `ticks`; `under_test` is
    /// the step and what to do there, for the replica under test. Reports
    /// are logged while `alive` says so.
    pub(super) fn scheduler(
        &self,
        locker: Locker,
        ticks: Arc<dyn TickStore>,
        clock: Arc<dyn WallClock>,
        under_test: Option<(Step, Action)>,
        alive: Arc<AtomicBool>,
    ) -> Scheduler {
        let log = Arc::clone(&self.calls);
        let mid = match &under_test {
            Some((Step::MidHandler, action)) => Some(Arc::clone(action)),
            _ => None,
        };
        let job = Job::new(
            self.tick.name.as_str(),
            self.tick.cron.as_str(),
            move |ctx| {
                let (log, mid) = (Arc::clone(&log), mid.clone());
                async move {
                    log.lock()
                        .expect("log")
                        .push(ctx.fencing_token().unwrap_or(0));
                    if let Some(mid) = mid {
                        mid().await;
                    }
                    Ok(())
                }
            },
        )
        .with_ttl(TTL)
        .with_delivery(self.delivery);
        let seen = Arc::clone(&self.reports);
        let mut builder = Scheduler::builder(locker, ticks)
            .with_mode(Mode::PerTick)
            .with_clock(clock)
            .with_registry(&prometheus::Registry::new())
            .with_skew_tolerance(self.tolerance)
            .with_on_outcome(move |r| {
                if alive.load(Ordering::SeqCst) {
                    seen.lock().expect("log").push(r.clone());
                }
            })
            .with_job(job);
        if let Some((Step::At(point), action)) = under_test {
            let hook: PauseHook = Arc::new(move |at, _job: &str, _tick: DateTime<Utc>| {
                let action = Arc::clone(&action);
                Box::pin(async move {
                    if at == point {
                        action().await;
                    }
                })
            });
            builder = builder.with_pause_hook(hook);
        }
        builder.build().expect("valid scheduler")
    }
}

/// What one cell saw: the tokens of the handler calls, the tick's record,
/// and the outcomes reported.
pub(super) struct Cell {
    pub(super) calls: Vec<u64>,
    pub(super) record: Option<TickRecord>,
    pub(super) reports: Vec<RunReport>,
}

impl Cell {
    /// Reads the tick's record once the cell's replicas are done.
    pub(super) async fn read(
        ticks: &dyn TickStore,
        tick: &OneTick,
        calls: &Mutex<Vec<u64>>,
        reports: &Mutex<Vec<RunReport>>,
    ) -> Self {
        let record = ticks
            .tick_record(&tick.name, tick.at.timestamp_millis())
            .await
            .expect("the record reads");
        Self {
            calls: calls.lock().expect("log").clone(),
            record,
            reports: reports.lock().expect("log").clone(),
        }
    }
}

/// What a matrix expects beyond the mode's own promise.
pub(super) struct Expect {
    /// Every at-least-once tick ends `Completed`.
    pub(super) completes: bool,
    /// Every at-most-once tick left `Started` by the replica under test ends
    /// `Abandoned` by the other one, counted.
    pub(super) abandons: bool,
}

/// Runs every cell of a matrix at once (each is mostly waiting), each
/// within `bound`, then prints its table (one row per step and mode) and
/// asserts it.
pub(super) async fn matrix<F, Fut>(ctx: &Ctx, what: &str, bound: Duration, expect: Expect, cell: F)
where
    F: Fn(Ctx, usize, Step, Delivery) -> Fut,
    Fut: Future<Output = Cell> + Send + 'static,
{
    let mut cells = Vec::new();
    for (i, (step, label)) in STEPS.iter().enumerate() {
        for (j, delivery) in [Delivery::AtMostOnce, Delivery::AtLeastOnce]
            .into_iter()
            .enumerate()
        {
            cells.push((i * 2 + j, *step, *label, delivery));
        }
    }
    let mut set = tokio::task::JoinSet::new();
    for (index, step, label, delivery) in cells.iter().copied() {
        let run = cell(ctx.clone(), index, step, delivery);
        set.spawn(async move {
            let cell = tokio::time::timeout(bound, run).await;
            (
                index,
                cell.unwrap_or_else(|_| {
                    panic!("{label} / {delivery}: the cell took longer than {bound:?}")
                }),
            )
        });
    }
    let mut done: Vec<(usize, Cell)> = Vec::new();
    while let Some(joined) = set.join_next().await {
        done.push(joined.expect("a cell finishes"));
    }
    done.sort_by_key(|(i, _)| *i);
    let backend = ctx.factory().name();
    let mut table = format!(
        "{what} matrix, {backend}:\n| backend | step | mode | ticks | handler calls | started twice | completed | abandoned | fenced out |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut failures = Vec::new();
    for ((_, step, label, delivery), (_, cell)) in cells.iter().zip(&done) {
        let count = |o: TickOutcome| cell.reports.iter().filter(|r| r.outcome == o).count();
        let completed = matches!(cell.record, Some(TickRecord::Completed { .. }));
        let abandoned = count(TickOutcome::Abandoned);
        table.push_str(&format!(
            "| {backend} | {label} | {delivery} | 1 | {} | {} | {} | {abandoned} | {} |\n",
            cell.calls.len(),
            u8::from(cell.calls.len() > 1),
            u8::from(completed),
            count(TickOutcome::FencedOut)
        ));
        let at = format!(
            "{label} / {delivery}: calls {:?}, record {:?}, outcomes {:?}",
            cell.calls,
            cell.record,
            cell.reports.iter().map(|r| r.outcome).collect::<Vec<_>>()
        );
        match delivery {
            Delivery::AtMostOnce => {
                if cell.calls.len() > 1 {
                    failures.push(format!("a tick started twice: {at}"));
                }
                let left_started = matches!(
                    step,
                    Step::At(ProtocolPoint::Started | ProtocolPoint::HandlerReturned)
                        | Step::MidHandler
                );
                let marked = matches!(cell.record, Some(TickRecord::Abandoned { .. }));
                if expect.abandons && left_started && !(marked && abandoned == 1) {
                    failures.push(format!("a started tick not marked abandoned once: {at}"));
                }
            }
            _ => {
                if expect.completes && !completed {
                    failures.push(format!("a tick not completed: {at}"));
                }
                if let Some(TickRecord::Completed { token }) = cell.record {
                    if Some(token) != cell.calls.iter().copied().max() {
                        failures.push(format!("Completed without the highest token: {at}"));
                    }
                }
            }
        }
    }
    println!("{table}");
    assert!(failures.is_empty(), "{failures:#?}\n{table}");
}

/// Stalls the replica's renewals for 3 × TTL, once; the thaw comes from a
/// task of its own, so it comes even if the frozen caller is dropped.
fn freezer(fault: FaultyBackend) -> Action {
    let used = Arc::new(AtomicBool::new(false));
    Arc::new(move || {
        let (fault, used) = (fault.clone(), Arc::clone(&used));
        Box::pin(async move {
            if used.swap(true, Ordering::SeqCst) {
                return;
            }
            let thaw = tokio::spawn(async move {
                fault.set(Fault::StallRenewals);
                sleep(TTL * 3).await;
                fault.set(Fault::None);
            });
            let _ = thaw.await;
        })
    })
}

async fn cell(ctx: Ctx, index: usize, step: Step, delivery: Delivery) -> Cell {
    let fleet = Fleet::new(&ctx, &[0, BEHIND_MS]).await;
    let plan = ReplicaPlan::new(&ctx, &format!("pause-{index}"), delivery);
    let mut schedulers = Vec::new();
    for replica in 0..2 {
        let under_test = (replica == 0).then(|| (step, freezer(fleet.faults[0].clone())));
        let s = plan.scheduler(
            fleet.replicas[replica].locker.clone(),
            Arc::clone(&fleet.ticks),
            fleet.clocks[replica].clone(),
            under_test,
            Arc::new(AtomicBool::new(true)),
        );
        schedulers.push(s.start().expect("starts"));
    }
    // Both replicas' reports of the tick: past the tick, the replica behind
    // and the freeze, with slack for a loaded machine.
    let bound = plan.tick.until() + Duration::from_secs(3) + TTL * 3 + ctx.timing().tolerance + TTL;
    plan.reported(2, bound + REPORT_SLACK).await;
    for s in schedulers {
        let _ = s.shutdown(Duration::from_secs(5)).await;
    }
    plan.read(&*fleet.ticks).await
}

/// Every cell of the matrix on this row, asserted and printed.
pub(crate) async fn scheduler_pause_matrix(ctx: Ctx) {
    let expect = Expect {
        completes: ctx.timing().paused_clock,
        abandons: false,
    };
    let bound = Duration::from_secs(60);
    matrix(&ctx, "pause", bound, expect, cell).await;
}
