//! Three replicas of one service run a 2-second cron job, first in per-tick
//! mode, then in leader mode; midway the replica doing the work is killed
//! (its connection cut and its scheduler dropped, nothing released). One
//! replica's clock runs 2 s ahead. The table shows which replica ran each
//! tick; the summary counts duplicates and missed ticks from what ran.
//!
//! ```sh
//! cargo run -p scheduler --example replicas                      # in-process memory backend
//! cargo run -p scheduler --example replicas -- --backend URL     # a real server, e.g. redis://127.0.0.1:6379
//! ```
//!
//! With `--backend`, every replica connects separately through
//! `scheduler::connect(URL)`, so several processes started with the same URL
//! coordinate through the server (each prints what it saw itself).

mod report;
mod severable;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use lock_core::Locker;
use prometheus::Registry;
use scheduler::{ElectionOptions, Job, MissedTicks, Mode, Scheduler, TokioClock};
use tokio::time::{sleep, Instant};
use tracing_subscriber::EnvFilter;

use report::Journal;
use severable::Severable;

const CRON: &str = "*/2 * * * * *";
const PERIOD: Duration = Duration::from_secs(2);
const WORK: Duration = Duration::from_millis(300);
const REPLICAS: usize = 3;
/// Replica 0's clock runs this far ahead.
const SKEW_MS: i64 = 2_000;
const BEFORE_KILL: Duration = Duration::from_secs(7);
const AFTER_KILL: Duration = Duration::from_secs(7);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Replica {
    scheduler: Scheduler,
    wire: Severable,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("error")),
        )
        .init();
    let url = backend_url()?;
    // Fail on a bad or unsupported URL before starting anything.
    scheduler::connect(&url).await?;
    println!(
        "backend: {url}; 3 replicas, r0's clock is +2 s; job every 2 s, working {} ms",
        WORK.as_millis()
    );
    println!("per-tick failover = kill to the next run on a survivor; leader failover = kill to a new leader");
    let per_tick = run_mode(&url, "per-tick", Mode::PerTick, MissedTicks::Skip).await?;
    let election = ElectionOptions::new()
        .with_name("example/leader")
        .with_ttl(Duration::from_secs(1))
        .with_interval(Duration::from_millis(250));
    let leader = run_mode(&url, "leader", Mode::Leader(election), MissedTicks::RunOnce).await?;
    println!("\nper-tick: {per_tick}\nleader:   {leader}");
    Ok(())
}

fn backend_url() -> Result<String, BoxError> {
    let mut args = std::env::args().skip(1);
    let mut url = "memory://replicas-example".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => {
                url = args
                    .next()
                    .ok_or("--backend needs a URL, such as redis://127.0.0.1:6379")?
            }
            "-h" | "--help" => {
                println!("usage: replicas [--backend URL]   (default memory://replicas-example)");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help").into()),
        }
    }
    Ok(url)
}

/// Runs one mode: start, kill the working replica midway, shut down, report.
/// Returns the summary line.
async fn run_mode(
    url: &str,
    name: &'static str,
    mode: Mode,
    missed: MissedTicks,
) -> Result<String, BoxError> {
    let journal = Arc::new(Journal::default());
    let origin = Instant::now();
    let base = Utc::now();
    let job_name = format!("example/{name}");
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let backend = scheduler::connect(url).await?;
        let locks = backend
            .lock_backend()
            .ok_or("the replicas need a lock backend; memory:// is one")?;
        let wire = Severable::new(locks, backend.tick_store());
        let locker = Locker::builder()
            .with_backend(wire.clone())
            .with_registry(&Registry::new())
            .build()?;
        let skew = if i == 0 { SKEW_MS } else { 0 };
        let clock = TokioClock::starting_at(base).with_skew_ms(skew);
        let (log, hook) = (Arc::clone(&journal), Arc::clone(&journal));
        let job = Job::new(job_name.as_str(), CRON, move |ctx| {
            let log = Arc::clone(&log);
            async move {
                let run = log.started(i, ctx.scheduled_at());
                sleep(WORK).await;
                ctx.assert_held()?; // before the write this job would make
                log.finished(run);
                Ok(())
            }
        })
        .with_ttl(Duration::from_secs(1))
        .with_missed_ticks(missed);
        let scheduler = Scheduler::builder(locker, Arc::new(wire.clone()))
            .with_mode(mode.clone())
            .with_clock(Arc::new(clock))
            .with_registry(&Registry::new())
            .with_on_outcome(move |report| hook.reported(i, report))
            .with_job(job)
            .start()?;
        replicas.push(Some(Replica { scheduler, wire }));
    }

    sleep(BEFORE_KILL).await;
    let victim = match mode {
        Mode::PerTick => Some(0),
        _ => replicas
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| r.scheduler.is_leader())),
    };
    let mut failover = None;
    if let Some(v) = victim {
        let killed_at = kill_mid_run(&mut replicas, v, &journal).await;
        println!(
            "{name}: killed r{v} at {:.2} s, in the middle of a run",
            killed_at.duration_since(origin).as_secs_f64()
        );
        failover = wait_for_failover(
            &replicas,
            v,
            &journal,
            killed_at,
            matches!(mode, Mode::PerTick),
        )
        .await;
    }
    sleep(AFTER_KILL).await;
    for (i, r) in replicas.into_iter().enumerate() {
        if let Some(r) = r {
            r.scheduler.shutdown(Duration::from_secs(5)).await?;
            println!(
                "{name}: r{i} skipped {} tick(s) another replica had",
                journal.skipped(i)
            );
        }
    }
    Ok(report::print(name, &journal, origin, PERIOD, failover))
}

/// Waits until replica `v` is inside a run, then cuts its connection and
/// drops its scheduler, as a crash would: nothing it holds is released.
async fn kill_mid_run(replicas: &mut [Option<Replica>], v: usize, journal: &Journal) -> Instant {
    let seen = journal.runs().iter().filter(|r| r.replica == v).count();
    let deadline = Instant::now() + PERIOD * 2;
    while Instant::now() < deadline
        && journal.runs().iter().filter(|r| r.replica == v).count() == seen
    {
        sleep(Duration::from_millis(10)).await;
    }
    sleep(WORK / 3).await;
    if let Some(r) = replicas[v].take() {
        r.wire.cut();
        drop(r.scheduler);
    }
    Instant::now()
}

/// Leader mode: until another replica leads. Per-tick mode: until a
/// survivor starts a run.
async fn wait_for_failover(
    replicas: &[Option<Replica>],
    v: usize,
    journal: &Journal,
    killed_at: Instant,
    per_tick: bool,
) -> Option<Duration> {
    let give_up = killed_at + PERIOD * 3;
    while Instant::now() < give_up {
        let done = if per_tick {
            journal
                .runs()
                .iter()
                .any(|r| r.replica != v && r.started >= killed_at)
        } else {
            replicas.iter().flatten().any(|r| r.scheduler.is_leader())
        };
        if done {
            return Some(killed_at.elapsed());
        }
        sleep(Duration::from_millis(5)).await;
    }
    None
}
