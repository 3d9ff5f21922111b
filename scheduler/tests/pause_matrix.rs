//! A replica frozen at each point of the tick protocol for 3 × the tick's
//! TTL, while a second replica's clock is 3 s behind (so it fires the same
//! tick 3 s later), on the memory backend and tokio's paused clock.
//!
//! The freeze stalls the frozen replica's heartbeat too (its renewals block
//! until the thaw), so its lock runs out on the server as a frozen process's
//! would. For each mode:
//!
//! - `AtMostOnce`: no tick's handler is called twice;
//! - `AtLeastOnce`: every tick ends `Completed`, with the highest token any
//!   run of it held.
//!
//! The matrix runs twice: over the memory store as it is (the scheduler
//! reads the start's checks apart, then writes), and over a store that
//! makes the checks in the write's own step, as Postgres does
//! ([`TickStore::checks_starts_in_one_step`]).
//!
//! Run with `--nocapture` to print the matrix.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use chrono::{DateTime, Utc};
use common::{Completes, FlakyCompletes};
use lock_core::{async_trait, LockName, TickRecord, TickStore};
use lock_memory::{Intercept, Intercepted, MemoryBackend};
use prometheus::Registry;
use scheduler::{
    Delivery, Job, PauseHook, ProtocolPoint, RunReport, Scheduler, TickOutcome, TokioClock,
};
use tokio::sync::watch;

const TTL: Duration = Duration::from_secs(2);
const FREEZE: Duration = Duration::from_secs(6);
const BEHIND_MS: i64 = -3_000;
/// Every 10 s: a tick's whole story (freeze, the late replica, the thaw)
/// fits before the next one.
const CRON: &str = "*/10 * * * * *";
const TICKS: usize = 4;
const JOB: &str = "once";

/// Where the frozen replica stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    At(ProtocolPoint),
    /// Inside the handler, after it was called.
    MidHandler,
}

const STEPS: [Step; 6] = [
    Step::At(ProtocolPoint::Fired),
    Step::At(ProtocolPoint::Claimed),
    Step::At(ProtocolPoint::Started),
    Step::MidHandler,
    Step::At(ProtocolPoint::HandlerReturned),
    Step::At(ProtocolPoint::CompletedSent),
];

/// Makes the memory backend's calls wait while the replica is frozen.
#[derive(Debug)]
struct Freeze {
    frozen: watch::Receiver<bool>,
}

#[async_trait]
impl Intercept for Freeze {
    async fn before_call(&self) {
        let mut rx = self.frozen.clone();
        // The sender lives as long as the test; a closed channel means thawed.
        let _ = rx.wait_for(|frozen| !frozen).await;
    }
}

/// What one run of the matrix saw.
#[derive(Debug, Default, Clone)]
struct Row {
    started_twice: usize,
    completed: usize,
    abandoned: usize,
    fenced_out: usize,
    /// Per tick: the tokens of its handler calls, and its final record.
    ticks: BTreeMap<i64, (Vec<u64>, Option<TickRecord>)>,
    /// Reads of marks the schedulers made apart from their starts (counted
    /// over the one-step store only).
    reads_apart: usize,
}

/// Freezes the replica once: renewals block and the caller sleeps for
/// [`FREEZE`] on tokio's clock.
#[derive(Clone)]
struct Freezer {
    tx: Arc<watch::Sender<bool>>,
    used: Arc<AtomicBool>,
}

impl Freezer {
    async fn freeze_once(&self) {
        if self.used.swap(true, Ordering::SeqCst) {
            return;
        }
        // In a task of its own, so the thaw comes even if the frozen caller
        // is dropped meanwhile (a handler aborted on its lock's loss).
        let tx = Arc::clone(&self.tx);
        let freeze = tokio::spawn(async move {
            tx.send_replace(true);
            tokio::time::sleep(FREEZE).await;
            tx.send_replace(false);
        });
        let _ = freeze.await;
    }
}

async fn run(step: Step, delivery: Delivery, one_step: bool) -> Row {
    let memory = MemoryBackend::new();
    // The same memory store either way; only what it says of its starts,
    // and so the scheduler's path, differs.
    let counted = if one_step {
        FlakyCompletes::one_step(memory.clone())
    } else {
        FlakyCompletes::new(memory.clone(), Completes::Land)
    };
    let store: Arc<dyn TickStore> = Arc::clone(&counted) as Arc<dyn TickStore>;
    // The first tick is due 1 s after the start.
    let base = DateTime::from_timestamp(1_800_000_009, 0).expect("valid");
    let calls: Arc<Mutex<BTreeMap<i64, Vec<u64>>>> = Arc::default();
    let reports: Arc<Mutex<Vec<RunReport>>> = Arc::default();
    let (tx, rx) = watch::channel(false);
    let freezer = Freezer {
        tx: Arc::new(tx),
        used: Arc::default(),
    };
    let mut schedulers = Vec::new();
    for (i, skew) in [0, BEHIND_MS].into_iter().enumerate() {
        let frozen = i == 0;
        let backend = Intercepted::over(
            memory.clone(),
            Freeze {
                frozen: if frozen {
                    rx.clone()
                } else {
                    watch::channel(false).1
                },
            },
        );
        let locker = common::locker(backend);
        let (log, mid) = (Arc::clone(&calls), freezer.clone());
        let job = Job::new(JOB, CRON, move |ctx| {
            let (log, mid) = (Arc::clone(&log), mid.clone());
            async move {
                let tick = ctx.scheduled_at().timestamp_millis();
                log.lock()
                    .expect("log")
                    .entry(tick)
                    .or_default()
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
        let mut builder = Scheduler::builder(locker, Arc::clone(&store))
            .with_registry(&Registry::new())
            .with_replica_id(format!("r{i}"))
            .with_clock(Arc::new(TokioClock::starting_at(base).with_skew_ms(skew)))
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
    // Every tick fired on both clocks, plus the freeze and the marks' hold.
    tokio::time::sleep(Duration::from_secs(10 * TICKS as u64)).await;
    for s in schedulers {
        s.shutdown(Duration::from_secs(5)).await.expect("clean");
    }
    let job = LockName::new(JOB).expect("valid");
    let calls = calls.lock().expect("log").clone();
    let reports = reports.lock().expect("log").clone();
    let mut row = Row::default();
    for (tick, tokens) in calls {
        let record = memory.tick_record(&job, tick).await.expect("memory");
        row.ticks.insert(tick, (tokens, record));
    }
    row.started_twice = row.ticks.values().filter(|(t, _)| t.len() > 1).count();
    row.completed = row
        .ticks
        .values()
        .filter(|(_, r)| matches!(r, Some(TickRecord::Completed { .. })))
        .count();
    let count = |o: TickOutcome| reports.iter().filter(|r| r.outcome == o).count();
    row.abandoned = count(TickOutcome::Abandoned);
    row.fenced_out = count(TickOutcome::FencedOut);
    row.reads_apart = if one_step { counted.marks_read() } else { 0 };
    row
}

fn step_name(step: Step) -> &'static str {
    match step {
        Step::At(ProtocolPoint::Fired) => "fired, not claimed",
        Step::At(ProtocolPoint::Claimed) => "claimed, not Started",
        Step::At(ProtocolPoint::Started) => "Started, handler not called",
        Step::MidHandler => "mid-handler",
        Step::At(ProtocolPoint::HandlerReturned) => "handler returned, not Completed",
        Step::At(ProtocolPoint::CompletedSent) => "Completed sent, reply not read",
        Step::At(_) => "other",
    }
}

#[tokio::test(start_paused = true)]
async fn a_frozen_replica_never_breaks_its_mode() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    tokio::time::timeout(Duration::from_secs(3_600), async {
        let mut table = String::from(
            "| store | step | mode | ticks run | started twice | completed | abandoned | fenced out |\n|---|---|---|---|---|---|---|---|\n",
        );
        let mut failures = Vec::new();
        for (step, one_step) in STEPS.into_iter().flat_map(|s| [(s, false), (s, true)]) {
            let store = if one_step { "checks in the write" } else { "reads apart" };
            for delivery in [Delivery::AtMostOnce, Delivery::AtLeastOnce] {
                let row = run(step, delivery, one_step).await;
                table.push_str(&format!(
                    "| {store} | {} | {delivery} | {} | {} | {} | {} | {} |\n",
                    step_name(step),
                    row.ticks.len(),
                    row.started_twice,
                    row.completed,
                    row.abandoned,
                    row.fenced_out
                ));
                let where_ = format!(
                    "{store} / {} / {delivery}: {:?}",
                    step_name(step),
                    row.ticks
                );
                if row.reads_apart != 0 {
                    failures.push(format!(
                        "{} reads made apart from the starts: {where_}",
                        row.reads_apart
                    ));
                }
                if row.ticks.len() < TICKS - 1 {
                    failures.push(format!("too few ticks ran: {where_}"));
                }
                // Frozen while holding a started tick, the replica must lose
                // its lock (its renewals stall too), and the late replica
                // must find the run's record: abandoned, or run again.
                // Without this a freeze that let the heartbeat go on would
                // pass every check above and below.
                let loses_a_started_tick = matches!(
                    step,
                    Step::At(ProtocolPoint::Started | ProtocolPoint::HandlerReturned)
                        | Step::MidHandler
                );
                // (At least once, a tick frozen before its handler was
                // called is run once, by the other replica: nothing to count.)
                let seen = match delivery {
                    Delivery::AtMostOnce => Some(row.abandoned),
                    _ if step == Step::At(ProtocolPoint::Started) => None,
                    _ => Some(row.started_twice),
                };
                if loses_a_started_tick && seen == Some(0) {
                    failures.push(format!(
                        "the freeze cost the frozen replica no started tick: {where_}"
                    ));
                }
                match delivery {
                    Delivery::AtMostOnce => {
                        if row.started_twice != 0 {
                            failures.push(format!("a tick started twice: {where_}"));
                        }
                    }
                    _ => {
                        for (tokens, record) in row.ticks.values() {
                            let highest = tokens.iter().copied().max();
                            if *record != highest.map(|token| TickRecord::Completed { token }) {
                                failures.push(format!(
                                    "a tick not Completed with its highest token: {where_}"
                                ));
                            }
                        }
                    }
                }
            }
        }
        println!("{table}");
        assert!(failures.is_empty(), "{failures:#?}\n{table}");
    })
    .await
    .expect("the matrix finishes within its bound");
}
