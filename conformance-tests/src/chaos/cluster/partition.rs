//! One member cut off from the other two (its peer traffic dropped both
//! ways by nftables; client traffic untouched).
//!
//! A client pinned to the minority member cannot acquire, renew or verify
//! there: etcd serves writes, lease keep-alives and linearizable reads only
//! through a leader with a quorum, and the client asks for a leader on every
//! call. Its holder aborts by its local deadline; a client over the majority
//! then takes the lock, and writes under the old token stay refused. A
//! client over all three members either gets through the majority or fails
//! closed; it never gets a grant the others do not see.

use std::sync::Arc;
use std::time::Duration;

use lock_core::Error;
use tokio::time::{sleep, sleep_until, Instant};

use super::follower_for_round;
use super::watch::RenewWatch;
use crate::backends::etcd::cluster::{EtcdCluster, MEMBERS};
use crate::backends::etcd::server;
use crate::chaos::case_timing;
use crate::chaos::cases::{successor_takes, wind_down, Handover, Target};
use crate::chaos::figures::Row;
use crate::chaos::holder::{Holder, Resource};
use crate::Ctx;

/// Attempts the all-member client makes during each partition.
const MIXED_ATTEMPTS: usize = 5;

/// Cuts one follower away once per iteration (the leader stays with the
/// majority, so the case is about the minority's clients, not an election).
pub(super) async fn minority(ctx: Ctx, cluster: Arc<EtcdCluster>, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let mut row = Row::of(&ctx, "chaos_minority_partition");
    let (mut mixed_ok, mut mixed_refused) = (0, 0);
    for i in 0..target.iterations {
        let minority = follower_for_round(&cluster, i).await;
        let majority: Vec<usize> = (0..MEMBERS).filter(|m| *m != minority).collect();
        let pinned = connect(&ctx, &cluster, &[minority]).await;
        let successor = connect(&ctx, &cluster, &majority).await;
        let mixed = ctx.replica().await;
        let name = ctx.name(&format!("minority-{i}"));
        let resource = Arc::new(Resource::default());
        let mut holder = Holder::start(&pinned, &name, &opts, Arc::clone(&resource)).await;
        let watch = RenewWatch::start(holder.handle.clone());
        sleep(ttl / 2).await;
        assert!(holder.handle.is_held(), "healthy before the fault");
        let fault_at = Instant::now();
        let deadline = fault_at + holder.handle.remaining_validity().expect("a deadline");
        let cut = cluster.cut_peers(minority).expect("nft cuts the member");
        let cut_done = Instant::now();
        row.faults += 1;
        // No acquisition and no linearizable read through the minority.
        let probe = ctx.name(&format!("minority-probe-{i}"));
        let call_at = Instant::now();
        let refused = pinned.locker.try_lock(&probe, &opts).await;
        row.max_blocked = row.max_blocked.max(Some(call_at.elapsed()));
        assert!(
            refused.is_err(),
            "the minority member granted {probe:?} without a quorum"
        );
        let Some((lost_at, reason)) = holder.lost_by(deadline + tol).await else {
            panic!(
                "the pinned holder did not abort by its local deadline: {:?} after the fault \
                 (+{tol:?}); the cut took {:?}; it still reports {:?} of validity; renewals seen \
                 (ms after the fault: seen, new deadline): {:?}",
                deadline - fault_at,
                cut_done - fault_at,
                holder.handle.remaining_validity(),
                watch.timeline(fault_at),
            );
        };
        // A renewal can only count once its request was answered, and no
        // request sent after the cut can be: the member has no leader.
        let renewed = watch.sent_after(cut_done, ttl);
        assert!(
            renewed.is_empty(),
            "renewed through the minority member after the cut ({} renewals; ms after the fault: {:?})",
            renewed.len(),
            watch.timeline(fault_at),
        );
        row.abort.push(lost_at - fault_at);
        row.stall.push(watch.stall(fault_at, lost_at));
        assert!(
            holder.handle.verify().await.is_err(),
            "a lost lease does not verify through the minority"
        );
        let (acquired_at, succ) =
            successor_takes(&successor, &name, &opts, ttl * 4, &resource).await;
        assert!(
            lost_at < acquired_at,
            "aborted ({reason:?}) before the majority's client acquired"
        );
        // The all-member client: through the majority, or refused.
        for k in 0..MIXED_ATTEMPTS {
            let other = ctx.name(&format!("minority-mixed-{i}-{k}"));
            let call_at = Instant::now();
            let outcome = mixed.locker.try_lock(&other, &opts).await;
            let took = call_at.elapsed();
            row.max_blocked = row.max_blocked.max(Some(took));
            assert!(
                took <= target.op_timeout * 2 + tol,
                "a call blocked {took:?} during the partition"
            );
            match outcome {
                Ok(g) => {
                    mixed_ok += 1;
                    // A release that lands on the minority fails closed;
                    // the lease then expires.
                    if g.release().await.is_err() {
                        mixed_refused += 1;
                    }
                }
                Err(Error::HeldElsewhere { .. }) => panic!("a fresh name is free"),
                Err(_) => mixed_refused += 1,
            }
        }
        sleep_until(fault_at + ttl * 2).await;
        drop(cut);
        sleep(opts.renew_interval() * 2).await;
        assert!(
            holder.handle.assert_held().is_err(),
            "the old lease stays lost after healing"
        );
        let (writes, _) = holder.writes_after_loss(ttl).await;
        let late = resource.log.after_deadline();
        let h = Handover::new(&successor.locker, &name, &opts);
        wind_down(&mut row, h, succ, &resource, acquired_at, (writes, late)).await;
        // The healed member catches up before the next cut.
        cluster
            .wait_leader(None, Duration::from_secs(10))
            .await
            .expect("a leader after healing");
        sleep(ttl).await;
    }
    row.iterations = target.iterations;
    println!(
        "etcd_cluster: minority partition: the all-member client got {mixed_ok} grants through the majority and {mixed_refused} calls refused"
    );
    row.finish();
}

async fn connect(ctx: &Ctx, cluster: &EtcdCluster, members: &[usize]) -> crate::Replica {
    let builder = cluster.builder_over(members).expect("a builder");
    let backend = server::connect_when_ready(builder)
        .await
        .expect("connects to the members");
    ctx.replica_over(Arc::new(backend))
}
