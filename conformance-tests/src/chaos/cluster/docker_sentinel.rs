//! The Redis primary cut off from everyone between hosts (the `docker`
//! feature): a Sentinel deployment in containers (a primary, two replicas,
//! three sentinels), the primary taken off their network with `docker
//! network disconnect` while holders renew and waiters wait, every client
//! connected through the sentinels. The primary keeps running, unreachable;
//! the sentinels promote a replica.
//!
//! Each fault has two holders, each with a waiter queued behind it:
//!
//! - one with the suite's 1 s TTL, which no failover can outlast (a primary
//!   is deemed down after 1 s of silence): it must abort by its local
//!   deadline, before the promotion, and its waiter is granted the lock on
//!   the promoted replica only after that;
//! - one with an 8 s TTL, longer than a failover takes here: its key is on
//!   both replicas before the cut (`WAIT`), so it keeps its lease by
//!   renewing on the promoted replica once the sentinels name it, or aborts
//!   by its local deadline if the failover is slower; either way its waiter
//!   is granted the lock only after it let go.
//!
//! No write is accepted under a holder's token once its waiter wrote, and
//! nothing is left held. Once the cut primary has been alone for longer
//! than `min-replicas-max-lag`, it is put back on the network at its
//! address: it still believes it is the primary, and a client that reaches
//! it directly must be refused (no replica acknowledges it). One fresh
//! deployment per fault, since the sentinels take many seconds to turn a
//! returning primary into a replica.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{LockOptions, LossReason};
use tokio::time::{sleep, sleep_until, Instant};

use super::leader::{self, acquired_within, loss_of, release_kept};
use crate::backends::docker_sentinel::{self, DockerSentinelFactory, DockerSentinelSet, MAX_LAG};
use crate::backends::redis::config_for;
use crate::chaos::cases::{wind_down, Handover, Target};
use crate::chaos::figures::{self, Row};
use crate::chaos::key_int;
use crate::harness::docker;
use crate::Ctx;

/// The lease that rides out the failover.
const LONG_TTL: Duration = Duration::from_secs(8);

/// Bound on the sentinels agreeing on a promoted replica after the cut
/// (measured 2.5 to 3 s: 1 s until the primary is deemed down, then the
/// election and the promotion), with room for a sentinel in TILT.
const FAILOVER_WITHIN: Duration = Duration::from_secs(20);

/// The messages of [`release_kept`]'s expectations for the 8 s lease the
/// promoted replica serves.
const KEPT_ON_PROMOTED: (&str, &str) = (
    "a lease held locally is held on the promoted replica",
    "the holder releases on the promoted replica",
);

/// Smoke iterations; `CHAOS_SOAK` multiplies them.
const SMOKE_ITERATIONS: usize = 2;

const CASE: &str = "chaos_primary_partition";

/// The trial, `docker_redis_sentinel::chaos_primary_partition`. A missing
/// engine or image fails it under `DISTLOCK_REQUIRE_DOCKER=1` and skips it
/// loudly elsewhere.
pub(in crate::chaos) fn trials(run_id: &str) -> Vec<Trial> {
    let target = Target {
        op_timeout: crate::backends::redis::OP_TIMEOUT,
        iterations: figures::iterations(SMOKE_ITERATIONS),
        scheme: "redis+sentinel",
    };
    let run_id = run_id.to_owned();
    super::docker_trial(
        "docker_redis_sentinel",
        CASE,
        docker::Kind::Redis,
        move || run(&run_id, target),
    )
}

fn run(run_id: &str, target: Target) -> Result<(), Failed> {
    let factory = Arc::new(DockerSentinelFactory::new(&crate::chaos::redis_prefix(
        run_id,
    )));
    let body = Arc::clone(&factory);
    let outcome = crate::chaos::run_on(Arc::clone(&factory) as _, run_id, CASE, move |ctx| {
        primary_partition(ctx, body, target)
    });
    // The last deployment goes with the factory's handle, a failed case
    // included.
    factory.clear();
    outcome
}

/// A holder and its waiter, with the options (and so the TTL) of the
/// holder's lease.
struct Pair {
    ttl: Duration,
    opts: LockOptions,
    pair: leader::Pair,
}

/// What one fault measured, beyond the row.
#[derive(Debug, Default)]
struct Seen {
    /// The old and the promoted primary (data server indices).
    switch: (usize, usize),
    promoted_in: Duration,
    /// How the 1 s holder's lease ended.
    short: Option<LossReason>,
    /// How the 8 s holder's lease ended: `None` if it was kept.
    long: Option<LossReason>,
    /// How long before its key expired on the replicas the 1 s holder
    /// aborted (negative: after).
    margin_ms: i128,
    old_refused: String,
}

/// Cuts the primary off once per iteration, each on a fresh deployment.
async fn primary_partition(ctx: Ctx, factory: Arc<DockerSentinelFactory>, target: Target) {
    let mut row = Row::of(&ctx, CASE);
    let mut seen = Vec::new();
    for i in 0..target.iterations {
        let f = Arc::clone(&factory);
        let set = tokio::task::spawn_blocking(move || f.deploy())
            .await
            .expect("deploy task")
            .expect("the Sentinel deployment in containers starts");
        seen.push(one_cut(&ctx, &set, factory.prefix(), target, i, &mut row).await);
        factory.clear();
        tokio::task::block_in_place(move || drop(set));
    }
    row.iterations = target.iterations;
    let lines: Vec<String> = seen
        .iter()
        .map(|s| {
            format!(
                "r{}->r{} promoted in {:?}; the 1 s holder lost its lease ({:?}) {} ms before its key expired on the replicas; the 8 s holder {}; the old primary, back, refused: {}",
                s.switch.0,
                s.switch.1,
                s.promoted_in,
                s.short,
                s.margin_ms,
                s.long
                    .map_or_else(|| "kept its lease".to_owned(), |r| format!("lost its lease ({r:?})")),
                s.old_refused
            )
        })
        .collect();
    let summary = format!("{row:?}; {}", lines.join("; "));
    println!("docker_redis_sentinel: primary partition: {summary}");
    let ok =
        row.stale_accepts == 0 && row.after_deadline == 0 && row.overlaps == 0 && row.leaked == 0;
    figures::record(row);
    assert!(ok, "unsafe writes, overlaps or leaks: {summary}");
}

async fn one_cut(
    ctx: &Ctx,
    set: &Arc<DockerSentinelSet>,
    prefix: &str,
    target: Target,
    i: usize,
    row: &mut Row,
) -> Seen {
    let tol = ctx.timing().tolerance;
    let short = ctx.opts();
    let long = LockOptions::new(LONG_TTL);
    let mut seen = Seen::default();
    let old = tokio::task::block_in_place(|| set.primary()).expect("the sentinels name a primary");
    let mut pairs = Vec::new();
    for (kind, opts) in [("short", short.clone()), ("long", long)] {
        let name = ctx.name(&format!("primary-partition-{i}-{kind}"));
        let pair = leader::Pair::start(ctx, name, &opts, FAILOVER_WITHIN + LONG_TTL * 2).await;
        pairs.push(Pair {
            ttl: opts.ttl(),
            opts,
            pair,
        });
    }
    sleep(short.ttl()).await;
    // Both replicas have both locks before the cut.
    let old_url = set.server_url(old).expect("the old primary's URL");
    let mut direct = redis::Client::open(old_url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("a direct connection to the primary");
    let acked: i64 = redis::cmd("WAIT")
        .arg(2)
        .arg(5_000)
        .query_async(&mut direct)
        .await
        .expect("WAIT");
    assert_eq!(acked, 2, "both replicas acknowledge the holders' locks");
    drop(direct);

    let fault_at = Instant::now();
    tokio::task::block_in_place(|| set.cut(old)).expect("docker cuts the primary off");
    row.faults += 1;
    // Where the 1 s holder's key expires on the replicas: what the promoted
    // one will hold.
    let replica = (old + 1) % docker_sentinel::SERVERS;
    let key = format!("{prefix}{}", pairs[0].pair.name.as_str());
    let expires_at = {
        let mut c = redis::Client::open(set.server_url(replica).expect("url").as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("a direct connection to a replica");
        let asked = Instant::now();
        let pttl: i64 = key_int(&mut c, "PTTL", &key).await;
        assert!(
            pttl > 0,
            "the 1 s holder's key is not on the replica ({pttl})"
        );
        asked + Duration::from_millis(pttl.unsigned_abs())
    };

    let s = Arc::clone(set);
    let new = tokio::task::spawn_blocking(move || s.wait_new_primary(old, FAILOVER_WITHIN))
        .await
        .expect("task")
        .expect("the sentinels promote a replica");
    let switched_at = Instant::now();
    seen.promoted_in = switched_at - fault_at;

    // A fresh client through the sentinels reaches the promoted replica.
    let probe = ctx.replica().await;
    let probe_name = ctx.name(&format!("primary-partition-probe-{i}"));
    let until = switched_at + FAILOVER_WITHIN;
    loop {
        match probe.locker.try_lock(&probe_name, &short).await {
            Ok(g) => {
                row.reconnect.push(fault_at.elapsed());
                g.release().await.expect("the probe releases");
                break;
            }
            Err(e) => {
                assert!(
                    Instant::now() < until,
                    "no acquire through the sentinels within {FAILOVER_WITHIN:?} of the promotion: {e}"
                );
                sleep(Duration::from_millis(20)).await;
            }
        }
    }

    for Pair {
        ttl,
        opts,
        pair: mut p,
    } in pairs
    {
        let interval = opts.renew_interval();
        let (let_go_at, writes) = if ttl == LONG_TTL {
            // Renewals are retried every quarter interval while the lease
            // is valid: by then one has reached the promoted replica.
            sleep_until(switched_at + interval + target.op_timeout + tol).await;
            if p.holder.handle.is_held() {
                release_kept(p.holder, p.watch, row, fault_at, ttl, KEPT_ON_PROMOTED).await
            } else {
                let (lost_at, reason) = loss_of(&mut p.holder).await;
                seen.long = Some(reason);
                row.abort.push(lost_at - fault_at);
                // A loss learnt from the promoted replica: from the
                // promotion on, the key could be gone there.
                if lost_at > switched_at {
                    row.detection.push(lost_at - switched_at);
                }
                row.stall.push(p.watch.stall(fault_at, lost_at));
                let (_old, writes) = p.holder.writes(ttl).await;
                (lost_at, writes)
            }
        } else {
            let (lost_at, reason) = p
                .holder
                .lost_by(fault_at + ttl + tol)
                .await
                .expect("the 1 s holder aborts by its local deadline");
            assert!(
                lost_at < switched_at,
                "the 1 s holder aborted {:?} after the promotion",
                lost_at - switched_at
            );
            seen.margin_ms = if lost_at <= expires_at {
                i128::try_from((expires_at - lost_at).as_millis()).unwrap_or(i128::MAX)
            } else {
                -i128::try_from((lost_at - expires_at).as_millis()).unwrap_or(i128::MAX)
            };
            seen.short = Some(reason);
            // Before the promotion: no detection time to record, the lease
            // ended before any other server could grant the lock. The
            // renewal stall is the 8 s holders' figure alone.
            row.abort.push(lost_at - fault_at);
            let _ = p.watch.stall(fault_at, lost_at);
            let (_old, writes) = p.holder.writes(ttl).await;
            (lost_at, writes)
        };
        let (acquired_at, succ) = acquired_within(p.waiter, FAILOVER_WITHIN + LONG_TTL * 2).await;
        if acquired_at < let_go_at {
            row.overlaps += 1;
        }
        let late = p.resource.log.after_deadline();
        let h = Handover::new(&p.waiter_rep.locker, &p.name, &opts);
        wind_down(row, h, succ, &p.resource, acquired_at, (writes, late)).await;
    }
    // Alone past min-replicas-max-lag, the old primary counts no replica.
    sleep_until(fault_at + MAX_LAG + Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| set.heal(old)).expect("docker reconnects the old primary");
    let old_role = {
        let s = Arc::clone(set);
        tokio::task::spawn_blocking(move || s.role_of(old, Duration::from_secs(5)))
            .await
            .expect("task")
            .expect("the old primary answers once back")
    };
    let pinned = config_for(&old_url)
        .expect("config")
        .with_key_prefix(prefix)
        .connect()
        .await
        .expect("connects to the old primary");
    let pinned = ctx.replica_over(Arc::new(pinned));
    let stale_name = ctx.name(&format!("primary-partition-stale-{i}"));
    let asked = Instant::now();
    let refused = pinned.locker.try_lock(&stale_name, &short).await;
    row.max_blocked = row.max_blocked.max(Some(asked.elapsed()));
    match refused {
        Ok(_) => panic!("the old primary ({old_role}), back on the network, granted a lock"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("NOREPLICAS") || msg.contains("READONLY"),
                "the old primary ({old_role}) refused for another reason than its missing replicas: {msg}"
            );
            seen.old_refused = format!("{old_role}: {msg}");
        }
    }
    seen.switch = (old, new);
    seen
}
