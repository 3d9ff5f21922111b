//! `etcd_cluster::frozen_member_is_passed_over`: with one follower of a
//! private 3-member cluster frozen (SIGSTOP), consecutive calls through
//! clients connected to all three members all succeed, and a lock held
//! across the freeze keeps its lease. Its own cluster, since it freezes a
//! member under the feet of whatever else would share one.
//!
//! This is the routing problem the fault suite's `chaos_member_pause` first
//! showed: etcd-client's balanced channel kept sending calls to the frozen
//! member, whose sockets stay open, and runs of four failed calls in a row
//! were seen.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::{LockName, LockOptions, Locker};
use tokio::time::{sleep, Instant};

use super::cluster::{EtcdCluster, MEMBERS};
use super::{server, TTL};
use crate::harness::run_bounded;
use crate::Suite;

/// Clients, each with its own connections and its own first member, so
/// that some start on the member that freezes.
const CLIENTS: usize = 3;

/// Consecutive acquire-and-release cycles per client while a member is frozen.
const CALLS: usize = 10;

/// The request timeout the cluster's builder sets.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

/// Slack for a loaded 2-core machine on top of a call's own bound.
const TOLERANCE: Duration = Duration::from_millis(900);

/// Longest the trial may run: a cluster start, two freezes of 2 × TTL, calls.
const TRIAL_TIMEOUT: Duration = Duration::from_secs(120);

/// Adds the trial; a missing `etcd` fails it under `CI=true`, as elsewhere.
pub fn add_cluster_specific(suite: &mut Suite) {
    if !suite.has_binary("etcd", "etcd_cluster::frozen_member_is_passed_over") {
        return;
    }
    let run_id = suite.run_id().to_owned();
    suite.push(Trial::test(
        "etcd_cluster::frozen_member_is_passed_over",
        move || run(&run_id),
    ));
    super::inspect::add_cluster(suite);
}

fn run(run_id: &str) -> Result<(), Failed> {
    let cluster = Arc::new(EtcdCluster::start().map_err(|e| format!("no cluster: {e}"))?);
    let body = frozen_member_is_passed_over(Arc::clone(&cluster), run_id.to_owned());
    let outcome = run_bounded(body, TRIAL_TIMEOUT);
    cluster.resume_all();
    outcome
}

async fn frozen_member_is_passed_over(
    cluster: Arc<EtcdCluster>,
    run_id: String,
) -> Result<(), Failed> {
    let mut lockers = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let backend = server::connect_when_ready(cluster.builder()?).await?;
        lockers.push(Locker::new(backend)?);
    }
    let opts = LockOptions::new(TTL);
    let name = |what: &str| LockName::new(format!("{run_id}/frozen/{what}"));
    let leader = cluster.wait_leader(None, Duration::from_secs(10)).await?;
    let mut slowest = Duration::ZERO;
    let mut failovers = 0;
    for round in 1..MEMBERS {
        let victim = (leader + round) % MEMBERS;
        // Held across the freeze, renewed every TTL / 3 by each client.
        let mut held = Vec::with_capacity(CLIENTS);
        for (c, locker) in lockers.iter().enumerate() {
            held.push(
                locker
                    .try_lock(&name(&format!("held-{round}-{c}"))?, &opts)
                    .await?,
            );
        }
        let frozen_at = Instant::now();
        cluster.pause(victim)?;
        for (c, locker) in lockers.iter().enumerate() {
            for i in 0..CALLS {
                let probe = name(&format!("probe-{round}-{c}-{i}"))?;
                let at = Instant::now();
                let guard = locker.try_lock(&probe, &opts).await.map_err(|e| {
                    format!("call {i} of client {c} failed with member {victim} frozen: {e}")
                })?;
                guard
                    .release()
                    .await
                    .map_err(|e| format!("release {i} of client {c} failed: {e}"))?;
                let took = at.elapsed();
                slowest = slowest.max(took);
                // An acquire and a release: each may pay half its timeout
                // on the frozen member once before moving on.
                if took > REQUEST_TIMEOUT / 2 {
                    failovers += 1;
                }
                if took > REQUEST_TIMEOUT * 2 + TOLERANCE {
                    return Err(format!("a cycle took {took:?} with one member frozen").into());
                }
            }
        }
        // A whole TTL past the freeze: a lease not renewed meanwhile is gone.
        sleep((frozen_at + TTL * 2).saturating_duration_since(Instant::now())).await;
        let kept = held.iter().filter(|g| g.handle().is_held()).count();
        cluster.resume(victim)?;
        if kept != CLIENTS {
            return Err(format!(
                "{} of {CLIENTS} holders lost their lock with member {victim} frozen",
                CLIENTS - kept
            )
            .into());
        }
        for guard in held {
            guard.release().await?;
        }
        // Let the thawed member catch up before the next one freezes.
        cluster.wait_leader(None, Duration::from_secs(10)).await?;
    }
    println!(
        "etcd_cluster: frozen_member_is_passed_over: {} cycles with a follower frozen, \
         all answered; {failovers} paid a failover; slowest {slowest:?}",
        CLIENTS * CALLS * (MEMBERS - 1)
    );
    Ok(())
}
