//! One scheduler replica in its own process, for fault cases that kill,
//! stop or clock-step it.
//!
//! `chaos-replica <url> <per-tick|leader> <job-ttl-ms> <election-ttl-ms> <run-ms>`
//! runs one job, `chaos/every-second` (cron `* * * * * *`), on the system
//! clock (which libfaketime may step or skew), for `run-ms`, then shuts
//! down. Each run makes a guarded write every 10 ms for 300 ms. Every line
//! on stdout ends with the host's monotonic clock in nanoseconds:
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
//! - `EXIT <mono>` after the shutdown.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use conformance_tests::mono::now_ns;
use prometheus::Registry;
use scheduler::{ElectionOptions, Job, MissedTicks, Mode, Scheduler};

const JOB: &str = "chaos/every-second";
const WORK: Duration = Duration::from_millis(300);
const WRITE_EVERY: Duration = Duration::from_millis(10);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn say(line: std::fmt::Arguments<'_>) {
    // One `println!` per line: stdout's lock keeps lines from interleaving.
    println!("{line} {}", now_ns());
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, mode, job_ttl, election_ttl, run] = args.as_slice() else {
        eprintln!(
            "usage: chaos-replica <url> <per-tick|leader> <job-ttl-ms> <election-ttl-ms> <run-ms>"
        );
        return ExitCode::from(2);
    };
    let ms = |s: &str| s.parse::<u64>().map(Duration::from_millis);
    let (Ok(job_ttl), Ok(election_ttl), Ok(run)) = (ms(job_ttl), ms(election_ttl), ms(run)) else {
        eprintln!("the durations are whole milliseconds");
        return ExitCode::from(2);
    };
    let mode = match mode.as_str() {
        "per-tick" => Mode::PerTick,
        "leader" => Mode::Leader(
            ElectionOptions::new()
                .with_name("chaos/leader")
                .with_ttl(election_ttl)
                .with_interval(election_ttl / 4),
        ),
        other => {
            eprintln!("unknown mode {other:?}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(replica(url, mode, job_ttl, run)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chaos-replica: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn replica(url: &str, mode: Mode, job_ttl: Duration, run: Duration) -> Result<(), BoxError> {
    let backend = scheduler::connect(url).await?;
    let locker = backend.locker(&Registry::new())?;
    let job = Job::new(JOB, "* * * * * *", |ctx| async move {
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
    .with_missed_ticks(MissedTicks::Skip);
    let scheduler = Scheduler::builder(locker, backend.tick_store())
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
        .with_job(job)
        .start()?;
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
    tokio::time::sleep(run).await;
    scheduler.shutdown(Duration::from_secs(2)).await?;
    watch.abort();
    say(format_args!("EXIT"));
    Ok(())
}
