//! A lock holder in its own process, for fault cases that stop or kill it.
//!
//! `chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [--linger-ms N]
//! [--max-hold-ms N]` connects with `scheduler::connect`, takes the lock once
//! (with the watchdog at `--max-hold-ms` if given), and then makes a guarded
//! write every 10 ms, reported on stdout in the order made:
//!
//! - `ACQUIRED <token>` once the lock is held;
//! - `WRITE <token> <late>` for each write whose guard passed, `late` being
//!   1 if the guard passed at or after the lease's local deadline;
//! - `LOST <reason>` when a guard fails, after which it keeps its guard for
//!   `--linger-ms` (default 0, like a job slow to stop), releases and exits;
//! - `DONE` if `max-ms` passed without a loss.
//!
//! The parent applies the writes to a fenced store in arrival order.
//!
//! With `CHAOS_HOLDER_TIMES=1` every line ends with the host's monotonic
//! clock in nanoseconds (comparable with the parent's), and `WRITE` lines
//! carry the lease's remaining local validity in microseconds before it, so
//! the clock cases can see each renewal and the watchdog's instant:
//! `WRITE <token> <late> <remaining-us> <mono-ns>`.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use conformance_tests::child_main::run_child;
use lock_core::{LockName, LockOptions};
use prometheus::Registry;

const WRITE_EVERY: Duration = Duration::from_millis(10);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(parsed) = parse(&args) else {
        eprintln!(
            "usage: chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [--linger-ms N] [--max-hold-ms N] (durations in whole ms)"
        );
        return ExitCode::from(2);
    };
    let Args {
        url,
        name,
        ttl,
        max,
        linger,
        max_hold,
    } = parsed;
    let mut opts = LockOptions::new(ttl);
    if let Some(h) = max_hold {
        opts = opts.with_max_hold(h);
    }
    let timed = std::env::var("CHAOS_HOLDER_TIMES").is_ok_and(|v| v == "1");
    run_child("chaos-holder", hold(&url, &name, &opts, max, linger, timed))
}

/// The command line.
struct Args {
    url: String,
    name: String,
    ttl: Duration,
    max: Duration,
    linger: Duration,
    max_hold: Option<Duration>,
}

fn parse(args: &[String]) -> Option<Args> {
    let ms = |s: &String| s.parse::<u64>().ok().map(Duration::from_millis);
    let [url, name, ttl, max, flags @ ..] = args else {
        return None;
    };
    let mut parsed = Args {
        url: url.clone(),
        name: name.clone(),
        ttl: ms(ttl)?,
        max: ms(max)?,
        linger: Duration::ZERO,
        max_hold: None,
    };
    for pair in flags.chunks(2) {
        match pair {
            [flag, value] if flag == "--linger-ms" => parsed.linger = ms(value)?,
            [flag, value] if flag == "--max-hold-ms" => parsed.max_hold = Some(ms(value)?),
            _ => return None,
        }
    }
    Some(parsed)
}

/// Ends a report line, with the monotonic time when `timed`.
fn end(out: &mut impl Write, timed: bool) -> std::io::Result<()> {
    if timed {
        writeln!(out, " {}", conformance_tests::mono::now_ns())?;
    } else {
        writeln!(out)?;
    }
    out.flush()
}

async fn hold(
    url: &str,
    name: &str,
    opts: &LockOptions,
    max: Duration,
    linger: Duration,
    timed: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let locker = scheduler::connect(url).await?.locker(&Registry::new())?;
    let name = LockName::new(name)?;
    let guard = locker.try_lock(&name, opts).await?;
    let token = guard
        .handle()
        .fencing_token()
        .ok_or("the backend has no fencing")?;
    let mut out = std::io::stdout().lock();
    write!(out, "ACQUIRED {token}")?;
    end(&mut out, timed)?;
    let handle = guard.handle();
    while started.elapsed() < max {
        // The deadline is read before the guard so that a guard passing at
        // or after it is reported as late instead of hidden.
        let remaining = handle.remaining_validity();
        let deadline = remaining.map(|r| Instant::now() + r);
        if let Err(e) = handle.assert_held() {
            // One word, so that a timed line still ends in the time.
            let reason = match &e {
                lock_core::Error::LockLost { reason, .. } => reason.as_str().to_owned(),
                other => format!("{other:?}").replace(char::is_whitespace, "_"),
            };
            write!(out, "LOST {reason}")?;
            end(&mut out, timed)?;
            drop(out);
            tokio::time::sleep(linger).await;
            let _ = guard.release().await;
            return Ok(());
        }
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        write!(out, "WRITE {token} {}", u8::from(late))?;
        if timed {
            write!(out, " {}", remaining.unwrap_or_default().as_micros())?;
        }
        end(&mut out, timed)?;
        tokio::time::sleep(WRITE_EVERY).await;
    }
    write!(out, "DONE")?;
    end(&mut out, timed)?;
    drop(out);
    guard.release().await?;
    Ok(())
}
