//! X10: scheduler leader churn. Three `chaos-replica` processes run one
//! every-second job in leader mode, replica 0 with its wall clock 2 s ahead
//! (libfaketime). The leader is killed (SIGKILL, then restarted) or stopped
//! past its election TTL (SIGSTOP, then resumed), in turn.
//!
//! Pass criteria, from everything the replicas reported:
//! - no scheduled instant finishes twice (a run cut short by the fault may
//!   be run again by the next leader, and is counted);
//! - no guarded write after its lease's local deadline;
//! - no write under an older fencing token once a run under a newer one has
//!   begun (counted strictly: every such write, whether or not a fenced store
//!   would have rejected it) — the old leader's job is stopped before the
//!   new leader runs;
//! - missed instants ≤ Σ over faults of ceil(failover / tick), plus the 2
//!   ticks a hand-over to the replica 2 s ahead skips by design (missed
//!   ticks are not replayed under `MissedTicks::Skip`).
//!
//! Raw overlaps of run intervals (start to end as reported) are counted:
//! a stopped leader's run stays open until it resumes and learns its loss.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tokio::process::Child;
use tokio::time::sleep;

use super::figures::{self, Row};
use super::procs::{
    keep_journal, libfaketime, process_url, replica_args, runs_and_writes, signal, Journal, Line,
    WallClock,
};
use super::Target;
use crate::mono::now_ns;
use crate::Ctx;

const TICK_MS: i64 = 1_000;
/// How far ahead replica 0's wall clock runs.
const SKEW_S: i64 = 2;
/// How long a leader keeps the job before the next fault.
const LEAD_FOR: Duration = Duration::from_millis(3_000);

/// One replica slot: its current process and the label its lines carry.
struct Slot {
    child: Child,
    who: usize,
}

fn is_leader(line: &Line, who: Option<usize>) -> bool {
    line.kind() == "LEADER" && line.num(1) == 1 && who.is_none_or(|w| w != line.who)
}

/// X10 on the backend at `target`, with the replica binary at `replica`.
pub(super) async fn leader_churn(ctx: Ctx, target: Target, replica: &Path) {
    let lib = libfaketime();
    let ttl = ctx.timing().ttl;
    let url = process_url(&ctx);
    let faults = target.iterations + 1;
    let run_ms = (LEAD_FOR + ttl * 4) * (u32::try_from(faults).unwrap_or(8) + 2);
    let args = replica_args(url, "leader", ttl, run_ms);
    let clocks = [Some(WallClock::new(lib, SKEW_S)), None, None];
    let (journal, _feed) = Journal::new();
    let mut next_label = 0;
    let mut spawn = |slot: usize, journal: &Journal| {
        next_label += 1;
        let who = slot * 1000 + next_label;
        let child = journal.spawn(who, replica, &args, clocks[slot].as_ref());
        Slot { child, who }
    };
    let mut slots: Vec<Slot> = (0..3).map(|i| spawn(i, &journal)).collect();
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case: "chaos_leader_churn".to_owned(),
        iterations: faults,
        ..Row::default()
    };
    let mut failovers = Vec::new();
    let elect_within = ttl * 4 + Duration::from_secs(10);
    let mut leader = journal
        .wait_for(0, elect_within, "first leader", |l| is_leader(l, None))
        .await
        .who;
    for k in 0..faults {
        sleep(LEAD_FOR).await;
        let slot = slots
            .iter()
            .position(|s| s.who == leader)
            .expect("the leader is one of ours");
        let stop = k % 2 == 1;
        let mut demoted_at = None;
        signal(&slots[slot].child, if stop { "STOP" } else { "KILL" });
        let fault_at = now_ns();
        row.faults += 1;
        if stop {
            // Keep it stopped past its own lease, then let it find out. A
            // TTL backend elects a successor meanwhile; Postgres keeps the
            // stopped leader's session lock until the thaw, when its
            // heartbeat finds the deadline passed and lets go.
            sleep(ttl * 3 / 2).await;
            let resumed_at = now_ns();
            signal(&slots[slot].child, "CONT");
            let old = leader;
            let demoted = journal
                .wait_for(
                    fault_at,
                    ttl * 2 + Duration::from_secs(2),
                    "the demotion",
                    |l| l.who == old && l.kind() == "LEADER" && l.num(1) == 0,
                )
                .await;
            row.abort.push(Duration::from_nanos(
                demoted.mono.saturating_sub(resumed_at),
            ));
            demoted_at = Some(demoted.mono);
        } else {
            slots[slot] = spawn(slot, &journal);
        }
        // A new term: another replica, or the old one once it has stepped
        // down and won again.
        let old = leader;
        let next = journal
            .wait_for(fault_at, elect_within, "a new leader", |l| {
                is_leader(l, Some(old))
                    || (is_leader(l, None) && demoted_at.is_some_and(|d| l.mono > d))
            })
            .await;
        let failover = Duration::from_nanos(next.mono.saturating_sub(fault_at));
        failovers.push(failover);
        row.detection.push(failover);
        leader = next.who;
    }
    // Let the run under way finish (the leader reports its next outcome),
    // then stop everyone and read their output to the end.
    let last = leader;
    journal
        .wait_for(now_ns(), elect_within, "the leader's next outcome", |l| {
            l.who == last && l.kind() == "OUTCOME"
        })
        .await;
    for slot in &mut slots {
        let _ = slot.child.start_kill();
        let _ = slot.child.wait().await;
    }
    journal.drained(Duration::from_secs(5)).await;
    let lines = journal.lines();
    let verdict = judge(&lines, &failovers, &mut row);
    if !verdict.is_empty() {
        // The whole journal, for whoever reads the failure.
        keep_journal(&lines, &format!("chaos-churn-{}.log", ctx.factory().name()));
    }
    figures::record_verdict(row, &verdict, "leader churn");
}

/// Checks the journal; returns what failed.
pub(super) fn judge(lines: &[Line], failovers: &[Duration], row: &mut Row) -> Vec<String> {
    let (runs, writes) = runs_and_writes(lines, row);
    // Every write under an older token after a run under a newer one began.
    row.stale_accepts = writes
        .iter()
        .filter(|w| {
            runs.values()
                .flatten()
                .any(|r| r.num(2) > w.num(2) && r.mono < w.mono)
        })
        .count();
    // Run intervals: from RUN to the run's END, else its OUTCOME.
    let end_of = |r: &Line| {
        lines
            .iter()
            .filter(|l| l.who == r.who && l.mono >= r.mono)
            .find(|l| (l.kind() == "END" || l.kind() == "OUTCOME") && l.num(1) == r.num(1))
            .map_or(u64::MAX, |l| l.mono)
    };
    let intervals: Vec<(usize, u64, u64)> = runs
        .values()
        .flatten()
        .map(|r| (r.who, r.mono, end_of(r)))
        .collect();
    row.overlaps = intervals
        .iter()
        .enumerate()
        .flat_map(|(i, a)| intervals[i + 1..].iter().map(move |b| (a, b)))
        .filter(|(a, b)| a.0 != b.0 && a.1 < b.2 && b.1 < a.2)
        .count();
    // A run cut short (its replica killed, or stopped past its lease) may be
    // run again by the next leader; a run that finished never is.
    let mut finished: BTreeMap<i64, usize> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.kind() == "END") {
        *finished.entry(l.num(1)).or_default() += 1;
    }
    let duplicates: usize = finished.values().map(|n| n.saturating_sub(1)).sum();
    let reruns: usize = runs.values().map(|v| v.len().saturating_sub(1)).sum();
    let (Some(first), Some(last)) = (runs.keys().next(), runs.keys().next_back()) else {
        return vec!["no tick ran".to_owned()];
    };
    let expected = usize::try_from((last - first) / TICK_MS + 1).unwrap_or(0);
    let missed = expected.saturating_sub(runs.len());
    let tick = Duration::from_millis(TICK_MS.unsigned_abs());
    let bound: usize = failovers
        .iter()
        .map(|f| f.as_millis().div_ceil(tick.as_millis()) as usize + SKEW_S.unsigned_abs() as usize)
        .sum();
    println!(
        "{} {}: {} ticks run of {expected} from first to last, {duplicates} finished twice, {reruns} re-run after a cut-short run, {missed} missed (bound {bound}), failovers {failovers:?}",
        row.backend,
        row.case,
        runs.len()
    );
    let mut failed = Vec::new();
    if duplicates > 0 {
        failed.push(format!("{duplicates} instants finished twice"));
    }
    if row.after_deadline > 0 {
        failed.push(format!("{} writes after the deadline", row.after_deadline));
    }
    if row.stale_accepts > 0 {
        failed.push(format!(
            "{} writes under an older token after a newer run began",
            row.stale_accepts
        ));
    }
    if missed > bound {
        failed.push(format!("{missed} instants missed, bound {bound}"));
    }
    failed
}
