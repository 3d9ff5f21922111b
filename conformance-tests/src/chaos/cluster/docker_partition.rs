//! The raft leader cut off from its peers between hosts (the `docker`
//! feature): a 3-member etcd cluster in containers, the leader taken off the
//! raft network with `docker network disconnect` while holders renew and
//! waiters wait. Its clients still reach it, as in the nftables-based
//! minority partition, and it must grant nothing.
//!
//! An isolated leader still answers lease keep-alives until its
//! check-quorum timeout steps it down, and the new leader extends every
//! lease by its full TTL when it is elected; so a holder either keeps its
//! lease through the new leader or aborts by its local deadline, nobody else
//! acquires before the holder let go, and no write is accepted under its
//! token afterwards.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use tokio::time::{sleep, sleep_until, Instant};

use super::leader::{settle_all, start_pairs, HOLDERS};
use crate::backends::docker_cluster::{DockerEtcdCluster, DockerEtcdClusterFactory};
use crate::backends::etcd::server;
use crate::chaos::case_timing;
use crate::chaos::cases::{refused_during_fault, Target};
use crate::chaos::figures::{self, Row};
use crate::harness::docker;
use crate::Ctx;

/// How long the majority may take to elect a new leader.
const ELECTION_WITHIN: Duration = Duration::from_secs(10);

/// Smoke iterations; `CHAOS_SOAK` multiplies them.
const SMOKE_ITERATIONS: usize = 2;

const CASE: &str = "chaos_leader_partition";

/// The trial, `docker_etcd_cluster::chaos_leader_partition`. A missing
/// engine or image fails it under `DISTLOCK_REQUIRE_DOCKER=1` and skips it
/// loudly elsewhere.
pub(in crate::chaos) fn trials(run_id: &str) -> Vec<Trial> {
    let target = Target {
        op_timeout: Duration::from_secs(1),
        iterations: figures::iterations(SMOKE_ITERATIONS),
        scheme: "etcd",
    };
    let run_id = run_id.to_owned();
    super::docker_trial("docker_etcd_cluster", CASE, docker::Kind::Etcd, move || {
        run(&run_id, target)
    })
}

fn run(run_id: &str, target: Target) -> Result<(), Failed> {
    let factory = Arc::new(DockerEtcdClusterFactory::default());
    let cluster = Arc::clone(
        factory
            .cluster()
            .map_err(|e| Failed::from(format!("no cluster: {e}")))?,
    );
    let handle = Arc::clone(&cluster);
    let outcome = crate::chaos::run_on(factory, run_id, CASE, move |ctx| {
        leader_partition(ctx, handle, target)
    });
    // The containers and networks go with the last handle, a failed case
    // included.
    drop(cluster);
    outcome
}

/// Cuts the leader off once per iteration with [`HOLDERS`] holders and
/// their waiters, then heals it.
async fn leader_partition(ctx: Ctx, cluster: Arc<DockerEtcdCluster>, target: Target) {
    let (ttl, tol, opts) = case_timing(&ctx);
    let mut row = Row::of(&ctx, CASE);
    let (mut kept, mut lost, mut elections) = (0, 0, Vec::new());
    for i in 0..target.iterations {
        let pairs = start_pairs(&ctx, &format!("leader-partition-{i}"), &opts, ttl).await;
        let leader = cluster
            .wait_leader(None, ELECTION_WITHIN)
            .await
            .expect("the cluster has a leader");
        // A client pinned to the leader, connected while it is healthy.
        let builder = cluster.builder_over(&[leader]).expect("a builder");
        let pinned = server::connect_when_ready(builder)
            .await
            .expect("connects to the leader");
        let pinned = ctx.replica_over(Arc::new(pinned));
        sleep(ttl).await;
        let fault_at = Instant::now();
        tokio::task::block_in_place(|| cluster.cut(leader)).expect("docker cuts the leader off");
        row.faults += 1;
        let next = cluster
            .wait_leader(Some(leader), ELECTION_WITHIN)
            .await
            .expect("the majority elects a leader");
        elections.push(fault_at.elapsed());
        // The cut-off member commits nothing: no grant through it.
        let probe = ctx.name(&format!("leader-partition-probe-{i}"));
        let refused = format!("the cut-off old leader granted {probe:?} without a quorum");
        let took = refused_during_fault(&mut row, &pinned, &probe, &opts, &refused).await;
        assert!(
            took <= target.op_timeout * 2 + tol,
            "a call through the cut-off member blocked {took:?}"
        );
        // Past a whole TTL after the fault: a holder whose renewals have not
        // come through by now has lost its lease.
        sleep_until(fault_at + ttl * 2).await;
        let held = settle_all(pairs, &mut row, fault_at, &opts, ttl).await;
        (kept, lost) = (kept + held, lost + HOLDERS - held);
        tokio::task::block_in_place(|| cluster.heal(leader)).expect("docker reconnects the member");
        println!(
            "docker_etcd_cluster: leader m{leader} cut off, m{next} elected after {:?}",
            elections.last().copied().unwrap_or_default()
        );
        // The healed member catches up before the next fault.
        cluster
            .wait_leader(None, ELECTION_WITHIN)
            .await
            .expect("a leader after healing");
        sleep(ttl).await;
    }
    row.iterations = target.iterations;
    println!(
        "docker_etcd_cluster: leader partition: {kept} holders kept their lease, {lost} lost it; elections {elections:?}; max abort allowed {:?}",
        ttl + tol
    );
    row.finish();
}
