//! The fault suite: real server stalls and partitions against private
//! servers, each case asserting that a fenced resource accepted no stale
//! write and that no guarded write happened after the holder's deadline.
//!
//! Every trial starts its own server, since it freezes or partitions it
//! (the Postgres trials share one: each freezes, cuts or kills only its own
//! sessions). Most trials run one at a time so that their timing bounds do
//! not compete for the CPU; the few that [`may_overlap`] names run two at
//! a time first. Figures go to [`figures::table`].

mod cases;
mod churn;
mod clock;
mod cluster;
mod failover;
pub mod figures;
mod flap;
mod frozen;
mod holder;
mod latency;
mod pause;
mod pg;
mod pg_failover;
mod pg_retain;
mod procs;
mod redis_cluster_lost;
mod redis_cluster_slots;
mod restart;
mod sentinel_failover;
mod sentinel_lost;
mod sentinel_lost_clients;
mod sentinel_sched;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Failed, Trial};

use crate::backends::{etcd, redis};
use crate::harness::{unavailable, which};
use crate::{BackendFactory, BoxError, Ctx};

pub use cases::Target;

/// How many of the trials [`may_overlap`] names run at once by default.
pub const OVERLAP: usize = 2;

/// The trials that may run beside one another, by name. Each has a
/// deployment of its own on ports no other trial is given (see
/// `harness::free_port`), touches nothing host-wide (no nftables rule, no
/// shared server, no other trial's processes), and spends its time waiting
/// for what its servers do (a failover, an election, a fresh deployment)
/// under bounds of seconds, which a second trial's load does not reach.
/// Trials that time the library's own timers to within a few hundred
/// milliseconds (stalls, partitions, clock steps, latency) stay alone, as
/// do the Postgres trials (one server for all) and every trial that cuts
/// traffic with nftables.
const MAY_OVERLAP: &[&str] = &[
    // Safety counted from the tick records; every wait is seconds long.
    "redis::chaos_scheduler_frozen_after_handler_per_tick_at_most_once",
    "redis::chaos_scheduler_frozen_after_handler_leader_at_least_once",
    "etcd::chaos_scheduler_frozen_after_handler_per_tick_at_most_once",
    "etcd::chaos_scheduler_frozen_after_handler_leader_at_least_once",
    // Mostly waits for the sentinels; the tightest bound leaves a 1 s
    // lease's deadline half a second.
    "redis_sentinel::chaos_sentinel_failover",
    "redis_sentinel::chaos_sentinel_failover_acked",
    // The acquire is refused; unlike the unacknowledged case, no bound on
    // when the victim learns of its loss.
    "redis_sentinel::chaos_sentinel_primary_lost_acked",
    // Replica 1 fires the lost tick 10 s late, past any failover here.
    "redis_sentinel::chaos_scheduler_primary_lost",
    "redis_sentinel::chaos_scheduler_primary_lost_acked",
    // Elections; safety asserted, times reported.
    "etcd_cluster::chaos_leader_kill",
    "etcd_cluster::chaos_scheduler_per_tick_leader_kills",
    "etcd_cluster::chaos_scheduler_leader_mode_leader_kills",
    // Containers on networks of their own, cut off with `docker network`.
    "docker_etcd_cluster::chaos_leader_partition",
    "docker_redis_sentinel::chaos_primary_partition",
];

/// Whether the trial `name` may run beside another trial that may: see
/// `MAY_OVERLAP`. Any other trial runs alone.
pub fn may_overlap(name: &str) -> bool {
    MAY_OVERLAP.contains(&name)
}

/// Smoke iterations per case; `CHAOS_SOAK` multiplies them.
const SMOKE_ITERATIONS: usize = 3;

/// Longest one chaos trial may run before it counts as hung, at smoke size
/// (it grows with `CHAOS_SOAK`).
const TRIAL_TIMEOUT: Duration = Duration::from_secs(120);

type MakeFactory = fn(&str) -> Result<Arc<dyn BackendFactory>, BoxError>;

/// A case's body, boxed so that the registration loop can hold any of them.
type Body = Box<dyn FnOnce(Ctx) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A Redis Cluster case over a cluster of its own.
type ClusterCase = fn(
    Ctx,
    Arc<redis::ClusterFactory>,
) -> Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

/// A case's lease TTL, its slack on time bounds, and its lock options.
fn case_timing(ctx: &Ctx) -> (Duration, Duration, lock_core::LockOptions) {
    let timing = ctx.timing();
    (timing.ttl, timing.tolerance, ctx.opts())
}

/// `cmd key` on a plain Redis connection, for commands that answer an
/// integer (`EXISTS`, `PTTL`).
async fn key_int(c: &mut impl ::redis::aio::ConnectionLike, cmd: &str, key: &str) -> i64 {
    ::redis::cmd(cmd)
        .arg(key)
        .query_async(c)
        .await
        .unwrap_or_else(|e| panic!("{cmd} {key}: {e}"))
}

/// `factory`'s cluster, started off the runtime's threads on first use.
async fn cluster_of(
    factory: &Arc<redis::ClusterFactory>,
) -> Result<Arc<redis::cluster::ClusterSet>, BoxError> {
    let f = Arc::clone(factory);
    tokio::task::spawn_blocking(move || f.set().map(Arc::clone)).await?
}

fn redis_prefix(run_id: &str) -> String {
    format!("lock-chaos:{run_id}:")
}

fn redis_factory(run_id: &str) -> Result<Arc<dyn BackendFactory>, BoxError> {
    Ok(Arc::new(redis::private_factory(&redis_prefix(run_id))?))
}

fn etcd_factory(_: &str) -> Result<Arc<dyn BackendFactory>, BoxError> {
    Ok(Arc::new(etcd::EtcdFactory::private()))
}

/// The test package's helper binaries, which cases run as processes.
#[derive(Debug, Clone)]
pub struct Bins {
    /// `chaos-holder`: takes one lock and writes under it.
    pub holder: PathBuf,
    /// `chaos-replica`: one scheduler replica.
    pub replica: PathBuf,
}

/// The chaos trials, named `<backend>::chaos_<case>`, for every backend
/// whose server binary is on `PATH`. A missing binary fails the run under
/// `CI=true` and is skipped loudly elsewhere.
pub fn trials(run_id: &str, bins: &Bins) -> Vec<Trial> {
    let iterations = figures::iterations(SMOKE_ITERATIONS);
    let backends: [(&str, &str, MakeFactory, Duration); 2] = [
        ("redis", "redis-server", redis_factory, redis::OP_TIMEOUT),
        // The request timeout of the etcd test profile.
        ("etcd", "etcd", etcd_factory, Duration::from_secs(1)),
    ];
    let mut out = Vec::new();
    for (backend, binary, make, op_timeout) in backends {
        let target = Target {
            op_timeout,
            iterations,
            scheme: backend,
        };
        if which(binary).is_none() {
            out.extend(unavailable(
                &format!("{backend}::chaos_server_available"),
                &format!("{backend}: {binary} is not on PATH"),
            ));
            continue;
        }
        let mut add = |case: &'static str, body: Body| {
            let run_id = run_id.to_owned();
            out.push(Trial::test(format!("{backend}::{case}"), move || {
                run(make, &run_id, case, body)
            }));
        };
        add(
            "chaos_server_stall",
            Box::new(move |ctx| Box::pin(cases::server_stall(ctx, target))),
        );
        add(
            "chaos_partition",
            Box::new(move |ctx| Box::pin(cases::partition(ctx, target))),
        );
        add(
            "chaos_flap",
            Box::new(move |ctx| Box::pin(flap::flap(ctx, target))),
        );
        let probe = match backend {
            "redis" => latency::Probe::Redis(redis_prefix(run_id)),
            _ => latency::Probe::Etcd,
        };
        add(
            "chaos_latency",
            Box::new(move |ctx| Box::pin(latency::latency(ctx, target, probe))),
        );
        if backend == "redis" {
            let prefix = redis_prefix(run_id);
            add(
                "chaos_failover",
                Box::new(move |ctx| Box::pin(failover::failover(ctx, target, prefix))),
            );
            let prefix = redis_prefix(run_id);
            add(
                "chaos_restart",
                Box::new(move |ctx| Box::pin(restart::restart(ctx, target, prefix))),
            );
        }
        let holder = bins.holder.clone();
        add(
            "chaos_holder_pause",
            Box::new(move |ctx| {
                Box::pin(async move { pause::holder_pause(ctx, target, &holder).await })
            }),
        );
        let holder = bins.holder.clone();
        add(
            "chaos_clock_step_holder",
            Box::new(move |ctx| {
                Box::pin(async move { clock::holder_clock_step(ctx, target, &holder).await })
            }),
        );
        let replica = bins.replica.clone();
        add(
            "chaos_clock_step_scheduler",
            Box::new(move |ctx| {
                Box::pin(async move { clock::scheduler_clock_step(ctx, &replica).await })
            }),
        );
        let replica = bins.replica.clone();
        add(
            "chaos_leader_churn",
            Box::new(move |ctx| {
                Box::pin(async move { churn::leader_churn(ctx, target, &replica).await })
            }),
        );
        for plan in frozen::PLANS {
            let (run_id, replica) = (run_id.to_owned(), bins.replica.clone());
            out.push(
                Trial::test(format!("{backend}::{}", plan.case), move || {
                    run(make, &run_id, plan.case, move |ctx| async move {
                        frozen::frozen_after_handler(ctx, plan, &replica).await;
                    })
                })
                .with_ignored_flag(!plan.included()),
            );
        }
    }
    if which("redis-server").is_some() {
        let target = Target {
            op_timeout: redis::OP_TIMEOUT,
            iterations,
            scheme: "redis+sentinel",
        };
        // Each case also runs with replica acknowledgement: from both
        // replicas for the failover (tokens then survive it), from one where
        // the primary is lost (the victim's lock reached none).
        let both = (2, Duration::from_millis(250));
        for (case, ack) in [
            ("chaos_sentinel_failover", None),
            ("chaos_sentinel_failover_acked", Some(both)),
        ] {
            let id = run_id.to_owned();
            let target = acked_target(target, ack);
            out.push(Trial::test(format!("redis_sentinel::{case}"), move || {
                let mut factory = redis::SentinelFactory::new(&redis_prefix(&id));
                if let Some((n, t)) = ack {
                    factory = factory.with_replica_ack(n, t);
                }
                let factory = Arc::new(factory);
                let body_factory = Arc::clone(&factory);
                run_on(factory, &id, case, move |ctx| {
                    sentinel_failover::sentinel_failover(ctx, target, body_factory)
                })
            }));
        }
        // One fresh deployment per kill: a killed primary would take the
        // sentinels many seconds to turn into a replica again.
        let target = Target {
            iterations: figures::iterations(1),
            ..target
        };
        for (case, ack) in [
            ("chaos_sentinel_primary_lost", None),
            (
                "chaos_sentinel_primary_lost_acked",
                Some(sentinel_lost_clients::ACK),
            ),
        ] {
            let id = run_id.to_owned();
            let target = acked_target(target, ack);
            out.push(Trial::test(format!("redis_sentinel::{case}"), move || {
                let prefix = redis_prefix(&id);
                let factory = Arc::new(redis::SentinelFactory::new(&prefix));
                run_on(factory, &id, case, move |ctx| {
                    sentinel_lost::sentinel_primary_lost(ctx, target, prefix, ack)
                })
            }));
        }
        // The scheduler across the same loss: acknowledgement by both
        // replicas, since a failover may promote either.
        for (case, ack) in [
            ("chaos_scheduler_primary_lost", None),
            ("chaos_scheduler_primary_lost_acked", Some(both)),
        ] {
            let (id, replica) = (run_id.to_owned(), bins.replica.clone());
            out.push(Trial::test(format!("redis_sentinel::{case}"), move || {
                let factory = Arc::new(redis::SentinelFactory::new(&redis_prefix(&id)));
                run_on(factory, &id, case, move |ctx| async move {
                    sentinel_sched::scheduler_primary_lost(ctx, ack, &replica).await;
                })
            }));
        }
    }
    if which("redis-server").is_some() && which("redis-cli").is_some() {
        // A cluster of its own per case, since the cases move a slot or
        // stop a primary.
        let cases = crate::trial_table![(ctx, f) as ClusterCase;
            "chaos_cluster_slot_migration" => redis_cluster_slots::slot_migration,
            "chaos_cluster_primary_lost" => redis_cluster_lost::primary_lost,
        ];
        for (case, body) in cases {
            let id = run_id.to_owned();
            out.push(Trial::test(format!("redis_cluster::{case}"), move || {
                let factory = Arc::new(redis::ClusterFactory::new(&redis_prefix(&id)));
                let body_factory = Arc::clone(&factory);
                run_on(factory, &id, case, move |ctx| async move {
                    if let Err(e) = body(ctx, body_factory).await {
                        panic!("{case}: {e}");
                    }
                })
            }));
        }
    } else {
        out.extend(unavailable(
            "redis_cluster::chaos_server_available",
            "redis_cluster: redis-server or redis-cli is not on PATH",
        ));
    }
    out.extend(cluster::trials(run_id, bins));
    #[cfg(feature = "docker")]
    out.extend(cluster::docker_trials(run_id));
    out.extend(pg::trials(run_id, bins));
    out
}

/// `target` for clients that ask for `ack`: each call may also wait out the
/// acknowledgement timeout.
fn acked_target(target: Target, ack: Option<(u8, Duration)>) -> Target {
    Target {
        op_timeout: target.op_timeout + ack.map_or(Duration::ZERO, |(_, t)| t),
        ..target
    }
}

fn run<F, Fut>(make: MakeFactory, run_id: &str, case: &str, body: F) -> Result<(), Failed>
where
    F: FnOnce(Ctx) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let factory = make(run_id).map_err(|e| Failed::from(format!("no server: {e}")))?;
    run_on(factory, run_id, case, body)
}

/// Runs one case on its own runtime against `factory`'s server.
fn run_on<F, Fut>(
    factory: Arc<dyn BackendFactory>,
    run_id: &str,
    case: &str,
    body: F,
) -> Result<(), Failed>
where
    F: FnOnce(Ctx) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let ctx = Ctx::new(Arc::clone(&factory), run_id, case);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let limit = u32::try_from(figures::iterations(1))
        .ok()
        .and_then(|soak| TRIAL_TIMEOUT.checked_mul(soak))
        .unwrap_or(Duration::MAX);
    let outcome = rt.block_on(async move {
        let task = tokio::spawn(body(ctx));
        match tokio::time::timeout(limit, task).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(panic)) => Err(Failed::from(panic_message(panic))),
            Err(_) => Err(Failed::from(format!(
                "case did not finish within {limit:?}"
            ))),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    // A case that failed while its server was frozen must not leave it so.
    if let Some(server) = factory.server_process() {
        let _ = server.resume();
    }
    outcome
}

fn panic_message(err: tokio::task::JoinError) -> String {
    match err.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panicked".to_owned()),
        Err(e) => e.to_string(),
    }
}
