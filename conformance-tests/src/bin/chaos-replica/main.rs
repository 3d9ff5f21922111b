//! One scheduler replica in its own process, for fault cases that kill,
//! stop or clock-step it.
//!
//! `chaos-replica <url> <per-tick|leader> <job-ttl-ms> <election-ttl-ms> <run-ms> [options]`
//! runs one job, `chaos/every-second` (cron `* * * * * *`), on the system
//! clock (which libfaketime may step or skew), for `run-ms`, then shuts
//! down. Each run makes a guarded write every 10 ms for 300 ms. Options:
//!
//! - `--names PREFIX`: the job is `PREFIX/every-second` and the leadership
//!   lock `PREFIX/leader` (default prefix `chaos`);
//! - `--delivery at-most-once|at-least-once` (default at most once);
//! - `--freeze-file PATH`: when a handler has returned and `PATH` exists,
//!   the replica deletes it and stops its own process with SIGSTOP before
//!   the tick's `Completed` record is written (the scheduler's pause hook),
//!   so its runtime, heartbeat included, stalls until someone sends SIGCONT;
//! - `--stop-file PATH`: shut down as soon as `PATH` exists (checked every
//!   50 ms), before `run-ms` is up.
//!
//! Every line on stdout ends with the host's monotonic clock in nanoseconds:
//!
//! - `READY <mono>` once started;
//! - `LEADER <0|1> <mono>` when leadership changes (leader mode);
//! - `RUN <tick-ms> <token> <mono>` when a run starts;
//! - `WRITE <tick-ms> <token> <late> <mono>` for each write whose guard
//!   passed, `late` 1 if it passed at or after the local deadline;
//! - `END <tick-ms> <mono>` when a run finished its writes and still held
//!   the lock at the end;
//! - `OUTCOME <tick-ms> <outcome> <catch-up> <mono>` for every tick this
//!   replica fired (the scheduler's own report);
//! - `FREEZE <tick-ms> <mono>` just before it stops itself, `THAW <tick-ms>
//!   <mono>` once it runs again;
//! - `EXIT <mono>` after the shutdown.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use conformance_tests::child_main::run_child;
use conformance_tests::mono::now_ns;
use prometheus::Registry;
use scheduler::{
    Delivery, ElectionOptions, Job, MissedTicks, Mode, PauseHook, ProtocolPoint, Scheduler,
};

const WORK: Duration = Duration::from_millis(300);
const WRITE_EVERY: Duration = Duration::from_millis(10);
const STOP_POLL: Duration = Duration::from_millis(50);
const USAGE: &str =
    "usage: chaos-replica <url> <per-tick|leader> <job-ttl-ms> <election-ttl-ms> <run-ms> \
[--names PREFIX] [--delivery at-most-once|at-least-once] [--freeze-file PATH] [--stop-file PATH]";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn say(line: std::fmt::Arguments<'_>) {
    // One `println!` per line: stdout's lock keeps lines from interleaving.
    println!("{line} {}", now_ns());
}

/// What the options after the positional arguments ask for.
struct Options {
    names: String,
    delivery: Delivery,
    freeze_file: Option<PathBuf>,
    stop_file: Option<PathBuf>,
}

fn options(rest: &[String]) -> Result<Options, String> {
    let mut out = Options {
        names: "chaos".to_owned(),
        delivery: Delivery::AtMostOnce,
        freeze_file: None,
        stop_file: None,
    };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .clone();
        match flag.as_str() {
            "--names" => out.names = value,
            "--delivery" => out.delivery = value.parse().map_err(|e| format!("{e}"))?,
            "--freeze-file" => out.freeze_file = Some(PathBuf::from(value)),
            "--stop-file" => out.stop_file = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(out)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some([url, mode, job_ttl, election_ttl, run]), rest) =
        (args.get(..5), args.get(5..).unwrap_or_default())
    else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let ms = |s: &str| s.parse::<u64>().map(Duration::from_millis);
    let (Ok(job_ttl), Ok(election_ttl), Ok(run)) = (ms(job_ttl), ms(election_ttl), ms(run)) else {
        eprintln!("the durations are whole milliseconds");
        return ExitCode::from(2);
    };
    let opts = match options(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mode = match mode.as_str() {
        "per-tick" => Mode::PerTick,
        "leader" => Mode::Leader(
            ElectionOptions::new()
                .with_name(format!("{}/leader", opts.names))
                .with_ttl(election_ttl)
                .with_interval(election_ttl / 4),
        ),
        other => {
            eprintln!("unknown mode {other:?}");
            return ExitCode::from(2);
        }
    };
    run_child("chaos-replica", replica(url, mode, job_ttl, run, opts))
}

/// Stops this whole process (every thread: the handlers, the heartbeat, the
/// scheduler's timers) until someone sends SIGCONT, as a process the kernel
/// or an operator stops, and returns once it runs again.
///
/// The signal goes to the calling thread's id, and that thread waits for
/// `kill` without yielding: a process-wide signal is handled by whichever
/// thread the kernel picks, so another thread could run on (and this task
/// write the tick's `Completed` record) before the stop lands. Sent to this
/// thread's id, it is this thread the kernel wakes for it, and it stops
/// before it runs another instruction of its own; the others stop as they
/// are scheduled.
fn freeze_self(tick: DateTime<Utc>) {
    let tick = tick.timestamp_millis();
    // `/proc/thread-self` links to `<pid>/task/<tid>`.
    let tid = std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|link| link.file_name().map(|n| n.to_string_lossy().into_owned()));
    let Some(tid) = tid else {
        eprintln!("chaos-replica: cannot read /proc/thread-self; not freezing");
        return;
    };
    say(format_args!("FREEZE {tick}"));
    match std::process::Command::new("kill")
        .arg("-STOP")
        .arg(&tid)
        .status()
    {
        Ok(status) if status.success() => say(format_args!("THAW {tick}")),
        Ok(status) => eprintln!("chaos-replica: kill -STOP {tid} exited with {status}"),
        Err(e) => eprintln!("chaos-replica: kill -STOP {tid}: {e}"),
    }
}

/// The pause hook: after a handler returns, freeze if `file` exists (and is
/// ours to delete: one freeze per file written).
fn freeze_hook(file: PathBuf) -> PauseHook {
    Arc::new(move |point, _job: &str, tick: DateTime<Utc>| {
        let file = file.clone();
        Box::pin(async move {
            if point == ProtocolPoint::HandlerReturned && std::fs::remove_file(&file).is_ok() {
                // Blocking on purpose: the whole process stops here.
                freeze_self(tick);
            }
        })
    })
}

/// Sleeps for `run`, or until `stop` exists.
async fn wait_for_stop(run: Duration, stop: Option<&Path>) {
    let until = tokio::time::Instant::now() + run;
    let Some(stop) = stop else {
        tokio::time::sleep_until(until).await;
        return;
    };
    while tokio::time::Instant::now() < until && !stop.exists() {
        tokio::time::sleep(STOP_POLL.min(until - tokio::time::Instant::now())).await;
    }
}

async fn replica(
    url: &str,
    mode: Mode,
    job_ttl: Duration,
    run: Duration,
    opts: Options,
) -> Result<(), BoxError> {
    let backend = scheduler::connect(url).await?;
    let locker = backend.locker(&Registry::new())?;
    let name = format!("{}/every-second", opts.names);
    let job = Job::new(name, "* * * * * *", |ctx| async move {
        let tick = ctx.scheduled_at().timestamp_millis();
        let token = ctx.fencing_token().unwrap_or(0);
        say(format_args!("RUN {tick} {token}"));
        let lease = ctx.lease().clone();
        let started = Instant::now();
        while started.elapsed() < WORK {
            let deadline = lease.remaining_validity().map(|r| Instant::now() + r);
            ctx.assert_held()?;
            let late = deadline.is_some_and(|d| Instant::now() >= d);
            say(format_args!("WRITE {tick} {token} {}", u8::from(late)));
            tokio::time::sleep(WRITE_EVERY).await;
        }
        // The commit point: a run counts as finished only under the lock.
        ctx.assert_held()?;
        say(format_args!("END {tick}"));
        Ok(())
    })
    .with_ttl(job_ttl)
    .with_delivery(opts.delivery)
    .with_missed_ticks(MissedTicks::Skip);
    let mut builder = Scheduler::builder(locker, backend.tick_store())
        .with_mode(mode)
        .with_registry(&Registry::new())
        .with_on_outcome(|report| {
            say(format_args!(
                "OUTCOME {} {} {}",
                report.scheduled.timestamp_millis(),
                report.outcome.as_str(),
                u8::from(report.catch_up)
            ));
        })
        .with_job(job);
    if let Some(file) = opts.freeze_file {
        builder = builder.with_pause_hook(freeze_hook(file));
    }
    let scheduler = builder.start()?;
    say(format_args!("READY"));
    let mut leadership = scheduler.leadership();
    let watch = tokio::spawn(async move {
        let mut was = false;
        loop {
            let now = *leadership.borrow_and_update();
            if now != was {
                say(format_args!("LEADER {}", u8::from(now)));
                was = now;
            }
            if leadership.changed().await.is_err() {
                return;
            }
        }
    });
    wait_for_stop(run, opts.stop_file.as_deref()).await;
    scheduler.shutdown(Duration::from_secs(2)).await?;
    watch.abort();
    say(format_args!("EXIT"));
    Ok(())
}
