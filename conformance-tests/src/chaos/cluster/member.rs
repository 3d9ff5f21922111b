//! The member a client talks to killed (SIGKILL) or frozen (SIGSTOP). The
//! victim is a follower, so the cluster keeps every lease.
//!
//! Killed: the client moves to another member within its request timeout
//! (a refused connection is retried at once) and keeps its leases. Frozen:
//! its connections stay open, so a call sent there gets no answer; the
//! backend passes a member over after half the request timeout, goes on at
//! another within the other half, and sends no call there for 5 s after.
//! Either way every holder keeps its lease, and a fresh acquisition
//! succeeds within [`PROBE_TRIES`] calls. The case also asserts what is
//! safe (no write after a deadline, none accepted under an old token,
//! nothing leaked) and reports calls failed and the time to the first answer.

use std::sync::Arc;
use std::time::Duration;

use lock_core::Error;
use tokio::time::{sleep, sleep_until, Instant};

use super::follower_for_round;
use super::watch::RenewWatch;
use crate::backends::etcd::cluster::EtcdCluster;
use crate::chaos::case_timing;
use crate::chaos::cases::{leak_probe, Target};
use crate::chaos::figures::Row;
use crate::chaos::holder::{Holder, Resource};
use crate::Ctx;

/// Locks held across each fault.
const HOLDERS: usize = 2;

/// Calls per probe. The first call that reaches the frozen member passes it
/// over after half the request timeout and is answered by another member in
/// the other half; the calls after it go straight to a healthy member. One
/// more call covers a healthy member answering later than that half on a
/// loaded machine, so the first answer comes within
/// `PROBE_TRIES × (request timeout + tolerance)` of the freeze.
const PROBE_TRIES: usize = 2;

/// Kills or freezes a follower once per iteration while [`HOLDERS`] holders
/// renew through clients connected to all three members.
pub(super) async fn member_fault(ctx: Ctx, cluster: Arc<EtcdCluster>, target: Target, pause: bool) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let case = if pause {
        "chaos_member_pause"
    } else {
        "chaos_member_kill"
    };
    let mut row = Row::of(&ctx, case);
    let (mut failovers, mut failed_calls, mut lost) = (Vec::new(), 0, 0);
    for i in 0..target.iterations {
        let victim = follower_for_round(&cluster, i).await;
        // Fresh clients, each with a connection to every member.
        let mut holders = Vec::new();
        for h in 0..HOLDERS {
            let rep = ctx.replica().await;
            let name = ctx.name(&format!("member-{i}-{h}"));
            let resource = Arc::new(Resource::default());
            let holder = Holder::start(&rep, &name, &opts, Arc::clone(&resource)).await;
            let watch = RenewWatch::start(holder.handle.clone());
            holders.push((rep, name, resource, holder, watch));
        }
        sleep(ttl).await;
        let fault_at = Instant::now();
        if pause {
            cluster.pause(victim).expect("SIGSTOP the member");
        } else {
            cluster.kill(victim).expect("SIGKILL the member");
        }
        row.faults += 1;
        // Every client must get answers from another member: fresh
        // acquisitions from each holder's client succeed. A killed member
        // refuses connections and the call moves on at once; a frozen one
        // keeps its connections open, so a call sent there moves on after
        // half the request timeout.
        for (h, (rep, ..)) in holders.iter().enumerate() {
            let probe = ctx.name(&format!("member-probe-{i}-{h}"));
            let from = Instant::now();
            let mut answered = None;
            for _ in 0..PROBE_TRIES {
                let call_at = Instant::now();
                let outcome = rep.locker.try_lock(&probe, &opts).await;
                let took = call_at.elapsed();
                row.max_blocked = row.max_blocked.max(Some(took));
                assert!(
                    took <= target.op_timeout + tol,
                    "a call blocked {took:?} on a frozen member"
                );
                match outcome {
                    Ok(g) => {
                        answered = Some(from.elapsed());
                        // A release the balancer sends to the frozen member
                        // fails closed; the probe's lease then expires.
                        if g.release().await.is_err() {
                            failed_calls += 1;
                        }
                        break;
                    }
                    Err(Error::HeldElsewhere { .. }) => panic!("a fresh name is free"),
                    Err(e) => {
                        println!("etcd_cluster: {case}: a probe call failed: {e}");
                        failed_calls += 1;
                    }
                }
            }
            let took = answered.unwrap_or_else(|| {
                panic!("no acquisition through another member in {PROBE_TRIES} calls")
            });
            let bound = (target.op_timeout + tol) * PROBE_TRIES as u32;
            assert!(
                took <= bound,
                "the first answer came {took:?} after the freeze (bound {bound:?})"
            );
            failovers.push(took);
            row.detection.push(took);
        }
        // Past a whole TTL after the fault: a lease not renewed meanwhile
        // would be gone.
        sleep_until(fault_at + ttl * 2).await;
        let kept: Vec<bool> = holders.iter().map(|h| h.3.handle.is_held()).collect();
        if pause {
            cluster.resume(victim).expect("SIGCONT the member");
        } else {
            let restarted = tokio::task::block_in_place(|| cluster.restart(victim));
            restarted.expect("the killed member restarts");
        }
        for ((rep, name, resource, mut holder, watch), kept) in holders.into_iter().zip(kept) {
            if kept {
                row.stall.push(watch.stall(fault_at, fault_at + ttl * 2));
                holder
                    .handle
                    .verify()
                    .await
                    .expect("the cluster still has the lease");
                let (released, _, writes) = holder.release(ttl).await;
                released.expect("the holder releases");
                row.writes += writes;
            } else {
                lost += 1;
                let (lost_at, reason) = holder
                    .lost_by(Instant::now() + Duration::from_millis(200))
                    .await
                    .expect("a lease not held was lost");
                println!("etcd_cluster: {case}: a holder lost its lease ({reason:?})");
                row.abort.push(lost_at - fault_at);
                row.stall.push(watch.stall(fault_at, lost_at));
                let (_old, writes) = holder.writes(ttl).await;
                row.writes += writes;
            }
            row.after_deadline += resource.log.after_deadline();
            row.leaked += leak_probe(&rep.locker, &name, &opts).await;
        }
        sleep(ttl).await;
    }
    row.iterations = target.iterations;
    println!(
        "etcd_cluster: {case}: first answer through another member after {failovers:?}; \
         {failed_calls} calls failed closed; {lost} of {} holders lost their lease",
        HOLDERS * target.iterations
    );
    row.finish();
    // Two healthy members of three keep quorum, and a renewal that finds its
    // member frozen or dead goes on at another within its request timeout,
    // well inside the TTL: no holder may lose its lease.
    assert_eq!(lost, 0, "holders lost leases the cluster kept");
    if !pause {
        // A killed member refuses connections: nothing waits on it.
        let slow: Vec<_> = failovers
            .iter()
            .filter(|f| **f > target.op_timeout + tol)
            .collect();
        assert!(
            slow.is_empty(),
            "the client moved to another member only after {slow:?} (request timeout {:?})",
            target.op_timeout
        );
    }
}
