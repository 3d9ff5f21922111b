//! The scheduler on the cluster with the raft leader killed every few
//! seconds: three `chaos-replica` processes run one every-second job (per
//! tick, or in leader mode) through the cluster URL, and the etcd leader is
//! killed (SIGKILL) and restarted in turn. No scheduled instant may finish
//! twice, no guarded write may land after its deadline or under an older
//! token once a newer run began.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::sleep;

use super::leader::kill_leader;
use crate::backends::etcd::cluster::EtcdCluster;
use crate::chaos::cases::Target;
use crate::chaos::churn::judge;
use crate::chaos::figures::{self, Row};
use crate::chaos::procs::Journal;
use crate::Ctx;

/// Time between two leader kills.
const KILL_EVERY: Duration = Duration::from_secs(3);

/// Scheduler replicas.
const REPLICAS: usize = 3;

/// Runs the replicas in `mode` (`per-tick` or `leader`) while the etcd
/// leader is killed `iterations + 1` times.
pub(super) async fn leader_kills(
    ctx: Ctx,
    cluster: Arc<EtcdCluster>,
    target: Target,
    replica: &Path,
    mode: &str,
) {
    let ttl = ctx.timing().ttl;
    let faults = target.iterations + 1;
    let per_fault = KILL_EVERY + Duration::from_secs(15);
    let run_for = per_fault * (u32::try_from(faults).unwrap_or(8) + 2);
    let args = vec![
        cluster.url(),
        mode.to_owned(),
        ttl.as_millis().to_string(),
        ttl.as_millis().to_string(),
        run_for.as_millis().to_string(),
    ];
    let (journal, _feed) = Journal::new();
    let mut children: Vec<_> = (0..REPLICAS)
        .map(|w| journal.spawn(w, replica, &args, None))
        .collect();
    let case = format!("chaos_scheduler_{}_leader_kills", mode.replace('-', "_"));
    let mut row = Row {
        backend: ctx.factory().name().to_owned(),
        case,
        iterations: faults,
        ..Row::default()
    };
    journal.wait_first_run().await;
    // Per fault, how long the job could not run: the election, then up
    // to two TTLs for a lease on the dead leader's requests to lapse.
    let mut outages = Vec::new();
    for _ in 0..faults {
        sleep(KILL_EVERY).await;
        let (leader, fault_at) = kill_leader(&cluster, &mut row).await;
        cluster
            .wait_leader(Some(leader), Duration::from_secs(10))
            .await
            .expect("the survivors elect a leader");
        let election = fault_at.elapsed();
        row.detection.push(election);
        outages.push(election + ttl * 2);
        let restarted = tokio::task::block_in_place(|| cluster.restart(leader));
        restarted.expect("the killed member restarts");
    }
    // Let the runs under way finish, then stop everyone.
    sleep(ttl * 2).await;
    for child in &mut children {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    journal.drained(Duration::from_secs(5)).await;
    let lines = journal.lines();
    let verdict = judge(&lines, &outages, &mut row);
    figures::record_verdict(row, &verdict, mode);
}
