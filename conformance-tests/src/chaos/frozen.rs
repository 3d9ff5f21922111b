//! Issue 41: a scheduler replica stopped as a whole process (SIGSTOP: its
//! runtime, its heartbeat and its timers all stall) right after its
//! handler returned and before the tick's `Completed` record is written,
//! and thawed after 3 × the tick lock's TTL.
//!
//! Each iteration runs three `chaos-replica` processes on one every-second
//! job of its own: replica 1 runs under libfaketime 3 s behind, replicas 0
//! and 2 on the true clock. The case arms one freeze through a file the
//! pause hook of replicas 0 and 2 looks for: the first of them whose
//! handler returns deletes it, says `FREEZE` and stops itself (per tick,
//! which of the two wins a tick's lock depends on their timers' phase,
//! which can favour one for a whole run). The case sees the process in
//! state `T`, waits out 3 × TTL from the stop and sends SIGCONT. In leader
//! mode replica 0 starts alone and is leader before the others start, so
//! the tick frozen is the leader's.
//!
//! On a TTL backend its tick lock runs out while it is stopped; the replica
//! behind fires the same tick 3 s later, takes the lock with a higher token
//! and finds the `Started` record of the stopped run: at most once it marks
//! the tick abandoned, at least once it runs it again; either way the
//! frozen run's `Completed` write after the thaw is fenced out. Postgres
//! keeps a stopped session's locks, so there the frozen run keeps its tick
//! and completes it after the thaw. In leader mode the replica behind only
//! gets the tick if it wins the election in time.
//!
//! Asserted from the journal and the store's tick records, over every tick
//! any replica started: at most once, no tick's handler started twice; at
//! least once, every started tick has exactly one `Completed` record, under
//! the highest token any of its runs held, and exactly one replica reported
//! it completed; in both, no tick reported completed twice, every record is
//! `Completed` or (at most once only, a frozen tick) `Abandoned`, and no
//! guarded write passed its lease's local deadline.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use lock_core::{LockName, TickRecord};
use scheduler::Delivery;
use tokio::process::Child;
use tokio::time::{sleep, Instant};

use super::figures::{self, Row};
use super::procs::{
    is_stopped, keep_journal, libfaketime, process_url, signal, Journal, Line, WallClock,
};
use crate::mono::now_ns;
use crate::Ctx;

/// How far behind replica 1's wall clock runs.
const BEHIND_S: i64 = -3;
/// The replica binary's handler time (its `WORK`).
const WORK: Duration = Duration::from_millis(300);
/// How long a replica may take to start and connect.
const START_WITHIN: Duration = Duration::from_secs(15);
/// How long the armed freeze may take to come: the next tick's run, on a
/// replica that may still be connecting.
const FREEZE_WITHIN: Duration = Duration::from_secs(15);
/// How long a child may take to exit after its stop file appears: the
/// scheduler's 2 s shutdown deadline, plus slack.
const EXIT_WITHIN: Duration = Duration::from_secs(5);
/// Smoke faults per case (one iteration each); `CHAOS_SOAK` multiplies.
const SMOKE_FAULTS: usize = 2;

/// One combination of scheduler mode and delivery.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// The trial's case name.
    pub case: &'static str,
    /// Leader mode, else per tick.
    pub leader: bool,
    /// The job's delivery.
    pub delivery: Delivery,
    /// Run by default; else only under `CHAOS_SOAK` (or `--include-ignored`).
    pub by_default: bool,
}

impl Plan {
    /// Whether this run includes the plan (else its trial is ignored).
    pub(super) fn included(&self) -> bool {
        self.by_default || figures::iterations(1) > 1
    }
}

/// Every combination. Two run by default, one per mode and one per
/// delivery; all four under `CHAOS_SOAK` (each takes 10–14 s per row).
pub(super) const PLANS: [Plan; 4] = [
    Plan {
        case: "chaos_scheduler_frozen_after_handler_per_tick_at_most_once",
        leader: false,
        delivery: Delivery::AtMostOnce,
        by_default: true,
    },
    Plan {
        case: "chaos_scheduler_frozen_after_handler_leader_at_least_once",
        leader: true,
        delivery: Delivery::AtLeastOnce,
        by_default: true,
    },
    Plan {
        case: "chaos_scheduler_frozen_after_handler_per_tick_at_least_once",
        leader: false,
        delivery: Delivery::AtLeastOnce,
        by_default: false,
    },
    Plan {
        case: "chaos_scheduler_frozen_after_handler_leader_at_most_once",
        leader: true,
        delivery: Delivery::AtMostOnce,
        by_default: false,
    },
];

/// One freeze: the iteration, the replica, the tick, and when the process
/// was stopped and resumed (monotonic ns).
#[derive(Debug, Clone)]
struct Freeze {
    iteration: usize,
    who: usize,
    tick: i64,
    stopped: u64,
    resumed: u64,
}

/// The replica processes of one iteration, and what they were told.
struct Iteration {
    names: String,
    children: Vec<Child>,
}

/// The case, for `plan`, with the replica binary at `replica`.
pub(super) async fn frozen_after_handler(ctx: Ctx, plan: Plan, replica: &Path) {
    let ttl = ctx.timing().ttl;
    let url = process_url(&ctx);
    let behind = WallClock::new(libfaketime(), BEHIND_S);
    let control = tempfile::tempdir().expect("a directory for the control files");
    let (journal, _feed) = Journal::new();
    let faults = figures::iterations(SMOKE_FAULTS);
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case: plan.case.to_owned(),
        iterations: faults,
        ..Row::default()
    };
    let mut freezes = Vec::new();
    let mut names = Vec::new();
    let started = Instant::now();
    for k in 0..faults {
        let mut it = Iteration {
            names: format!("{}/i{k}", ctx.prefix()),
            children: Vec::new(),
        };
        let common = |slot: usize| {
            let mut args = vec![
                url.clone(),
                if plan.leader { "leader" } else { "per-tick" }.to_owned(),
                ttl.as_millis().to_string(),
                ttl.as_millis().to_string(),
                // A bound only: the stop file ends them.
                "60000".to_owned(),
                "--names".to_owned(),
                it.names.clone(),
                "--delivery".to_owned(),
                plan.delivery.as_str().to_owned(),
                "--stop-file".to_owned(),
                control
                    .path()
                    .join(format!("stop-{k}"))
                    .display()
                    .to_string(),
            ];
            if slot != 1 {
                args.push("--freeze-file".to_owned());
                args.push(
                    control
                        .path()
                        .join(format!("freeze-{k}"))
                        .display()
                        .to_string(),
                );
            }
            args
        };
        let who = |slot: usize| k * 3 + slot;
        let since = now_ns();
        it.children
            .push(journal.spawn(who(0), replica, &common(0), None));
        if plan.leader {
            journal
                .wait_for(since, START_WITHIN + ttl * 4, "replica 0 leading", |l| {
                    l.who == who(0) && l.kind() == "LEADER" && l.num(1) == 1
                })
                .await;
        }
        it.children
            .push(journal.spawn(who(1), replica, &common(1), Some(&behind)));
        it.children
            .push(journal.spawn(who(2), replica, &common(2), None));
        for slot in 0..3 {
            journal
                .wait_for(since, START_WITHIN, "a replica ready", |l| {
                    l.who == who(slot) && l.kind() == "READY"
                })
                .await;
        }
        // Arm the freeze: the next handler of replica 0 or 2 to return
        // stops its process.
        let armed = now_ns();
        std::fs::write(control.path().join(format!("freeze-{k}")), b"")
            .expect("write the freeze file");
        let froze = journal
            .wait_for(armed, FREEZE_WITHIN, "replica freezing", |l| {
                l.who / 3 == k && l.kind() == "FREEZE"
            })
            .await;
        let (tick, slot) = (froze.num(1), froze.who % 3);
        let frozen = &it.children[slot];
        let until = Instant::now() + Duration::from_secs(2);
        while !is_stopped(frozen) {
            assert!(
                Instant::now() < until,
                "replica {slot} said FREEZE but its process is not stopped"
            );
            sleep(Duration::from_millis(5)).await;
        }
        let stopped = froze.mono;
        let thaw_at = stopped + ns(ttl * 3);
        sleep(Duration::from_nanos(thaw_at.saturating_sub(now_ns()))).await;
        assert!(
            is_stopped(frozen),
            "replica {slot} ran again before SIGCONT"
        );
        // Taken before the signal: the thawed replica may write its next
        // lines before `kill` returns here.
        let resumed = now_ns();
        signal(frozen, "CONT");
        row.faults += 1;
        row.stall
            .push(Duration::from_nanos(resumed.saturating_sub(stopped)));
        let thawed = journal
            .wait_for(stopped, Duration::from_secs(2), "the thaw", |l| {
                l.who == froze.who && l.kind() == "THAW"
            })
            .await;
        assert!(
            thawed.mono >= resumed,
            "replica {slot} ran on after FREEZE ({} ms later) before SIGCONT",
            (thawed.mono.saturating_sub(stopped)) / 1_000_000
        );
        let fate = journal
            .wait_for(
                stopped,
                ttl * 2 + Duration::from_secs(5),
                "the frozen run's outcome",
                |l| l.who == froze.who && l.kind() == "OUTCOME" && l.num(1) == tick,
            )
            .await;
        row.abort
            .push(Duration::from_nanos(fate.mono.saturating_sub(resumed)));
        freezes.push(Freeze {
            iteration: k,
            who: froze.who,
            tick,
            stopped,
            resumed,
        });
        // The replica behind fires the tick 3 s after the others; let its
        // run of it (if it gets one) finish before stopping everyone.
        let settle_until = tick + (-BEHIND_S) * 1_000 + millis(WORK) + 1_000;
        let wait_ms = settle_until - chrono::Utc::now().timestamp_millis();
        sleep(Duration::from_millis(
            wait_ms.clamp(0, 10_000).unsigned_abs(),
        ))
        .await;
        std::fs::write(control.path().join(format!("stop-{k}")), b"").expect("write the stop file");
        for mut child in it.children {
            if tokio::time::timeout(EXIT_WITHIN, child.wait())
                .await
                .is_err()
            {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        names.push(it.names);
    }
    journal.drained(Duration::from_secs(5)).await;
    let lines = journal.lines();
    let store = scheduler::connect(&url)
        .await
        .expect("a tick store for the case")
        .tick_store();
    let mut ticks = collect(&lines);
    for ((k, tick), seen) in &mut ticks {
        let job = LockName::new(format!("{}/every-second", names[*k])).expect("a job name");
        seen.record = store
            .tick_record(&job, *tick)
            .await
            .expect("the tick's record reads");
    }
    let verdict = judge(&ctx, plan, &lines, &ticks, &freezes, &mut row);
    println!(
        "{} {}: {:.1} s for {} iterations",
        row.backend,
        row.case,
        started.elapsed().as_secs_f64(),
        row.iterations
    );
    if !verdict.is_empty() {
        let file = format!("chaos-frozen-{}-{}.log", ctx.factory().name(), plan.case);
        keep_journal(&lines, &file);
    }
    let summary = format!("{row:?}");
    figures::record(row);
    assert!(
        verdict.is_empty(),
        "{}: {}\n{summary}",
        plan.case,
        verdict.join("; ")
    );
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What the replicas said about one tick of one iteration, and its record.
#[derive(Debug, Default)]
struct Seen {
    /// (replica, token) of every run started.
    runs: Vec<(usize, u64)>,
    /// (replica, outcome) of every outcome reported.
    outcomes: Vec<(usize, String)>,
    record: Option<TickRecord>,
}

impl Seen {
    fn count(&self, outcome: &str) -> usize {
        self.outcomes.iter().filter(|(_, o)| o == outcome).count()
    }
}

/// Every tick some replica started, by (iteration, tick ms).
fn collect(lines: &[Line]) -> BTreeMap<(usize, i64), Seen> {
    let mut ticks: BTreeMap<(usize, i64), Seen> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.kind() == "RUN") {
        let token = u64::try_from(l.num(2)).unwrap_or(0);
        ticks
            .entry((l.who / 3, l.num(1)))
            .or_default()
            .runs
            .push((l.who, token));
    }
    for l in lines.iter().filter(|l| l.kind() == "OUTCOME") {
        if let Some(seen) = ticks.get_mut(&(l.who / 3, l.num(1))) {
            let outcome = l.words.get(2).cloned().unwrap_or_default();
            seen.outcomes.push((l.who, outcome));
        }
    }
    ticks
}

/// Checks what was seen; prints the figures line and returns what failed.
fn judge(
    ctx: &Ctx,
    plan: Plan,
    lines: &[Line],
    ticks: &BTreeMap<(usize, i64), Seen>,
    freezes: &[Freeze],
    row: &mut Row,
) -> Vec<String> {
    let writes: Vec<&Line> = lines.iter().filter(|l| l.kind() == "WRITE").collect();
    row.writes = writes.len();
    row.after_deadline = writes.iter().filter(|w| w.num(3) == 1).count();
    let frozen = |key: &(usize, i64)| freezes.iter().any(|f| (f.iteration, f.tick) == *key);
    let mut failed = Vec::new();
    let (mut started_twice, mut completed, mut completed_twice) = (0, 0, 0);
    let (mut abandoned, mut fenced_out) = (0, 0);
    for (key, seen) in ticks {
        let at = format!(
            "tick {} of iteration {}: runs {:?}, outcomes {:?}, record {:?}",
            key.1, key.0, seen.runs, seen.outcomes, seen.record
        );
        let successes = seen.count("success");
        fenced_out += seen.count("fenced_out");
        if seen.runs.len() > 1 {
            started_twice += 1;
            if plan.delivery == Delivery::AtMostOnce {
                failed.push(format!("started twice at most once: {at}"));
            }
        }
        if successes > 1 {
            completed_twice += 1;
            failed.push(format!("completed twice: {at}"));
        }
        let highest = seen.runs.iter().map(|(_, t)| *t).max();
        match &seen.record {
            Some(TickRecord::Completed { token }) => {
                completed += 1;
                if !seen.runs.iter().any(|(_, t)| t == token) {
                    failed.push(format!("Completed under a token no run held: {at}"));
                }
                if plan.delivery == Delivery::AtLeastOnce && Some(*token) != highest {
                    failed.push(format!("Completed without the highest token: {at}"));
                }
                if successes != 1 {
                    failed.push(format!(
                        "a Completed record, but {successes} replicas reported it completed: {at}"
                    ));
                }
            }
            Some(TickRecord::Abandoned { .. }) => {
                abandoned += 1;
                if plan.delivery == Delivery::AtLeastOnce {
                    failed.push(format!("abandoned at least once: {at}"));
                } else if !frozen(key) {
                    failed.push(format!("abandoned, though its run was not frozen: {at}"));
                }
                if successes != 0 {
                    failed.push(format!("abandoned, yet reported completed: {at}"));
                }
            }
            other => failed.push(format!(
                "started, yet its record is {other:?} (neither Completed nor Abandoned): {at}"
            )),
        }
    }
    for f in freezes {
        let ran = ticks
            .get(&(f.iteration, f.tick))
            .is_some_and(|s| s.runs.iter().any(|(who, _)| *who == f.who));
        if !ran {
            failed.push(format!(
                "replica {} froze after tick {} but never said it ran it",
                f.who, f.tick
            ));
        }
    }
    if row.after_deadline > 0 {
        failed.push(format!("{} writes after the deadline", row.after_deadline));
    }
    // What became of each frozen tick.
    let fates: Vec<String> = freezes
        .iter()
        .map(|f| {
            let seen = ticks.get(&(f.iteration, f.tick));
            let record = seen
                .and_then(|s| s.record.as_ref())
                .map_or_else(|| "no record".to_owned(), ToString::to_string);
            let runs = seen.map_or(0, |s| s.runs.len());
            format!(
                "replica {} stopped {} ms, {runs} run(s), {record}",
                f.who % 3,
                (f.resumed - f.stopped) / 1_000_000
            )
        })
        .collect();
    println!(
        "{} {}: {} ticks, {} frozen, {started_twice} started twice, {completed} completed, {completed_twice} completed twice, {abandoned} abandoned, {fenced_out} fenced out; frozen ticks: {fates:?}",
        ctx.factory().name(),
        plan.case,
        ticks.len(),
        freezes.len(),
    );
    failed
}
