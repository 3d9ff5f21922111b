//! Redis behind Sentinel: `SENTINEL FAILOVER` while holders renew and
//! waiters wait, every client connected through the sentinels.
//!
//! Replication is asynchronous, so a failover may lose a lock key (a holder
//! must then learn it at its next renewal, before its local deadline) and
//! the `INCR` fencing counter may go back. Both are counted, not hidden:
//! raw overlaps, stale accepts and a counter that went back are in the row.
//!
//! `chaos_sentinel_failover_acked` runs the same with every client asking
//! for acknowledgement by both replicas: then the counter is on the
//! promoted replica before any token is handed out, and the case asserts 0
//! stale accepts, 0 overlaps and no token going back. The price is
//! availability: after the failover the new primary has one replica until
//! the sentinels turn the demoted primary into the second, on their 10 s
//! `INFO` round, so no acquire succeeds for about 11 to 12 s and every
//! holder aborts at its local deadline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{LockName, LossReason};
use tokio::time::{sleep, Instant};

use super::cases::{granted, leak_probe};
use super::figures::{self, Row};
use super::holder::{Holder, Resource};
use super::Target;
use crate::backends::redis::SentinelFactory;
use crate::{Ctx, Replica};

/// Locks held across each failover (one holder and one waiter each).
const HOLDERS: usize = 3;
/// Bound on the failover, from `SENTINEL FAILOVER` to every sentinel naming
/// a promoted primary that reports `role:master`.
///
/// A requested failover needs no election: the promotion shows in the
/// replica's next `INFO` (every second during a failover) and the other
/// sentinels switch on the next hello (every 2 s), so about 3 s at most;
/// measured 0.8 to 1.3 s in 18 failovers beside `stress-ng --cpu 2`. What
/// load can add is a stalled sentinel: its TILT period (5 s in the
/// harness) and, if that aborted the attempt, the 4 s failover timeout
/// before the harness asks again, about 15 s in all. Beyond that the
/// failover is broken, and the trial says so at 20 s with the sentinels'
/// logs rather than waiting longer.
const FAILOVER_WITHIN: Duration = Duration::from_secs(20);
/// Bound on the deployment settling after a failover (the old primary
/// demoted and linked to the new one) before the next iteration.
const SETTLE_WITHIN: Duration = Duration::from_secs(40);
/// Bound on the first acquire after the switch when both replicas must
/// acknowledge: the sentinels' 10 s `INFO` period until they repoint the
/// demoted primary, its resynchronisation, and margin for a loaded machine.
const ACKED_RECONNECT_WITHIN: Duration = Duration::from_secs(30);
/// Writes a waiter makes once it has the lock.
const WAITER_WRITES: usize = 5;
/// Pause between a waiter's writes, and between probe attempts.
const STEP: Duration = Duration::from_millis(20);

/// One critical section: when it began and ended (lost or released) on the
/// monotonic clock all tasks share, and its fencing token.
#[derive(Debug, Clone, Copy)]
struct Section {
    start: Instant,
    end: Instant,
    token: u64,
}

/// Pairs of sections of one name that overlap in time.
fn overlaps(sections: &[Section]) -> usize {
    let mut n = 0;
    for (i, a) in sections.iter().enumerate() {
        for b in &sections[i + 1..] {
            if a.start < b.end && b.start < a.end {
                n += 1;
            }
        }
    }
    n
}

/// Every grant of one name: when, and under which token.
type Acquisitions = Arc<Mutex<Vec<(Instant, u64)>>>;

/// What one waiter saw: its section and the writes it made.
type Waited = (Section, usize);

/// Waits for `name`, writes a few guarded, fenced writes, releases.
async fn waiter(
    replica: Replica,
    name: LockName,
    opts: lock_core::LockOptions,
    resource: Arc<Resource>,
    acquisitions: Acquisitions,
) -> Waited {
    let expect = "the waiter acquires once the holder lets go";
    let (guard, start, token) = granted(&replica, &name, &opts, expect).await;
    let handle = guard.handle();
    acquisitions
        .lock()
        .expect("acquisitions")
        .push((start, token));
    let mut writes = 0;
    for _ in 0..WAITER_WRITES {
        let deadline = handle.remaining_validity().map(|r| Instant::now() + r);
        if handle.assert_held().is_err() {
            break;
        }
        resource.log.record(Instant::now(), deadline);
        resource.write(token);
        writes += 1;
        sleep(STEP).await;
    }
    let end = Instant::now();
    let _ = guard.release().await;
    (Section { start, end, token }, writes)
}

/// What one failover measured.
#[derive(Debug, Default)]
struct Trial {
    writes: usize,
    late: usize,
    stale: usize,
    overlaps: usize,
    leaked: usize,
    kept: usize,
    lost: Vec<LossReason>,
    detection: Vec<Duration>,
    abort: Vec<Duration>,
    reconnect: Option<Duration>,
    backwards: usize,
    switch: (u16, u16),
    switch_took: Duration,
}

async fn one_failover(ctx: &Ctx, factory: &SentinelFactory, target: Target, i: usize) -> Trial {
    let timing = ctx.timing();
    let tol = timing.tolerance;
    let opts = ctx.opts();
    let interval = opts.renew_interval();
    let set = Arc::clone(factory.set().expect("the Sentinel deployment"));
    let mut t = Trial::default();
    let names: Vec<LockName> = (0..HOLDERS)
        .map(|h| ctx.name(&format!("sentinel-{i}-{h}")))
        .collect();
    let resources: Vec<Arc<Resource>> = names.iter().map(|_| Arc::default()).collect();
    let acquisitions: Vec<Acquisitions> = names.iter().map(|_| Arc::default()).collect();
    let mut holders = Vec::with_capacity(HOLDERS);
    for (h, name) in names.iter().enumerate() {
        let rep = ctx.replica().await;
        let holder = Holder::start(&rep, name, &opts, Arc::clone(&resources[h])).await;
        acquisitions[h]
            .lock()
            .expect("acquisitions")
            .push((Instant::now(), holder.token));
        holders.push((rep, holder, Instant::now()));
    }
    let mut waiters = Vec::with_capacity(HOLDERS);
    for (h, name) in names.iter().enumerate() {
        let rep = ctx.replica().await;
        let wait = opts
            .clone()
            .with_acquire_timeout(FAILOVER_WITHIN + ACKED_RECONNECT_WITHIN);
        waiters.push(tokio::spawn(waiter(
            rep,
            name.clone(),
            wait,
            Arc::clone(&resources[h]),
            Arc::clone(&acquisitions[h]),
        )));
    }
    sleep(interval).await;
    for (_, holder, _) in &holders {
        assert!(holder.handle.is_held(), "healthy before the failover");
    }

    let failover_at = Instant::now();
    let blocking = Arc::clone(&set);
    t.switch = tokio::task::spawn_blocking(move || blocking.failover(FAILOVER_WITHIN))
        .await
        .expect("failover task")
        .expect("the sentinels promote a replica");
    let switched_at = Instant::now();
    t.switch_took = switched_at.saturating_duration_since(failover_at);

    // A fresh client reaches the promoted primary.
    let probe = ctx.replica().await;
    let probe_name = ctx.name(&format!("sentinel-probe-{i}"));
    let within = if factory.replica_ack().is_some() {
        ACKED_RECONNECT_WITHIN
    } else {
        FAILOVER_WITHIN
    };
    let until = switched_at + within;
    while t.reconnect.is_none() {
        match probe.locker.try_lock(&probe_name, &opts).await {
            Ok(g) => {
                t.reconnect = Some(failover_at.elapsed());
                g.release().await.expect("the probe releases");
            }
            Err(e) => {
                assert!(
                    Instant::now() < until,
                    "no acquire through the sentinels within {within:?} of the switch: {e}"
                );
                sleep(STEP).await;
            }
        }
    }

    // Each holder keeps its lease (its key reached the promoted replica) or
    // learns of the loss by its next renewal; either way never past its
    // local deadline.
    let hold_until = switched_at + interval * 2 + target.op_timeout + tol;
    let mut sections: Vec<Vec<Section>> = vec![Vec::new(); HOLDERS];
    for (h, (_rep, mut holder, start)) in holders.into_iter().enumerate() {
        let token = holder.token;
        match holder.lost_by(hold_until).await {
            Some((lost_at, reason)) => {
                t.lost.push(reason);
                t.abort.push(lost_at.saturating_duration_since(failover_at));
                t.detection
                    .push(lost_at.saturating_duration_since(switched_at));
                let (_guard, n) = holder.writes(timing.ttl).await;
                t.writes += n;
                sections[h].push(Section {
                    start,
                    end: lost_at,
                    token,
                });
            }
            None => {
                t.kept += 1;
                // A refused release fails closed: the waiter and the leak
                // probe below wait for the key to expire.
                let (_refused, end, n) = holder.release_kept(timing.ttl).await;
                t.writes += n;
                sections[h].push(Section { start, end, token });
            }
        }
    }
    for (h, w) in waiters.into_iter().enumerate() {
        let (section, writes) = tokio::time::timeout(FAILOVER_WITHIN + ACKED_RECONNECT_WITHIN, w)
            .await
            .expect("the waiter finishes")
            .expect("waiter task");
        t.writes += writes;
        if sections[h].iter().any(|s| section.token <= s.token) {
            t.backwards += 1;
        }
        sections[h].push(section);
    }
    let checker = ctx.replica().await;
    for (h, name) in names.iter().enumerate() {
        let acq = acquisitions[h].lock().expect("acquisitions").clone();
        t.stale += resources[h].stale_after_any(&acq);
        t.late += resources[h].log.after_deadline();
        t.overlaps += overlaps(&sections[h]);
        t.leaked += leak_probe(&checker.locker, name, &opts).await;
    }
    let new = t.switch.1;
    tokio::task::spawn_blocking(move || set.wait_settled(new, SETTLE_WITHIN))
        .await
        .expect("settle task")
        .expect("the old primary rejoins as a replica");
    t
}

/// `SENTINEL FAILOVER` under renewing holders and waiting waiters, on the
/// private deployment of `factory`; `chaos_sentinel_failover_acked` when its
/// backends ask for replica acknowledgement.
pub(super) async fn sentinel_failover(ctx: Ctx, target: Target, factory: Arc<SentinelFactory>) {
    let acked = factory.replica_ack().is_some();
    let case = if acked {
        "chaos_sentinel_failover_acked"
    } else {
        "chaos_sentinel_failover"
    };
    let mut row = Row::of(&ctx, case);
    let (mut kept, mut lost, mut backwards, mut switches) = (0, Vec::new(), 0, Vec::new());
    let mut switch_took = Vec::new();
    for i in 0..target.iterations {
        let t = one_failover(&ctx, &factory, target, i).await;
        row.count_fault(t.writes, t.late, t.stale, t.leaked);
        row.overlaps += t.overlaps;
        row.abort.extend(t.abort);
        row.detection.extend(t.detection);
        row.reconnect.extend(t.reconnect);
        kept += t.kept;
        lost.extend(t.lost);
        backwards += t.backwards;
        switches.push(t.switch);
        switch_took.push(t.switch_took);
    }
    row.iterations = target.iterations;
    let summary = format!(
        "{row:?}; primaries (old, new) {switches:?}, agreed on {switch_took:?} after the request; of {} held leases {kept} survived the failover and {} were lost ({lost:?}); \
         the Redis INCR fencing token went back (or repeated) for {backwards} successors",
        target.iterations * HOLDERS,
        lost.len()
    );
    eprintln!("{} {case}: {summary}", row.backend);
    figures::record(row.clone());
    // What the lock-redis docs promise under failover: a holder never acts
    // past its local deadline, a lost key is seen as expired or stolen (or
    // the renewals fail until the deadline), and nothing is left behind.
    // Overlaps and stale accepts are what asynchronous replication allows;
    // they are reported above, not asserted away.
    assert!(
        row.after_deadline == 0 && row.leaked == 0,
        "writes after the deadline or leaked locks: {summary}"
    );
    assert!(
        lost.iter().all(|r| matches!(
            r,
            LossReason::Expired | LossReason::Stolen | LossReason::BackendError
        )),
        "a holder lost its lease for another reason: {summary}"
    );
    // Acknowledged by every replica, the promoted one had every lock and
    // every increment: nothing stale gets through the library's own token.
    if acked {
        assert!(
            row.stale_accepts == 0 && row.overlaps == 0 && backwards == 0,
            "stale accepts, overlaps or a token that went back with acknowledgement from every replica: {summary}"
        );
    }
}
