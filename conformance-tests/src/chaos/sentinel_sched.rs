//! Issue 41: the scheduler at most once on Redis behind Sentinel, across a
//! failover that loses a tick's `Started` record.
//!
//! Two `chaos-replica` processes run one every-second job per tick, at most
//! once, through the `redis+sentinel://` URL of a private deployment:
//! replica 0 on the true clock, replica 1 under libfaketime [`BEHIND_S`]
//! behind, so it fires every tick after the failover has finished. Both
//! replicas of the data server are frozen and cut off (as in
//! `chaos_sentinel_primary_lost`); replica 0's first tick after that writes
//! its `Started` record on the primary alone and its handler starts. Then
//! replica 0 is stopped (SIGSTOP: otherwise a later tick it completes on the
//! promoted primary makes replica 1 skip the older one as already done), the
//! primary killed, the data replicas thawed, and the sentinels promote one.
//! Replica 1 fires the same tick on the promoted primary, which has no
//! record of it. Replica 0 is thawed once replica 1 has reported the tick.
//!
//! Counted from the replicas' journal and the store: ticks whose handler
//! started twice, abandoned, completed. Without acknowledgement the tick
//! runs twice, which asynchronous replication allows: counted and printed,
//! not asserted. With acknowledgement by both replicas
//! (`chaos_scheduler_primary_lost_acked`) the `Started` write nobody
//! acknowledged is an error, so replica 0 does not run the tick; the case
//! asserts that no tick started twice.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use lock_core::{LockName, TickRecord};
use tokio::time::Instant;

use super::figures::{self, Row};
use super::procs::{is_stopped, libfaketime, signal, Journal, Line, WallClock};
use super::sentinel_lost::{deploy, isolate_primary, kill_primary, wait_linked};
use super::sentinel_lost_clients::direct;
use crate::mono::now_ns;
use crate::Ctx;

/// How far behind replica 1's wall clock runs: above a failover's ~3 s
/// here and the promoted primary's settling, with room for load.
const BEHIND_S: i64 = -10;
/// The job's tick lock TTL.
const TTL: Duration = Duration::from_secs(8);
/// How long a replica may take to start and connect.
const START_WITHIN: Duration = Duration::from_secs(10);
/// How long replica 0's first tick after the cut may take to come.
const TICK_WITHIN: Duration = Duration::from_secs(5);
/// Bound on the sentinels promoting a replica after the kill.
const FAILOVER_WITHIN: Duration = Duration::from_secs(15);
/// How long a child may take to exit after its stop file appears: the
/// scheduler's 2 s shutdown deadline, plus slack.
const EXIT_WITHIN: Duration = Duration::from_secs(5);

/// The case; `ack` is the `?replica_ack=` query, or `None`.
pub(super) async fn scheduler_primary_lost(ctx: Ctx, ack: Option<(u8, Duration)>, replica: &Path) {
    let case = if ack.is_some() {
        "chaos_scheduler_primary_lost_acked"
    } else {
        "chaos_scheduler_primary_lost"
    };
    let began = Instant::now();
    let (set, old, replicas) = deploy().await;
    let url = match ack {
        Some((n, t)) => format!(
            "{}?replica_ack={n}&replica_ack_timeout={}ms",
            set.url(),
            t.as_millis()
        ),
        None => set.url(),
    };
    let names = format!("{}/sched", ctx.prefix());
    let job = LockName::new(format!("{names}/every-second")).expect("a job name");
    let behind = WallClock::new(libfaketime(), BEHIND_S);
    let control = tempfile::tempdir().expect("a directory for the control files");
    let stop = control.path().join("stop");
    let (journal, _feed) = Journal::new();
    let args = vec![
        url.clone(),
        "per-tick".to_owned(),
        TTL.as_millis().to_string(),
        TTL.as_millis().to_string(),
        // A bound only: the stop file ends them.
        "60000".to_owned(),
        "--names".to_owned(),
        names.clone(),
        "--delivery".to_owned(),
        "at-most-once".to_owned(),
        "--stop-file".to_owned(),
        stop.display().to_string(),
    ];
    let since = now_ns();
    let mut children = vec![
        journal.spawn(0, replica, &args, None),
        journal.spawn(1, replica, &args, Some(&behind)),
    ];
    for who in 0..2 {
        journal
            .wait_for(since, START_WITHIN, "a replica ready", |l| {
                l.who == who && l.kind() == "READY"
            })
            .await;
    }
    // One tick completed before the fault, so both replicas run normally.
    journal
        .wait_for(since, START_WITHIN, "a tick completed", |l| {
            l.who == 0 && l.kind() == "OUTCOME" && l.words.get(2).is_some_and(|o| o == "success")
        })
        .await;

    let mut p = direct(old).await;
    isolate_primary(&set, &replicas, &mut p).await;
    let cut_ms = chrono::Utc::now().timestamp_millis();
    let cut = now_ns();
    // Replica 0's first tick fired after the cut: a run started (its
    // `Started` record on the primary alone), or its outcome without one.
    let first = journal
        .wait_for(cut, TICK_WITHIN, "replica 0's tick after the cut", |l| {
            l.who == 0 && matches!(l.kind(), "RUN" | "OUTCOME") && l.num(1) > cut_ms
        })
        .await;
    let tick = first.num(1);
    signal(&children[0], "STOP");
    let until = Instant::now() + Duration::from_secs(2);
    while !is_stopped(&children[0]) {
        assert!(Instant::now() < until, "replica 0 is not stopped");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stopped = now_ns();

    let (new, killed_at, promoted_at) = kill_primary(&set, old, &replicas, FAILOVER_WITHIN).await;
    let promoted_in = promoted_at - killed_at;
    wait_linked(&set, new, FAILOVER_WITHIN).await;
    let store = scheduler::connect(&url)
        .await
        .expect("a tick store through the sentinels")
        .tick_store();
    let on_new = store
        .tick_record(&job, tick)
        .await
        .expect("the tick's record reads on the promoted primary");
    assert!(
        on_new.is_none(),
        "the promoted primary has tick {tick}'s record {on_new:?}: the fault was not injected"
    );
    // Replica 1 fires the tick BEHIND_S later; the fault must be over by then.
    let behind_ms = (-BEHIND_S) * 1_000;
    let settled_ms = chrono::Utc::now().timestamp_millis();
    assert!(
        settled_ms < tick + behind_ms,
        "the failover took until {} ms after the tick, past replica 1's firing of it",
        settled_ms - tick
    );
    let wait =
        Duration::from_millis(u64::try_from(tick + behind_ms - settled_ms).unwrap_or(0) + 5_000);
    let fate = journal
        .wait_for(stopped, wait, "replica 1's outcome of the tick", |l| {
            l.who == 1 && l.kind() == "OUTCOME" && l.num(1) == tick
        })
        .await;
    signal(&children[0], "CONT");
    // Replica 0's run of the tick (if it had one) ends, one way or another.
    if first.kind() == "RUN" {
        journal
            .wait_for(
                stopped,
                TTL + Duration::from_secs(5),
                "replica 0's outcome of the tick",
                |l| l.who == 0 && l.kind() == "OUTCOME" && l.num(1) == tick,
            )
            .await;
    }
    std::fs::write(&stop, b"").expect("write the stop file");
    for child in &mut children {
        if tokio::time::timeout(EXIT_WITHIN, child.wait())
            .await
            .is_err()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
    journal.drained(Duration::from_secs(5)).await;
    let lines = journal.lines();

    let mut ticks = collect(&lines);
    for seen in ticks.values_mut() {
        seen.record = store
            .tick_record(&job, seen.tick)
            .await
            .expect("a tick's record reads");
    }
    drop(store);
    tokio::task::block_in_place(move || drop(set));

    let started_twice = ticks.values().filter(|s| s.runs.len() > 1).count();
    let completed = ticks
        .values()
        .filter(|s| matches!(s.record, Some(TickRecord::Completed { .. })))
        .count();
    let abandoned = ticks
        .values()
        .filter(|s| matches!(s.record, Some(TickRecord::Abandoned { .. })))
        .count();
    let writes: Vec<&Line> = lines.iter().filter(|l| l.kind() == "WRITE").collect();
    let row = Row {
        backend: ctx.factory().name().to_owned(),
        case: case.to_owned(),
        iterations: 1,
        faults: 1,
        writes: writes.len(),
        after_deadline: writes.iter().filter(|w| w.num(3) == 1).count(),
        // Ticks whose handler started twice: two runs of one tick.
        overlaps: started_twice,
        reconnect: vec![promoted_in],
        ..Row::default()
    };
    let faulted = ticks.get(&tick);
    println!(
        "{} {case}: primary {old}->{new} promoted in {promoted_in:?}; tick {tick}: replica 0 {}, replica 1 {}, runs {:?}, record {:?}; \
         {} ticks started, {started_twice} started twice, {completed} completed, {abandoned} abandoned; {:.1} s",
        row.backend,
        first.words.join(" "),
        fate.words.join(" "),
        faulted.map(|s| s.runs.clone()),
        faulted.and_then(|s| s.record.clone()),
        ticks.len(),
        began.elapsed().as_secs_f64(),
    );
    let summary = format!("{row:?}");
    figures::record(row);
    assert_eq!(
        writes.iter().filter(|w| w.num(3) == 1).count(),
        0,
        "writes after the deadline: {summary}"
    );
    if ack.is_some() {
        assert_eq!(
            started_twice, 0,
            "a tick's handler started twice with acknowledgement: {ticks:?}"
        );
    }
}

/// What the replicas said about one tick, and its record.
#[derive(Debug, Default)]
struct Seen {
    tick: i64,
    /// (replica, token) of every run started.
    runs: Vec<(usize, i64)>,
    record: Option<TickRecord>,
}

/// Every tick some replica started, by tick ms.
fn collect(lines: &[Line]) -> BTreeMap<i64, Seen> {
    let mut ticks: BTreeMap<i64, Seen> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.kind() == "RUN") {
        let seen = ticks.entry(l.num(1)).or_default();
        seen.tick = l.num(1);
        seen.runs.push((l.who, l.num(2)));
    }
    ticks
}
