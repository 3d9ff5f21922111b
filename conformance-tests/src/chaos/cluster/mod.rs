//! Faults only a cluster has, on a private 3-member etcd cluster with the
//! library connected to all three endpoints: the raft leader killed, the
//! member a client talks to killed or frozen, one member cut off from the
//! other two, and the scheduler with the leader killed every few seconds.
//!
//! Each trial starts its own cluster, since it kills or cuts its members.
//! With the `docker` feature, deployments in containers too: the etcd
//! leader and the Redis Sentinel primary cut off with `docker network
//! disconnect`.

#[cfg(feature = "docker")]
mod docker_partition;
#[cfg(feature = "docker")]
mod docker_sentinel;
mod leader;
mod member;
mod partition;
mod sched;
mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};

use super::{figures, Bins, Target};
use crate::backends::etcd::cluster::EtcdCluster;
use crate::backends::etcd::EtcdClusterFactory;
use crate::harness::{nft, unavailable, which};
use crate::Ctx;

/// The trials on deployments in containers (the `docker` feature): the etcd
/// leader and the Redis primary cut off with `docker network disconnect`.
#[cfg(feature = "docker")]
pub(super) fn docker_trials(run_id: &str) -> Vec<Trial> {
    let mut out = docker_partition::trials(run_id);
    out.extend(docker_sentinel::trials(run_id));
    out
}

/// The trial `row::case` on a deployment in containers of `kind`'s image:
/// `body` when the engine answers and the image is on this machine; else a
/// failing trial under `DISTLOCK_REQUIRE_DOCKER=1`, or none and a loud line
/// on stderr.
#[cfg(feature = "docker")]
fn docker_trial(
    row: &str,
    case: &str,
    kind: crate::harness::docker::Kind,
    body: impl FnOnce() -> Result<(), Failed> + Send + 'static,
) -> Vec<Trial> {
    use crate::harness::docker;
    let name = format!("{row}::{case}");
    if let Err(e) = docker::engine().and_then(|_| docker::ensure_image(kind.image())) {
        if docker::required() {
            let msg = format!("{row}: {e}");
            return vec![Trial::test(name, move || Err(msg.into()))];
        }
        eprintln!("!!! SKIPPING {name}: {e}");
        return Vec::new();
    }
    vec![Trial::test(name, body)]
}

/// A trial's body, given the run id.
type ClusterTrial = Box<dyn FnOnce(&str) -> Result<(), Failed> + Send>;

/// Smoke iterations per case; `CHAOS_SOAK` multiplies them. Each iteration
/// waits out elections and restarts, so fewer than the one-server cases.
const SMOKE_ITERATIONS: usize = 2;

/// The trials, named `etcd_cluster::chaos_<case>`. Missing `etcd` or `nft`
/// fails the run under `CI=true` and is skipped loudly elsewhere.
pub(super) fn trials(run_id: &str, bins: &Bins) -> Vec<Trial> {
    let missing = if which("etcd").is_none() {
        Some("etcd is not on PATH")
    } else if !nft::installed() {
        Some("nft is not installed")
    } else {
        None
    };
    if let Some(why) = missing {
        let why = format!("etcd_cluster: {why}");
        return unavailable("etcd_cluster::chaos_server_available", &why)
            .into_iter()
            .collect();
    }
    let target = Target {
        // The request timeout of the test profile.
        op_timeout: Duration::from_secs(1),
        iterations: figures::iterations(SMOKE_ITERATIONS),
        scheme: "etcd",
    };
    let mut out = Vec::new();
    let mut add = |case: &'static str, trial: ClusterTrial| {
        let run_id = run_id.to_owned();
        out.push(Trial::test(format!("etcd_cluster::{case}"), move || {
            trial(&run_id)
        }));
    };
    add(
        "chaos_leader_kill",
        Box::new(move |id| {
            run(id, "chaos_leader_kill", move |ctx, c| {
                leader::leader_kill(ctx, c, target)
            })
        }),
    );
    for pause in [false, true] {
        let case = if pause {
            "chaos_member_pause"
        } else {
            "chaos_member_kill"
        };
        add(
            case,
            Box::new(move |id| {
                run(id, case, move |ctx, c| {
                    member::member_fault(ctx, c, target, pause)
                })
            }),
        );
    }
    add(
        "chaos_minority_partition",
        Box::new(move |id| {
            run(id, "chaos_minority_partition", move |ctx, c| {
                partition::minority(ctx, c, target)
            })
        }),
    );
    for mode in ["per-tick", "leader"] {
        let case = if mode == "leader" {
            "chaos_scheduler_leader_mode_leader_kills"
        } else {
            "chaos_scheduler_per_tick_leader_kills"
        };
        let replica = bins.replica.clone();
        add(
            case,
            Box::new(move |id| {
                run(id, case, move |ctx, c| async move {
                    sched::leader_kills(ctx, c, target, &replica, mode).await;
                })
            }),
        );
    }
    out
}

/// The member to fault in round `i`: once the cluster has a leader, one of
/// the two followers, the other one each round.
async fn follower_for_round(cluster: &EtcdCluster, i: usize) -> usize {
    let leader = cluster
        .wait_leader(None, Duration::from_secs(10))
        .await
        .expect("the cluster has a leader");
    (leader + 1 + i % 2) % crate::backends::etcd::cluster::MEMBERS
}

/// Runs one case against a fresh cluster; thaws every member afterwards so
/// that a failed case never leaves one frozen.
fn run<F, Fut>(run_id: &str, case: &str, body: F) -> Result<(), Failed>
where
    F: FnOnce(Ctx, Arc<EtcdCluster>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let factory = Arc::new(EtcdClusterFactory::default());
    let cluster = Arc::clone(
        factory
            .cluster()
            .map_err(|e| Failed::from(format!("no cluster: {e}")))?,
    );
    let handle = Arc::clone(&cluster);
    let outcome = super::run_on(factory, run_id, case, move |ctx| body(ctx, handle));
    cluster.resume_all();
    outcome
}
