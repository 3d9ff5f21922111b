//! `lockrun cron`: the entries of a cron file, each tick once across every
//! runner started with the same file and backend.

mod file;
mod job;

use std::sync::Arc;
use std::time::Duration;

use distlock::scheduler::{ElectionOptions, Error as SchedulerError, Mode, Scheduler};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

use crate::cli::CronArgs;
use crate::exit::Failure;
use crate::keeper::Keeper;
use crate::reaper::Reaper;
use crate::supervise::KillTiming;
use crate::{backend, telemetry};

/// How long queued releases get once the schedulers have stopped.
const LOCKER_SHUTDOWN: Duration = Duration::from_secs(5);

/// Runs `lockrun cron` with the runner's reaper and watchdog; returns the
/// runner's exit code.
pub(crate) async fn run(
    args: CronArgs,
    reaper: Reaper,
    keeper: Arc<Keeper>,
) -> Result<u8, Failure> {
    let path = args.file.display().to_string();
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| Failure::usage(format!("cannot read the cron file {path}: {e}")))?;
    let entries = file::parse(&text).map_err(|e| Failure::usage(format!("{path}: {e}")))?;
    if entries.is_empty() {
        return Err(Failure::usage(format!("{path}: no entries")));
    }
    let mut timings = Vec::with_capacity(entries.len());
    for entry in &entries {
        let timing = KillTiming::for_ttl(entry.ttl, args.common.kill_grace)
            .map_err(|e| Failure::usage(format!("{path}: line {}: {e}", entry.line)))?;
        timings.push(timing);
    }
    let (mut int, mut term) = (
        signal(SignalKind::interrupt()).map_err(|e| Failure::internal(e.to_string()))?,
        signal(SignalKind::terminate()).map_err(|e| Failure::internal(e.to_string()))?,
    );
    let metrics = telemetry::serve_metrics(args.common.metrics_addr).await?;
    let locks = backend::connect(args.common.backend.as_deref()).await?;
    let locker = locks
        .locker()
        .map_err(|e| Failure::from_lock(&e, crate::exit::UNAVAILABLE))?;

    let mut per_tick = Scheduler::builder(locker.clone(), locks.tick_store())
        .with_mode(Mode::PerTick)
        .with_skew_tolerance(args.skew_tolerance);
    let mut leader = Scheduler::builder(locker.clone(), locks.tick_store())
        .with_mode(Mode::Leader(
            ElectionOptions::new()
                .with_name(args.election_name.clone())
                .with_ttl(args.election_ttl)
                .with_interval(args.election_interval),
        ))
        .with_skew_tolerance(args.skew_tolerance);
    let (mut any_per_tick, mut any_leader) = (false, false);
    for (entry, timing) in entries.iter().zip(timings) {
        let job = job::job(entry, timing, &reaper, &keeper);
        if entry.leader {
            any_leader = true;
            leader = leader.with_job(job);
        } else {
            any_per_tick = true;
            per_tick = per_tick.with_job(job);
        }
    }
    let start_error = |e: SchedulerError| {
        let job = match &e {
            SchedulerError::InvalidJob { job, .. }
            | SchedulerError::InvalidCron { job, .. }
            | SchedulerError::InvalidTimeZone { job, .. } => Some(job.as_str()),
            _ => None,
        };
        match job.and_then(|j| entries.iter().find(|en| en.name == j)) {
            Some(entry) => Failure::usage(format!("{path}: line {}: {e}", entry.line)),
            None => Failure::usage(format!("{path}: {e}")),
        }
    };
    let mut schedulers = Vec::new();
    if any_per_tick {
        schedulers.push(per_tick.start().map_err(start_error)?);
    }
    if any_leader {
        schedulers.push(leader.start().map_err(start_error)?);
    }
    info!(entries = entries.len(), "cron started");

    tokio::select! {
        _ = int.recv() => info!("SIGINT: stopping"),
        _ = term.recv() => info!("SIGTERM: stopping"),
    }
    for scheduler in schedulers {
        if let Err(e) = scheduler.shutdown(args.shutdown_timeout).await {
            warn!(error = %e, "the scheduler did not stop cleanly");
        }
    }
    if let Err(e) = locker.shutdown(LOCKER_SHUTDOWN).await {
        warn!(error = %e, "lock shutdown did not finish");
    }
    if let Some(m) = metrics {
        m.shutdown().await;
    }
    info!("stopped");
    Ok(0)
}
