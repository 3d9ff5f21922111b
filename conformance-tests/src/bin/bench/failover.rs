//! Failover in scheduler leader mode: the leader crashes without releasing;
//! how long until the standby leads, against the bound TTL + one interval.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

use conformance_tests::faulty::{Fault, FaultyBackend};
use conformance_tests::{BoxError, Ctx};
use scheduler::LeaderElection;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::report::Row;
use crate::stats::{ms, Samples};
use crate::Mode;

/// How often a standby tries to become leader.
const INTERVAL: Duration = Duration::from_millis(500);

/// Waits until `rx` says leading, up to `limit`.
async fn leads(rx: &mut watch::Receiver<bool>, limit: Duration) -> Result<(), BoxError> {
    tokio::time::timeout(limit, rx.wait_for(|l| *l))
        .await
        .map_err(|_| "no replica became leader in time")??;
    Ok(())
}

/// A runtime standing for the leader's process; dropping it kills every task
/// at once (and may happen inside async code, unlike dropping a `Runtime`).
struct Process(Option<tokio::runtime::Runtime>);

impl Drop for Process {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Starts a leader on a runtime of its own (its "process") and returns once it
/// leads, with the runtime and its backend's fault switch.
async fn start_leader(
    ctx: &Ctx,
    name: &str,
    ttl: Duration,
) -> Result<(Process, FaultyBackend), BoxError> {
    let process = Process(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?,
    ));
    let handle = process.0.as_ref().ok_or("no runtime")?.handle().clone();
    let (ctx, name) = (ctx.clone(), name.to_owned());
    let (tx, rx) = oneshot::channel();
    handle.spawn(async move {
        let started = async {
            let faulty = FaultyBackend::new(ctx.factory().replica().await?, Duration::ZERO);
            let replica = ctx.replica_over(Arc::new(faulty.clone()));
            let election = LeaderElection::builder(replica.locker, name)
                .with_ttl(ttl)
                .with_interval(INTERVAL)
                .start()?;
            leads(&mut election.subscribe(), ttl * 4).await?;
            Ok::<_, BoxError>((faulty, election))
        };
        match started.await {
            Ok((faulty, election)) => {
                // A crash runs no destructor: the election never releases.
                let _election = ManuallyDrop::new(election);
                let _ = tx.send(Ok(faulty));
                std::future::pending::<()>().await;
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    });
    let faulty = rx.await.map_err(|_| "the leader's runtime ended")??;
    Ok((process, faulty))
}

/// Time from the leader's crash to the standby leading.
pub(crate) async fn failover(ctx: &Ctx, mode: Mode) -> Result<Row, BoxError> {
    let ttl = ctx.timing().ttl;
    let bound = ttl + INTERVAL;
    let runs = match mode {
        Mode::Short => 1,
        Mode::Full => 8,
    };
    let mut samples = Samples::default();
    for run in 0..runs {
        let name = ctx.name(&format!("leader-{run}")).as_str().to_owned();
        let (process, faulty) = start_leader(ctx, &name, ttl).await?;
        let standby = ctx.replica().await;
        let election = LeaderElection::builder(standby.locker.clone(), name)
            .with_ttl(ttl)
            .with_interval(INTERVAL)
            .start()?;
        let mut rx = election.subscribe();
        // Let the standby try (and fail) at least once.
        tokio::time::sleep(INTERVAL + INTERVAL / 2).await;
        if *rx.borrow() {
            return Err("the standby led while the leader was alive".into());
        }
        // The crash: the backend refuses every call, then the whole runtime
        // (heartbeat, connections, Postgres session) is gone at once.
        faulty.set(Fault::Down);
        let crashed = Instant::now();
        drop(process);
        leads(&mut rx, bound * 3).await?;
        samples.push(crashed.elapsed());
        election.stop().await;
    }
    samples.add_wall(Duration::ZERO);
    Ok(Row::new(
        ctx.factory().name(),
        "failover",
        format!(
            "leader crashes (runtime dropped, no release); ttl {} ms + interval {} ms",
            ttl.as_millis(),
            INTERVAL.as_millis()
        ),
    )
    .figure("samples", samples.count().to_string())
    .figure("p50 ms", ms(samples.percentile(50.0)))
    .figure("max ms", ms(samples.max()))
    .figure("bound ms", ms(bound))
    .figure(
        "max/bound",
        format!("{:.2}", samples.max().as_secs_f64() / bound.as_secs_f64()),
    ))
}
