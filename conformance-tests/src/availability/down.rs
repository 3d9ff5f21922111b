//! A server that is down when the service starts: the service starts, skips
//! ticks as `unavailable`, and runs the next tick once the server is back.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::AcquireOutcome;
use prometheus::Registry;
use scheduler::{ElectionOptions, Job, LockMode, Mode, Policy, RunReport, Scheduler, TickOutcome};
use tokio::time::Instant;

use super::servers::{Kind, Private};
use crate::harness::ServerProcess;
use crate::BoxError;

/// How long a start against a stopped server may take (one refused connect).
const START_BOUND: Duration = Duration::from_secs(10);
/// How long the first skipped tick (or failed campaign) may take to show.
const DOWN_BOUND: Duration = Duration::from_secs(10);
/// How long after the server listens again a tick must have run: a tick a
/// second, the reconnect, and slack for a loaded machine.
pub(super) const UP_BOUND: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(50);
const OUTCOMES: [AcquireOutcome; 5] = [
    AcquireOutcome::Acquired,
    AcquireOutcome::HeldElsewhere,
    AcquireOutcome::HeldLocally,
    AcquireOutcome::Unavailable,
    AcquireOutcome::Error,
];

/// The time from the server listening again to the first tick run, in
/// per-tick and in leader mode.
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    /// Per-tick mode.
    pub per_tick: Duration,
    /// Leader mode.
    pub leader: Duration,
}

/// Runs both modes against a private server of `kind` that is stopped at
/// start and started again later.
///
/// # Errors
///
/// What went wrong, if the service did not start, did not skip while the
/// server was down, or did not run a tick within 15 s of its return.
pub fn down_at_start(kind: Kind) -> Result<Recovery, BoxError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (private, url) = Private::start(kind)?;
    let server = private.process()?;
    if kind == Kind::Etcd {
        // A member killed before it finished bootstrapping can restart
        // unable to commit anything; the cluster a service meets was up
        // once, so let it come up fully before it goes down.
        let builder = crate::backends::etcd::server::builder(server.port());
        drop(rt.block_on(crate::backends::etcd::server::connect_when_ready(builder))?);
    }
    let per_tick = rt.block_on(phase(kind, server, &url, false))?;
    let leader = rt.block_on(phase(kind, server, &url, true))?;
    Ok(Recovery { per_tick, leader })
}

type Reports = Arc<Mutex<Vec<(Instant, RunReport)>>>;

fn ran(reports: &Reports) -> Option<Instant> {
    reports
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .find(|(_, r)| r.outcome == TickOutcome::Success)
        .map(|(at, _)| *at)
}

fn skipped(reports: &Reports) -> usize {
    reports
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .filter(|(_, r)| r.outcome == TickOutcome::Skipped)
        .count()
}

/// Polls `done` until it holds or `within` passes.
async fn until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    let most = within.as_millis() / POLL.as_millis() + 1;
    for _ in 0..most {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    done()
}

/// What the job's attempts were counted as, and what a direct check of the
/// backend answers now, for a failure message.
async fn diagnose(
    backend: &scheduler::Backend,
    metrics: &lock_core::LockMetrics,
    job: &str,
    reports: &Reports,
) -> String {
    let counted: Vec<(AcquireOutcome, u64)> = OUTCOMES
        .iter()
        .map(|o| (*o, metrics.acquisitions(job, *o)))
        .collect();
    let probe = match (
        backend.lock_backend(),
        lock_core::LockName::new("avail/probe"),
        lock_core::OwnerToken::generate(),
    ) {
        (Some(b), Ok(name), Ok(owner)) => {
            // A few checks apart: one that only finds an attempt under way
            // says less than the next attempt's own error.
            let mut answers = Vec::new();
            for _ in 0..3 {
                answers.push(match b.check(&name, &owner).await {
                    Ok(status) => format!("{status:?}"),
                    Err(e) => e.to_string(),
                });
                tokio::time::sleep(Duration::from_millis(1_100)).await;
            }
            answers.join(" | ")
        }
        _ => "not possible".into(),
    };
    format!(
        "the job's acquisitions: {counted:?}; {} ticks skipped; checks now: {probe}",
        skipped(reports)
    )
}

async fn phase(
    kind: Kind,
    server: &ServerProcess,
    url: &str,
    leader: bool,
) -> Result<Duration, BoxError> {
    let what = format!(
        "{} ({})",
        kind.name(),
        if leader { "leader" } else { "per tick" }
    );
    server.kill()?;
    // Required, so a policy that quietly fell back to unlocked fails here.
    let policy = Policy::from_vars(Some(url), Some("true"))?;
    let backend = tokio::time::timeout(START_BOUND, policy.connect())
        .await
        .map_err(|_| {
            format!("{what}: starting against a stopped server took over {START_BOUND:?}")
        })?
        .map_err(|e| format!("{what}: refused to start while the server is down: {e}"))?;
    if backend.mode() != LockMode::Locked {
        return Err(format!(
            "{what}: a URL was set, yet the backend is {:?}",
            backend.mode()
        )
        .into());
    }
    let registry = Registry::new();
    let locker = backend.locker(&registry)?;
    let job = format!(
        "avail/{}-{}",
        kind.name(),
        if leader { "leader" } else { "tick" }
    );
    let election = format!("{job}/leader");
    let reports: Reports = Arc::default();
    let hook = Arc::clone(&reports);
    let mut builder = Scheduler::builder(locker.clone(), backend.tick_store())
        .with_registry(&registry)
        .with_job(
            Job::new(job.as_str(), "* * * * * *", |_| async { Ok(()) })
                .with_ttl(Duration::from_secs(3)),
        )
        .with_on_outcome(move |r| {
            hook.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((Instant::now(), r.clone()));
        });
    if leader {
        let options = ElectionOptions::new()
            .with_name(election.as_str())
            .with_ttl(Duration::from_secs(3))
            .with_interval(Duration::from_millis(300));
        builder = builder.with_mode(Mode::Leader(options));
    }
    let scheduler = builder.build()?;
    let scheduler = scheduler.start()?;

    let metrics = locker.metrics();
    let down_seen = if leader {
        // The campaign keeps trying while the server is down.
        until(DOWN_BOUND, || {
            metrics.acquisitions(&election, AcquireOutcome::Unavailable) >= 2
        })
        .await
    } else {
        until(DOWN_BOUND, || {
            metrics.acquisitions(&job, AcquireOutcome::Unavailable) >= 1 && skipped(&reports) >= 1
        })
        .await
    };
    let result = async {
        if !down_seen {
            return Err(format!(
                "{what}: no attempt was counted `unavailable` within {DOWN_BOUND:?} of the start"
            ));
        }
        if ran(&reports).is_some() {
            return Err(format!("{what}: a tick ran while the server was down"));
        }
        if leader && scheduler.is_leader() {
            return Err(format!("{what}: elected while the server was down"));
        }
        tokio::task::block_in_place(|| server.restart())
            .map_err(|e| format!("{what}: restarting the server: {e}"))?;
        let up = Instant::now();
        if !until(UP_BOUND, || ran(&reports).is_some()).await {
            let log = std::fs::read_to_string(server.dir().join("server.log")).unwrap_or_default();
            let tail: String = log
                .chars()
                .rev()
                .take(2_000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(format!(
                "{what}: no tick ran within {UP_BOUND:?} of the server listening again; {}; \
                 the server's log ends with:\n{tail}",
                diagnose(&backend, metrics, &job, &reports).await
            ));
        }
        Ok(ran(&reports).map_or(Duration::ZERO, |at| at.saturating_duration_since(up)))
    }
    .await;
    let stopped = scheduler.shutdown(Duration::from_secs(5)).await;
    let took = result?;
    stopped?;
    Ok(took)
}
