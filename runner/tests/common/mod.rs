//! Helpers of the real-process tests: the binary, guarded processes,
//! bounded waits, unique names, the servers.

#![allow(dead_code, unreachable_pub, unused_imports, unused_macros)]

mod metrics;
mod proc;
mod servers;

pub use metrics::{metrics_addr, scrape, wait_renewed};
pub use proc::{epoch, field, Line, Lines, Spawned};
pub use servers::{database_url, redis_url, Backend, Server};

use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const LOCKRUN: &str = env!("CARGO_BIN_EXE_lockrun");

/// A name no other run of the tests uses.
pub fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

pub fn lockrun(args: &[&str]) -> Command {
    let mut c = Command::new(LOCKRUN);
    c.args(args).env("RUST_LOG", "info").env_remove("LOCK_URL");
    c
}

/// `lockrun exec --backend <backend> --name <name>`, then `rest`.
pub fn exec(backend: &str, name: &str, rest: &[&str]) -> Command {
    let mut c = lockrun(&["exec", "--backend", backend, "--name", name]);
    c.args(rest);
    c
}

/// One `#[test]` per server backend, named as given (Redis, Postgres, etcd,
/// in that order), each running `case` with that backend: a case written
/// once, its failures still named by backend.
macro_rules! per_backend {
    ($case:ident: $redis:ident, $postgres:ident, $etcd:ident) => {
        #[test]
        fn $redis() {
            $case($crate::common::Backend::Redis);
        }

        #[test]
        fn $postgres() {
            $case($crate::common::Backend::Postgres);
        }

        #[test]
        fn $etcd() {
            $case($crate::common::Backend::Etcd);
        }
    };
}
pub(crate) use per_backend;

/// When `runner`'s command printed the line (`is_term`) it prints on
/// SIGTERM, waited for at most 2 s past its maximum hold `max_hold`.
pub fn termed_at(runner: &Spawned, max_hold: Duration, is_term: fn(&str) -> bool) -> Instant {
    runner
        .stdout
        .wait_for(max_hold + Duration::from_secs(2), |lines| {
            lines.iter().find(|l| is_term(&l.text)).map(|l| l.at)
        })
        .expect("the command got SIGTERM")
}

/// Asserts that `runner` logged the stop of its command as the maximum hold.
pub fn assert_max_hold_logged(runner: &Spawned) {
    assert!(
        runner
            .stderr
            .snapshot()
            .iter()
            .any(|l| l.text.contains("maximum hold time reached")),
        "logged as the maximum hold"
    );
}

/// Prints and checks when a command's group was stopped by a maximum hold
/// of `max_hold` with a kill grace of `grace`: SIGTERM seen at `termed`,
/// the group gone at `gone`, both counted from `started`, the command's
/// first line (read a little after the hold began). The tolerance is for a
/// loaded machine's timers.
pub fn check_max_hold(
    label: &str,
    (max_hold, grace): (Duration, Duration),
    started: Instant,
    termed: Instant,
    gone: Instant,
) {
    println!(
        "{label} {} ms, grace {} ms: SIGTERM seen {} ms after the start, the group gone {} ms after it",
        max_hold.as_millis(),
        grace.as_millis(),
        (termed - started).as_millis(),
        (gone - started).as_millis()
    );
    let tolerance = Duration::from_millis(300);
    assert!(
        termed - started >= max_hold - grace - tolerance,
        "SIGTERM came too early: {:?}",
        termed - started
    );
    assert!(
        gone - termed >= grace - tolerance,
        "SIGKILL did not wait for the grace: {:?}",
        gone - termed
    );
    assert!(
        gone - started < max_hold + tolerance,
        "the group outlived the maximum hold: {:?}",
        gone - started
    );
}

/// Runs to completion within `limit`; returns the status and the output.
pub fn output_bounded(command: Command, limit: Duration) -> (ExitStatus, String, String) {
    let mut run = Spawned::start(command, "lockrun");
    let status = run.finish(limit);
    let text = |lines: &Lines| {
        lines
            .snapshot()
            .into_iter()
            .map(|l| l.text + "\n")
            .collect::<String>()
    };
    (status, text(&run.stdout), text(&run.stderr))
}

/// Whether `pid` runs: exists and is not a zombie (a process re-parented
/// to an ancestor outside the test may wait there to be reaped).
pub fn alive(pid: u32) -> bool {
    matches!(state(pid), Some(s) if s != 'Z')
}

/// The state letter of `pid` (`R`, `S`, `Z`...), `None` once it is gone
/// for good (reaped).
pub fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

/// The pids whose parent is `parent`, zombies included.
pub fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let (_, rest) = s.rsplit_once(')')?;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// Waits until none of `pids` runs, polling every 2 ms for at most
/// `limit`; returns when the last one went.
pub fn wait_all_gone(pids: &[u32], limit: Duration) -> Option<Instant> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if pids.iter().all(|p| !alive(*p)) {
            return Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Runs `program` to completion within `limit`, killing and reaping it
/// past that; `None` if it could not start or ran out of time.
pub fn run_bounded(program: &str, args: &[&str], limit: Duration) -> Option<Output> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    // Read on threads so a full pipe cannot stall the client.
    let read = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = read(child.stdout.take().map(|p| Box::new(p) as _));
    let err = read(child.stderr.take().map(|p| Box::new(p) as _));
    let start = Instant::now();
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Some(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Runs a stock client (at most 20 s), failing the test if it fails.
pub fn client(program: &str, args: &[&str]) -> String {
    let out = run_bounded(program, args, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("{program} {args:?} could not run, or ran over 20 s"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
