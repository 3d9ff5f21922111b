//! A lock holder in its own process, for fault cases that stop or kill it.
//!
//! `chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [max-hold-ms]` connects
//! with `scheduler::connect`, takes the lock once (with the watchdog at
//! `max-hold-ms` if given), and then makes a guarded write every 10 ms,
//! reported on stdout in the order made:
//!
//! - `ACQUIRED <token>` once the lock is held;
//! - `WRITE <token> <late>` for each write whose guard passed, `late` being
//!   1 if the guard passed at or after the lease's local deadline;
//! - `LOST <reason>` when a guard fails, after which it releases and exits;
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

use lock_core::{LockName, LockOptions};
use prometheus::Registry;

const WRITE_EVERY: Duration = Duration::from_millis(10);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (url, name, ttl_ms, max_ms, hold_ms) = match args.as_slice() {
        [u, n, t, m] => (u, n, t, m, None),
        [u, n, t, m, h] => (u, n, t, m, Some(h)),
        _ => {
            eprintln!("usage: chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [max-hold-ms]");
            return ExitCode::from(2);
        }
    };
    let (Ok(ttl_ms), Ok(max_ms)) = (ttl_ms.parse::<u64>(), max_ms.parse::<u64>()) else {
        eprintln!("ttl-ms and max-ms are whole milliseconds");
        return ExitCode::from(2);
    };
    let Ok(max_hold) = hold_ms.map(|h| h.parse::<u64>()).transpose() else {
        eprintln!("max-hold-ms is whole milliseconds");
        return ExitCode::from(2);
    };
    let mut opts = LockOptions::new(Duration::from_millis(ttl_ms));
    if let Some(h) = max_hold {
        opts = opts.with_max_hold(Duration::from_millis(h));
    }
    let timed = std::env::var("CHAOS_HOLDER_TIMES").is_ok_and(|v| v == "1");
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
    let max = Duration::from_millis(max_ms);
    match rt.block_on(hold(url, name, &opts, max, timed)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chaos-holder: {e}");
            ExitCode::FAILURE
        }
    }
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
