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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use lock_core::TickRecord;
use scheduler::{Delivery, Job, Mode, PauseHook, ProtocolPoint, RunReport, Scheduler, TickOutcome};
use tokio::time::sleep;

use super::fleet::{tolerance, Fleet};
use crate::faulty::{Fault, FaultyBackend};
use crate::Ctx;

/// The tick lock's TTL in these cells: whole seconds (etcd's minimum), short
/// enough that the replica 3 s behind fires after it ran out.
const TTL: Duration = Duration::from_secs(2);
const BEHIND_MS: i64 = -3_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    At(ProtocolPoint),
    MidHandler,
}

const STEPS: [(Step, &str); 6] = [
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

/// Stalls the replica's renewals for 3 × TTL, once; the thaw comes from a
/// task of its own, so it comes even if the frozen caller is dropped.
#[derive(Clone)]
struct Freezer {
    fault: FaultyBackend,
    used: Arc<AtomicBool>,
}

impl Freezer {
    async fn freeze_once(&self) {
        if self.used.swap(true, Ordering::SeqCst) {
            return;
        }
        let fault = self.fault.clone();
        let thaw = tokio::spawn(async move {
            fault.set(Fault::StallRenewals);
            sleep(TTL * 3).await;
            fault.set(Fault::None);
        });
        let _ = thaw.await;
    }
}

/// What one cell saw: the tokens of the handler calls, the tick's record,
/// and the outcomes reported.
struct Cell {
    calls: Vec<u64>,
    record: Option<TickRecord>,
    reports: Vec<RunReport>,
}

async fn cell(ctx: &Ctx, index: usize, step: Step, delivery: Delivery) -> Cell {
    let fleet = Fleet::new(ctx, &[0, BEHIND_MS]).await;
    let freezer = Freezer {
        fault: fleet.faults[0].clone(),
        used: Arc::default(),
    };
    let name = ctx.name(&format!("pause-{index}"));
    // One tick, at least 2 s ahead on the true clock: a fixed second of the
    // minute, so the next one is a minute away.
    let now = Utc::now();
    let tick = now + chrono::TimeDelta::seconds(3);
    let tick = tick.with_nanosecond(0).unwrap_or(tick);
    let cron = format!("{} * * * * *", tick.second());
    let calls: Arc<Mutex<Vec<u64>>> = Arc::default();
    let reports: Arc<Mutex<Vec<RunReport>>> = Arc::default();
    let mut schedulers = Vec::new();
    for replica in 0..2 {
        let frozen = replica == 0;
        let (log, mid) = (Arc::clone(&calls), freezer.clone());
        let job = Job::new(name.as_str(), cron.as_str(), move |ctx| {
            let (log, mid) = (Arc::clone(&log), mid.clone());
            async move {
                log.lock()
                    .expect("log")
                    .push(ctx.fencing_token().unwrap_or(0));
                if frozen && step == Step::MidHandler {
                    mid.freeze_once().await;
                }
                Ok(())
            }
        })
        .with_ttl(TTL)
        .with_delivery(delivery);
        let seen = Arc::clone(&reports);
        let mut builder = Scheduler::builder(
            fleet.replicas[replica].locker.clone(),
            Arc::clone(&fleet.ticks),
        )
        .with_mode(Mode::PerTick)
        .with_clock(fleet.clocks[replica].clone())
        .with_registry(&prometheus::Registry::new())
        .with_skew_tolerance(tolerance(ctx))
        .with_on_outcome(move |r| seen.lock().expect("log").push(r.clone()))
        .with_job(job);
        if let (true, Step::At(point)) = (frozen, step) {
            let f = freezer.clone();
            let hook: PauseHook = Arc::new(move |at, _job: &str, _tick: DateTime<Utc>| {
                let f = f.clone();
                Box::pin(async move {
                    if at == point {
                        f.freeze_once().await;
                    }
                })
            });
            builder = builder.with_pause_hook(hook);
        }
        schedulers.push(builder.start().expect("starts"));
    }
    // The tick, the replica behind, the freeze, and slack for a loaded
    // machine.
    let until_tick = (tick - now).to_std().unwrap_or_default();
    sleep(until_tick + Duration::from_secs(3) + TTL * 3 + ctx.timing().tolerance + TTL).await;
    for s in schedulers {
        let _ = s.shutdown(Duration::from_secs(5)).await;
    }
    let record = fleet
        .ticks
        .tick_record(&name, tick.timestamp_millis())
        .await
        .expect("the record reads");
    let calls = calls.lock().expect("log").clone();
    let reports = reports.lock().expect("log").clone();
    Cell {
        calls,
        record,
        reports,
    }
}

/// Every cell of the matrix on this row, asserted and printed.
pub(crate) async fn scheduler_pause_matrix(ctx: Ctx) {
    let mut cells = Vec::new();
    for (i, (step, label)) in STEPS.iter().enumerate() {
        for (j, delivery) in [Delivery::AtMostOnce, Delivery::AtLeastOnce]
            .into_iter()
            .enumerate()
        {
            cells.push((i * 2 + j, *step, *label, delivery));
        }
    }
    let results = futures_join(&ctx, &cells).await;
    let mut table = format!(
        "{}: | step | mode | handler calls | completed | abandoned | fenced out |\n",
        ctx.factory().name()
    );
    let mut failures = Vec::new();
    for ((_, _, label, delivery), cell) in cells.iter().zip(&results) {
        let count = |o: TickOutcome| cell.reports.iter().filter(|r| r.outcome == o).count();
        let completed = matches!(cell.record, Some(TickRecord::Completed { .. }));
        table.push_str(&format!(
            "| {label} | {delivery} | {} | {} | {} | {} |\n",
            cell.calls.len(),
            u8::from(completed),
            count(TickOutcome::Abandoned),
            count(TickOutcome::FencedOut)
        ));
        let at = format!(
            "{label} / {delivery}: calls {:?}, record {:?}",
            cell.calls, cell.record
        );
        match delivery {
            Delivery::AtMostOnce if cell.calls.len() > 1 => {
                failures.push(format!("a tick started twice: {at}"));
            }
            Delivery::AtLeastOnce => {
                if ctx.timing().paused_clock && !completed {
                    failures.push(format!("a tick not completed: {at}"));
                }
                if let Some(TickRecord::Completed { token }) = cell.record {
                    if Some(token) != cell.calls.iter().copied().max() {
                        failures.push(format!("Completed without the highest token: {at}"));
                    }
                }
            }
            _ => {}
        }
    }
    println!("{table}");
    assert!(failures.is_empty(), "{failures:#?}\n{table}");
}

/// Runs every cell at once (each is mostly waiting) and answers in order.
async fn futures_join(ctx: &Ctx, cells: &[(usize, Step, &str, Delivery)]) -> Vec<Cell> {
    let mut set = tokio::task::JoinSet::new();
    for (index, step, _, delivery) in cells.iter().copied() {
        let ctx = ctx.clone();
        set.spawn(async move { (index, cell(&ctx, index, step, delivery).await) });
    }
    let mut done: Vec<(usize, Cell)> = Vec::new();
    while let Some(joined) = set.join_next().await {
        done.push(joined.expect("a cell finishes"));
    }
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, c)| c).collect()
}
