//! Redis behind Sentinel: a lock that never reached a replica, then the
//! primary killed and a replica promoted by the sentinels.
//!
//! Both replicas are frozen (SIGSTOP) and their links cut while the victim
//! takes its lock, so the lock key and the fencing counter's last increment
//! exist on the primary alone; the primary is then killed and the replicas
//! thawed. This
//! is what asynchronous replication allows in any failover, made certain:
//! the victim must learn of the loss at its first renewal on the promoted
//! primary (expired or stolen) before its local deadline, a waiter is
//! granted the lock meanwhile (a raw overlap), and the fencing counter goes
//! back, so a resource fenced by the Redis token accepts the victim's stale
//! writes. All of it is counted in the row; the TTL is long enough (8 s)
//! for the sentinels to promote a replica within it.
//!
//! `chaos_sentinel_primary_lost_acked` runs the same with every client
//! asking for acknowledgement by one replica: the victim's acquire is then
//! refused (no replica acknowledges it) and released again, so the victim
//! never holds the lock; the case asserts the refusal, 0 stale accepts,
//! 0 overlaps and a waiter token above every earlier one.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockName, LockOptions, LossReason};
use tokio::time::{sleep, Instant};

use super::cases::leak_probe;
use super::figures::{self, Row};
use super::holder::{Holder, Resource};
use super::key_int;
use super::sentinel_lost_clients::{direct, through, waiter, ACK};
use super::Target;
use crate::backends::redis::sentinel::SentinelSet;
use crate::backends::redis::OP_TIMEOUT;
use crate::Ctx;

/// Lease TTL: above the ~3 s a kill-triggered failover takes here (1 s
/// `down-after-milliseconds`, election, promotion) with room for load.
const TTL: Duration = Duration::from_secs(8);
/// Holders whose keys reached the replicas before the freeze.
const KEEPERS: usize = 2;
/// Bound on the sentinels promoting a replica after the kill.
const FAILOVER_WITHIN: Duration = Duration::from_secs(30);

/// What one kill measured.
#[derive(Debug, Default)]
struct Trial {
    writes: usize,
    late: usize,
    stale: usize,
    overlap: Option<Duration>,
    leaked: usize,
    victim: Option<LossReason>,
    detection: Option<Duration>,
    abort: Option<Duration>,
    reconnect: Option<Duration>,
    key_lost: bool,
    backwards: bool,
    victim_refused_in: Option<Duration>,
    waiter_refused: usize,
    kept: usize,
    keepers_lost: Vec<LossReason>,
    switch: (u16, u16),
    promoted_in: Duration,
}

async fn one_kill(
    ctx: &Ctx,
    target: Target,
    prefix: &str,
    ack: Option<(u8, Duration)>,
    i: usize,
) -> Trial {
    let tol = ctx.timing().tolerance;
    let opts = LockOptions::new(TTL);
    let interval = opts.renew_interval();
    let (set, old, replicas) = deploy().await;
    let mut t = Trial::default();

    let keep_names: Vec<LockName> = (0..KEEPERS)
        .map(|k| ctx.name(&format!("lost-{i}-keep-{k}")))
        .collect();
    let mut keepers = Vec::new();
    for name in &keep_names {
        let rep = through(ctx, &set, prefix, ack).await;
        let holder = Holder::start(&rep, name, &opts, Arc::default()).await;
        keepers.push((rep, holder));
    }
    let mut p = direct(old).await;
    isolate_primary(&set, &replicas, &mut p).await;

    let victim_name = ctx.name(&format!("lost-{i}-victim"));
    let victim_key = format!("{prefix}{}", victim_name.as_str());
    let resource = Arc::new(Resource::default());
    let victim_rep = through(ctx, &set, prefix, ack).await;
    let mut earlier: Vec<u64> = keepers.iter().map(|(_, h)| h.token).collect();
    let mut victim = None;
    // The victim's owner token as the old primary stores it.
    let mut victim_value: Option<String> = None;
    if ack.is_some() {
        // No replica can acknowledge: refused, and released again.
        let asked = Instant::now();
        let refusal = victim_rep.locker.try_lock(&victim_name, &opts).await;
        let took = asked.elapsed();
        match refusal {
            Err(lock_core::Error::Unavailable { source, .. }) => assert!(
                source.message().contains("0 of the 1 replicas"),
                "the victim was refused for another reason: {source}"
            ),
            other => panic!("the unacknowledged acquire was not refused: {other:?}"),
        }
        let bound = ACK.1 + OP_TIMEOUT + tol;
        assert!(
            took <= bound,
            "the victim's refusal took {took:?} (bound {bound:?})"
        );
        t.victim_refused_in = Some(took);
        let left: i64 = key_int(&mut p, "EXISTS", &victim_key).await;
        assert_eq!(left, 0, "the refused lock was not released again");
    } else {
        let v = Holder::start(&victim_rep, &victim_name, &opts, Arc::clone(&resource)).await;
        victim_value = redis::cmd("GET")
            .arg(&victim_key)
            .query_async(&mut p)
            .await
            .expect("GET the victim's key");
        earlier.push(v.token);
        victim = Some((v, Instant::now()));
    }
    let waiter_rep = through(ctx, &set, prefix, ack).await;
    let waited = tokio::spawn(waiter(
        waiter_rep,
        victim_name.clone(),
        opts.clone().with_acquire_timeout(FAILOVER_WITHIN + TTL),
        Arc::clone(&resource),
    ));
    sleep(interval / 2).await;

    let (new, killed_at, switched_at) = kill_primary(&set, old, &replicas, FAILOVER_WITHIN).await;
    t.switch = (old, new);
    t.promoted_in = switched_at - killed_at;
    // The waiter may already hold the name on the promoted primary; what
    // matters is that the victim's lock is not there.
    let on_new: Option<String> = redis::cmd("GET")
        .arg(&victim_key)
        .query_async(&mut direct(new).await)
        .await
        .expect("GET on the promoted primary");
    t.key_lost = on_new.is_none() || on_new != victim_value;
    assert!(
        t.key_lost,
        "the promoted replica has the victim's key: the fault was not injected"
    );

    let mut victim_lost = None;
    if let Some((mut victim, victim_at)) = victim {
        let victim_token = victim.token;
        let victim_deadline = victim_at + TTL;
        let (lost_at, reason) = victim
            .lost_by(victim_deadline + tol)
            .await
            .expect("the victim's lease ends by its local deadline");
        t.victim = Some(reason);
        t.abort = Some(lost_at - killed_at);
        t.detection = Some(lost_at.saturating_duration_since(switched_at));
        let (_guard, n) = victim.writes(TTL).await;
        t.writes += n;
        // Where the promoted primary answered well before the victim's deadline,
        // the loss must have come from a renewal there, not from the deadline.
        if t.key_lost && switched_at + interval + target.op_timeout + tol < victim_deadline {
            assert!(
                matches!(reason, LossReason::Expired | LossReason::Stolen),
                "the victim's key vanished but it lost its lease as {reason:?}"
            );
            assert!(
                lost_at <= switched_at + interval + target.op_timeout + tol,
                "the victim learned of the loss {:?} after the promotion",
                lost_at - switched_at
            );
        }
        victim_lost = Some((lost_at, victim_token));
    }

    let w = tokio::time::timeout(FAILOVER_WITHIN + TTL * 2, waited)
        .await
        .expect("the waiter finishes")
        .expect("waiter task");
    t.writes += w.accepted + w.refused;
    t.waiter_refused = w.refused;
    t.reconnect = Some(w.granted - killed_at);
    t.backwards = earlier.iter().any(|e| w.token <= *e);
    if let Some((lost_at, victim_token)) = victim_lost {
        t.overlap = (lost_at > w.granted).then(|| lost_at.min(w.end) - w.granted);
        // The victim's writes the Redis-fenced resource accepted after the
        // waiter's first write: stale writes a failover-safe token would refuse.
        t.stale = resource
            .accepted()
            .iter()
            .filter(|(at, token)| *token == victim_token && *at >= w.first_write)
            .count();
    }
    t.late += resource.log.after_deadline();

    // The promoted primary refuses writes (min-replicas-to-write) whenever
    // its one replica is not linked, which the sentinels' reconfiguration
    // can cause again after the waiter's grant: the keepers release once it
    // is linked, so a refused release is not counted as a leak.
    wait_linked(&set, new, FAILOVER_WITHIN).await;
    let hold_until = switched_at + interval + target.op_timeout + tol;
    let mut refused_releases = 0;
    for (_rep, mut holder) in keepers {
        match holder.lost_by(hold_until).await {
            Some((_, reason)) => {
                t.keepers_lost.push(reason);
                let (_guard, n) = holder.writes(TTL).await;
                t.writes += n;
            }
            None => {
                let (refused, _, n) = holder.release_kept(TTL).await;
                refused_releases += usize::from(refused);
                t.kept += 1;
                t.writes += n;
            }
        }
    }
    if refused_releases > 0 {
        // Their keys outlive the refused release by up to one TTL.
        sleep(TTL + tol).await;
    }
    let checker = through(ctx, &set, prefix, ack).await;
    for name in keep_names.iter().chain([&victim_name]) {
        t.leaked += leak_probe(&checker.locker, name, &opts).await;
    }
    drop(checker);
    tokio::task::block_in_place(move || drop(set));
    t
}

/// A fresh deployment, its primary's port and its two replicas' ports.
pub(super) async fn deploy() -> (Arc<SentinelSet>, u16, Vec<u16>) {
    let set = Arc::new(
        tokio::task::spawn_blocking(SentinelSet::start)
            .await
            .expect("start task")
            .expect("the Sentinel deployment starts"),
    );
    let old = {
        let s = Arc::clone(&set);
        tokio::task::spawn_blocking(move || s.primary_port())
            .await
            .expect("task")
            .expect("the sentinels name the primary")
    };
    let replicas: Vec<u16> = set
        .server_ports()
        .into_iter()
        .filter(|p| *p != old)
        .collect();
    (set, old, replicas)
}

/// Kills the primary `old` (SIGKILL), thaws the `replicas` that
/// [`isolate_primary`] froze, and waits up to `within` for the sentinels to
/// promote one. Returns the promoted server, when the kill was sent and
/// when the promotion was seen.
pub(super) async fn kill_primary(
    set: &Arc<SentinelSet>,
    old: u16,
    replicas: &[u16],
    within: Duration,
) -> (u16, Instant, Instant) {
    let killed_at = Instant::now();
    set.server(old)
        .expect("primary")
        .kill()
        .expect("SIGKILL the primary");
    for r in replicas {
        set.server(*r)
            .expect("replica")
            .resume()
            .expect("SIGCONT a replica");
    }
    let s = Arc::clone(set);
    let new = tokio::task::spawn_blocking(move || s.wait_new_primary(old, within))
        .await
        .expect("task")
        .expect("the sentinels promote a replica");
    (new, killed_at, Instant::now())
}

/// Waits up to `within` until the thawed replica is linked to the promoted
/// primary `new`.
pub(super) async fn wait_linked(set: &Arc<SentinelSet>, new: u16, within: Duration) {
    let s = Arc::clone(set);
    tokio::task::spawn_blocking(move || s.wait_settled(new, within))
        .await
        .expect("task")
        .expect("the thawed replica links to the promoted primary");
}

/// Makes what is written next exist on the primary alone: waits until both
/// `replicas` of `set` have every write so far, freezes them (SIGSTOP),
/// cuts their replication links and lets the primary accept writes without
/// them. `p` is a direct connection to the primary.
pub(super) async fn isolate_primary(
    set: &SentinelSet,
    replicas: &[u16],
    p: &mut redis::aio::MultiplexedConnection,
) {
    // Both replicas have every write so far before they are frozen.
    let acked: i64 = redis::cmd("WAIT")
        .arg(2)
        .arg(5_000)
        .query_async(p)
        .await
        .expect("WAIT");
    assert_eq!(acked, 2, "both replicas acknowledge every write so far");
    for r in replicas {
        set.server(*r)
            .expect("replica")
            .pause()
            .expect("SIGSTOP a replica");
    }
    // A frozen replica still receives the stream into its socket buffer and
    // applies it once thawed; cutting the links loses it for good. The
    // primary then has no replica, so it must accept writes without one:
    // the victim's write stands for one acknowledged in the moment before
    // the stream broke, which min-replicas-to-write does not prevent (it
    // counts linked replicas, not acknowledgements of this write).
    let cut: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(p)
        .await
        .expect("CLIENT KILL TYPE replica");
    assert_eq!(cut, 2, "both replication links are cut");
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg("0")
        .query_async(p)
        .await
        .expect("CONFIG SET min-replicas-to-write 0");
}

/// The primary killed after a lock that reached no replica; one fresh
/// deployment per iteration. Keys under `prefix`. With `ack` (see [`ACK`])
/// every client asks for replica acknowledgement
/// (`chaos_sentinel_primary_lost_acked`).
pub(super) async fn sentinel_primary_lost(
    ctx: Ctx,
    target: Target,
    prefix: String,
    ack: Option<(u8, Duration)>,
) {
    let case = if ack.is_some() {
        "chaos_sentinel_primary_lost_acked"
    } else {
        "chaos_sentinel_primary_lost"
    };
    let mut row = Row::of(&ctx, case);
    let mut trials = Vec::new();
    for i in 0..target.iterations {
        let t = one_kill(&ctx, target, &prefix, ack, i).await;
        row.faults += 1;
        row.writes += t.writes;
        row.after_deadline += t.late;
        row.stale_accepts += t.stale;
        row.overlaps += usize::from(t.overlap.is_some());
        row.leaked += t.leaked;
        row.abort.extend(t.abort);
        row.detection.extend(t.detection);
        row.reconnect.extend(t.reconnect);
        trials.push(t);
    }
    row.iterations = target.iterations;
    let lines: Vec<String> = trials
        .iter()
        .map(|t| {
            format!(
                "primary {}->{} promoted in {:?}; victim key lost {}, victim {:?}, victim's acquire refused in {:?}, overlap {:?}; \
                 Redis fencing token went back {}; waiter writes refused {}; keepers kept {} lost {:?}",
                t.switch.0,
                t.switch.1,
                t.promoted_in,
                t.key_lost,
                t.victim,
                t.victim_refused_in,
                t.overlap,
                t.backwards,
                t.waiter_refused,
                t.kept,
                t.keepers_lost
            )
        })
        .collect();
    let summary = format!("{row:?}; {}", lines.join("; "));
    eprintln!("{} {case}: {summary}", row.backend);
    figures::record(row.clone());
    assert!(
        row.after_deadline == 0 && row.leaked == 0,
        "writes after the deadline or leaked locks: {summary}"
    );
    if ack.is_some() {
        assert!(
            row.stale_accepts == 0 && row.overlaps == 0 && trials.iter().all(|t| !t.backwards),
            "stale accepts, overlaps or a waiter token not above every earlier one with acknowledgement: {summary}"
        );
    }
}
