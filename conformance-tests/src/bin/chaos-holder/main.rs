//! A lock holder in its own process, for fault cases that stop or kill it.
//!
//! `chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [linger-ms]` connects with
//! `scheduler::connect`, takes the lock once, and then makes a guarded write
//! every 10 ms, reported on stdout in the order made:
//!
//! - `ACQUIRED <token>` once the lock is held;
//! - `WRITE <token> <late>` for each write whose guard passed, `late` being
//!   1 if the guard passed at or after the lease's local deadline;
//! - `LOST <reason>` when a guard fails, after which it keeps its guard for
//!   `linger-ms` (default 0, like a job slow to stop), releases and exits;
//! - `DONE` if `max-ms` passed without a loss.
//!
//! The parent applies the writes to a fenced store in arrival order.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lock_core::{LockName, LockOptions};
use prometheus::Registry;

const WRITE_EVERY: Duration = Duration::from_millis(10);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (url, name, ttl_ms, max_ms, linger_ms) = match args.as_slice() {
        [u, n, t, m] => (u, n, t, m, "0"),
        [u, n, t, m, l] => (u, n, t, m, l.as_str()),
        _ => {
            eprintln!("usage: chaos-holder <url> <lock-name> <ttl-ms> <max-ms> [linger-ms]");
            return ExitCode::from(2);
        }
    };
    let (Ok(ttl_ms), Ok(max_ms), Ok(linger_ms)) = (
        ttl_ms.parse::<u64>(),
        max_ms.parse::<u64>(),
        linger_ms.parse::<u64>(),
    ) else {
        eprintln!("ttl-ms, max-ms and linger-ms are whole milliseconds");
        return ExitCode::from(2);
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
    let ttl = Duration::from_millis(ttl_ms);
    let max = Duration::from_millis(max_ms);
    let linger = Duration::from_millis(linger_ms);
    match rt.block_on(hold(url, name, ttl, max, linger)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chaos-holder: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn hold(
    url: &str,
    name: &str,
    ttl: Duration,
    max: Duration,
    linger: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let locker = scheduler::connect(url).await?.locker(&Registry::new())?;
    let name = LockName::new(name)?;
    let guard = locker.try_lock(&name, &LockOptions::new(ttl)).await?;
    let token = guard
        .handle()
        .fencing_token()
        .ok_or("the backend has no fencing")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ACQUIRED {token}")?;
    out.flush()?;
    let handle = guard.handle();
    while started.elapsed() < max {
        // The deadline is read before the guard so that a guard passing at
        // or after it is reported as late instead of hidden.
        let deadline = handle.remaining_validity().map(|r| Instant::now() + r);
        if let Err(e) = handle.assert_held() {
            writeln!(out, "LOST {e}")?;
            out.flush()?;
            drop(out);
            tokio::time::sleep(linger).await;
            let _ = guard.release().await;
            return Ok(());
        }
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        writeln!(out, "WRITE {token} {}", u8::from(late))?;
        out.flush()?;
        tokio::time::sleep(WRITE_EVERY).await;
    }
    writeln!(out, "DONE")?;
    out.flush()?;
    drop(out);
    guard.release().await?;
    Ok(())
}
