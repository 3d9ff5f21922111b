//! The scheduler at scale: many jobs firing every second on 3 replicas, in
//! per-tick and leader mode. Every (job, tick) inside the measured window
//! must run exactly once; the row shows how late runs started, CPU and the
//! backend calls it took per tick.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use conformance_tests::faulty::{CallKind, FaultyBackend};
use conformance_tests::{BoxError, Ctx};
use lock_core::{Capabilities, LockBackend};
use scheduler::{
    ElectionOptions, Job, Mode as SchedMode, Scheduler, DEFAULT_ELECTION_INTERVAL,
    DEFAULT_ELECTION_TTL, DEFAULT_JOB_TTL,
};
use tokio::time::Instant;

use crate::floors::FloorSource;
use crate::measures::{cpu_time, run_queue_wait};
use crate::report::Row;
use crate::sched_tally::{CountingTicks, Ended, Started, Tally};
use crate::server_work::ServerWork;
use crate::Mode;

/// How long each replica's shutdown may take before its runs are aborted.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// How long one measurement may take beyond its window: an election,
/// shutdowns and connections, with room to spare.
const TIME_BOUND_SLACK: Duration = Duration::from_secs(120);

/// The longest window `--sched-seconds` takes: an hour, so the measurement's
/// time bound stays an hour and two minutes at most.
const MAX_SECONDS: u64 = 3_600;

/// Which scheduler rows to measure and for how long, from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Shape {
    /// `--sched-seconds N`: the full run's length instead of 60 s, for a
    /// window long enough that one bad second does not set its p99.
    seconds: Option<u64>,
    /// `--sched-mode per-tick` or `leader`: that mode's row alone.
    leader: Option<bool>,
}

impl Shape {
    /// Reads `--sched-seconds` and `--sched-mode` from `args`.
    pub(crate) fn from_args(args: &[String]) -> Result<Self, BoxError> {
        let value = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| args.get(i + 1).map_or("", String::as_str))
        };
        let seconds = match value("--sched-seconds") {
            None => None,
            Some(v) => match v.parse::<u64>() {
                Ok(n) if (3..=MAX_SECONDS).contains(&n) => Some(n),
                _ => {
                    return Err(format!(
                        "--sched-seconds takes whole seconds from 3 to {MAX_SECONDS}, not {v:?}"
                    )
                    .into())
                }
            },
        };
        let leader = match value("--sched-mode") {
            None => None,
            Some("per-tick") => Some(false),
            Some("leader") => Some(true),
            Some(v) => {
                return Err(format!("--sched-mode takes per-tick or leader, not {v:?}").into())
            }
        };
        Ok(Self { seconds, leader })
    }

    /// The modes to measure, per tick first: `false` per tick, `true` leader.
    pub(crate) fn modes(self) -> Vec<bool> {
        match self.leader {
            Some(leader) => vec![leader],
            None => vec![false, true],
        }
    }

    /// The longest one measurement may take: its window, an election,
    /// shutdowns and connections.
    pub(crate) fn time_bound(self) -> Duration {
        Duration::from_secs(self.seconds.unwrap_or(60)) + TIME_BOUND_SLACK
    }
}

/// Replicas per measurement, as the performance target asks.
const REPLICAS: usize = 3;

/// Every second, on the six-field cron.
const EVERY_SECOND: &str = "* * * * * *";

/// The tick lag the full run must stay within, at the 99th percentile.
const LAG_P99_BOUND_MS: f64 = 100.0;

/// How many jobs for how long: the target's sizes in full, a smoke run in
/// short mode (a debug build on a loaded CI machine, whose whole short
/// bench must stay well under 2 minutes: one whole second is measured).
fn size(backend: &str, mode: Mode, shape: Shape) -> (usize, u64) {
    let seconds = shape.seconds.unwrap_or(60);
    match mode {
        Mode::Short => (20, 3),
        Mode::Full if backend.starts_with("etcd") => (100, seconds),
        Mode::Full => (1_000, seconds),
    }
}

/// What every replica's handlers and outcome hooks saw.
#[derive(Debug, Default)]
struct Logs {
    started: Mutex<Vec<Started>>,
    ended: Mutex<Vec<Ended>>,
}

/// One replica under measurement, and its call counters.
struct Replica {
    scheduler: Scheduler,
    calls: FaultyBackend,
    ticks: CountingTicks,
}

/// Backend calls so far over every replica: lock calls by kind (acquire,
/// renew, release, other) and tick-store calls.
fn calls_now(replicas: &[Replica]) -> [u64; 5] {
    let mut out = [0; 5];
    for r in replicas {
        out[0] += r.calls.calls_of(CallKind::Acquire);
        out[1] += r.calls.calls_of(CallKind::Renew);
        out[2] += r.calls.calls_of(CallKind::Release);
        out[3] += r.calls.calls_of(CallKind::Check) + r.calls.calls_of(CallKind::Subscribe);
        out[4] += r.ticks.calls();
    }
    out
}

/// `ttl` within what the backend allows (Postgres' test profile caps it).
fn allowed(caps: &Capabilities, ttl: Duration) -> Duration {
    let ttl = ttl.max(caps.min_ttl);
    caps.max_ttl.map_or(ttl, |max| ttl.min(max))
}

/// Starts one replica over `backend` (its own connections) and a tick store
/// of its own, with `jobs` jobs that record every run into `logs`.
async fn start_replica(
    ctx: &Ctx,
    backend: Arc<dyn LockBackend>,
    index: usize,
    jobs: &[String],
    mode: &SchedMode,
    logs: &Arc<Logs>,
) -> Result<Replica, BoxError> {
    let job_ttl = allowed(&backend.capabilities(), DEFAULT_JOB_TTL);
    let calls = FaultyBackend::new(backend, Duration::ZERO);
    let locker = ctx.replica_over(Arc::new(calls.clone())).locker;
    let store = ctx
        .factory()
        .tick_store()
        .await?
        .ok_or("this backend has no tick store")?;
    let ticks = CountingTicks::new(store);
    let registry = prometheus::Registry::new();
    let ended = Arc::clone(logs);
    let mut builder = Scheduler::builder(locker, Arc::new(ticks.clone()))
        .with_mode(mode.clone())
        .with_registry(&registry)
        .with_on_outcome(move |report| {
            if let Ok(mut log) = ended.ended.lock() {
                log.push(Ended {
                    job: report.job.clone(),
                    tick_ms: report.scheduled.timestamp_millis(),
                    replica: index,
                    outcome: report.outcome,
                });
            }
        });
    for (job, name) in jobs.iter().enumerate() {
        let logs = Arc::clone(logs);
        builder = builder.with_job(
            Job::new(name.clone(), EVERY_SECOND, move |run| {
                let started = Started {
                    job,
                    tick: run.scheduled_at(),
                    replica: index,
                    at: Utc::now(),
                };
                if let Ok(mut log) = logs.started.lock() {
                    log.push(started);
                }
                async { Ok(()) }
            })
            .with_ttl(job_ttl),
        );
    }
    let scheduler = builder.start()?;
    Ok(Replica {
        scheduler,
        calls,
        ticks,
    })
}

/// Waits until `replica` leads, up to `limit`.
async fn leads(replica: &Replica, limit: Duration) -> Result<(), BoxError> {
    let mut rx = replica.scheduler.leadership();
    tokio::time::timeout(limit, rx.wait_for(|l| *l))
        .await
        .map_err(|_| "no replica became leader in time")??;
    Ok(())
}

/// One row: the scheduler at scale on `ctx`'s backend, in leader mode if
/// `leader`, else per tick. A duplicate run always fails the row; a missed
/// tick or a lag p99 over 100 ms fails it in full mode only.
pub(crate) async fn at_scale(
    ctx: &Ctx,
    source: &FloorSource,
    leader: bool,
    mode: Mode,
    shape: Shape,
) -> Result<Row, BoxError> {
    let backend = ctx.factory().name().to_owned();
    let server = ServerWork::of(source);
    let server_before = server.read().await?;
    let (jobs, seconds) = size(&backend, mode, shape);
    let kind = if leader { "leader" } else { "per-tick" };
    // A service's defaults, where the backend allows them: the suite's short
    // TTLs would measure leases lapsing under a starved CPU, not the
    // scheduler as deployed.
    let mut backends = Vec::with_capacity(REPLICAS);
    for _ in 0..REPLICAS {
        backends.push(ctx.factory().replica().await?);
    }
    // The backend's limits, not the factory's: Postgres' test profile caps
    // TTLs on the backend it builds.
    let caps = backends
        .first()
        .map(|b| b.capabilities())
        .ok_or("no replica")?;
    let election_ttl = allowed(&caps, DEFAULT_ELECTION_TTL);
    let sched_mode = if leader {
        SchedMode::Leader(
            ElectionOptions::new()
                .with_name(ctx.name(&format!("sched-{kind}-leader")).as_str())
                .with_ttl(election_ttl)
                .with_interval(DEFAULT_ELECTION_INTERVAL.min(election_ttl / 3)),
        )
    } else {
        SchedMode::PerTick
    };
    let names: Vec<String> = (0..jobs)
        .map(|j| ctx.name(&format!("sched-{kind}-{j}")).as_str().to_owned())
        .collect();
    let logs = Arc::new(Logs::default());
    let mut replicas = Vec::with_capacity(REPLICAS);
    for (index, backend) in backends.into_iter().enumerate() {
        let replica = start_replica(ctx, backend, index, &names, &sched_mode, &logs).await?;
        if leader && index == 0 {
            // One leader before the others start, so the window is not cut
            // by a first election.
            leads(&replica, election_ttl * 4 + Duration::from_secs(1)).await?;
        }
        replicas.push(replica);
    }
    // The first and last second are cut by the start and the shutdown.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (from, calls_from, cpu_from, wait_from, wall_from) = (
        Utc::now(),
        calls_now(&replicas),
        cpu_time(),
        run_queue_wait(),
        Instant::now(),
    );
    tokio::time::sleep(Duration::from_secs(seconds.saturating_sub(2))).await;
    let (until, calls_until, cpu_until, wait_until, wall) = (
        Utc::now(),
        calls_now(&replicas),
        cpu_time(),
        run_queue_wait(),
        wall_from.elapsed(),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    // All at once: a replica still running while another stops would keep
    // firing ticks nobody counts.
    let stopping: Vec<_> = replicas
        .into_iter()
        .map(|r| tokio::spawn(r.scheduler.shutdown(SHUTDOWN_DEADLINE)))
        .collect();
    let mut stop_errors = Vec::new();
    for s in stopping {
        if let Err(e) = s.await? {
            stop_errors.push(e.to_string());
        }
    }
    let server_after = server.read_after(&server_before).await?;
    server.clear_ticks(&names).await?;
    let runs = logs.started.lock().map(|l| l.clone()).unwrap_or_default();
    // Every tick the run fired, the first and last second's included: the
    // server's counters cover the whole run.
    let ticks_run = runs
        .iter()
        .map(|r| (r.job, r.tick))
        .collect::<std::collections::HashSet<_>>()
        .len();
    let server_figures = server.per_tick(&server_before, &server_after, ticks_run, REPLICAS);
    let ended = logs.ended.lock().map(|l| l.clone()).unwrap_or_default();
    let tally = Tally::of(&runs, &ended, &names, from, until);
    let mut calls = [0.0; 5];
    for (c, (a, b)) in calls.iter_mut().zip(calls_from.iter().zip(calls_until)) {
        *c = b.saturating_sub(*a) as f64 / (jobs as f64 * wall.as_secs_f64() * REPLICAS as f64);
    }
    let cpu = cpu_until.saturating_sub(cpu_from).as_secs_f64() / wall.as_secs_f64();
    let waited = wait_until.saturating_sub(wait_from).as_secs_f64() / wall.as_secs_f64();
    let mut failures = failures(&tally, mode);
    failures.extend(stop_errors.into_iter().map(|e| format!("shutdown: {e}")));
    let setting = format!(
        "{jobs} jobs every second on {REPLICAS} replicas, {seconds} s (window {} s); tick ttl {} ms{}; fails on duplicates{}",
        (until - from).num_seconds(),
        allowed(&caps, DEFAULT_JOB_TTL).as_millis(),
        if leader {
            format!(", election ttl {} ms", election_ttl.as_millis())
        } else {
            String::new()
        },
        match mode {
            Mode::Short => " only (short run: misses and lag reported)",
            Mode::Full => ", misses, lag p99 > 100 ms",
        }
    );
    let measure = format!("scheduler {kind}");
    let row = if failures.is_empty() {
        Row::new(&backend, &measure, setting)
    } else {
        Row::new(
            &backend,
            "FAILED",
            format!("{measure}: {}; {setting}", failures.join(", ")),
        )
    };
    let row = row
        .figure("jobs", jobs.to_string())
        .figure("replicas", REPLICAS.to_string())
        .figure("seconds", seconds.to_string())
        .figure("ticks expected", tally.expected.to_string())
        .figure("ran", tally.ran.to_string())
        .figure("duplicates", tally.duplicates.to_string())
        .figure("missed", tally.missed.to_string())
        .figure("2+ successes", tally.double_success.to_string())
        .figure("aborted", tally.aborted.to_string())
        .figure("lag p50 ms", format!("{:.1}", tally.lag_ms(50.0)))
        .figure("lag p99 ms", format!("{:.1}", tally.lag_ms(99.0)))
        .figure("lag max ms", format!("{:.1}", tally.lag_ms(100.0)))
        .figure(
            "seconds p99 > 100 ms",
            format!(
                "{}/{}",
                tally.seconds_over(LAG_P99_BOUND_MS),
                tally.seconds()
            ),
        )
        .figure(
            "per-second p99 p50/p90 ms",
            format!(
                "{:.1}/{:.1}",
                tally.second_p99_ms(50.0),
                tally.second_p99_ms(90.0)
            ),
        )
        .figure(
            "cpu %/replica",
            format!("{:.1}", 100.0 * cpu / REPLICAS as f64),
        )
        .figure("run-queue wait %", format!("{:.1}", 100.0 * waited))
        .figure(
            "calls/tick/replica",
            format!("{:.2}", calls.iter().sum::<f64>()),
        )
        .figure(
            "acq/renew/rel/other/store",
            calls
                .iter()
                .map(|c| format!("{c:.2}"))
                .collect::<Vec<_>>()
                .join("/"),
        );
    let row = server_figures
        .into_iter()
        .fold(row, |row, (name, value)| row.figure(name, value));
    Ok(row)
}

/// Why the row fails, if it does.
fn failures(tally: &Tally, mode: Mode) -> Vec<String> {
    let mut out = Vec::new();
    if tally.duplicates > 0 {
        out.push(format!(
            "{} ticks ran more than once ({})",
            tally.duplicates,
            tally.example.as_deref().unwrap_or("")
        ));
    }
    if mode == Mode::Full {
        if tally.missed > 0 {
            out.push(format!("{} ticks never ran", tally.missed));
        }
        let p99 = tally.lag_ms(99.0);
        if p99 > LAG_P99_BOUND_MS {
            out.push(format!("lag p99 {p99:.1} ms over {LAG_P99_BOUND_MS:.0} ms"));
        }
    }
    out
}
