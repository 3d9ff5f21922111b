//! `lockrun cron` on real processes, on every server backend: three runners
//! (one under libfaketime +2 s, one SIGKILLed midway) run each tick once;
//! leader mode runs one command at a time across a leader's death; an
//! entry's max-hold stops its command with SIGTERM, then SIGKILL.

mod common;
#[path = "cron/leader.rs"]
mod leader;
#[path = "cron/max_hold.rs"]
mod max_hold;
#[path = "cron/three_runners.rs"]
mod three_runners;

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use common::*;
use distlock::scheduler::chrono::DateTime;
use rustix::process::Signal;

/// The cases run one at a time: each reads per-second schedules off the
/// wall clock, and three runners per case are load enough for two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn libfaketime() -> String {
    let out = client("dpkg", &["-L", "libfaketime"]);
    out.lines()
        .find(|l| l.ends_with("libfaketime.so.1"))
        .expect("libfaketime.so.1 (apt-get install libfaketime)")
        .to_owned()
}

/// Starts `lockrun cron FILE` on `server` as `replica` (seen by the
/// commands as $REPLICA), its clock moved by libfaketime if `faketime`.
fn start(
    server: &Server,
    file: &str,
    replica: &str,
    faketime: Option<&str>,
    extra: &[&str],
) -> Spawned {
    let mut command = lockrun(&["cron", "--backend", &server.url]);
    command
        .args(extra)
        .arg(file)
        .env("REPLICA", replica)
        .env("RUST_LOG", "warn,lockrun=info");
    if let Some(lib) = faketime {
        command
            .env("LD_PRELOAD", lib)
            .env("FAKETIME", "+2")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    Spawned::start(command, &format!("{}/{replica}", server.backend.label()))
}

/// Waits (at most 30 s) until every runner logged that it started; returns
/// when the last did, in seconds since the epoch.
fn wait_started(runners: &[&Spawned]) -> f64 {
    let mut last = 0.0_f64;
    for runner in runners {
        let at = runner
            .stderr
            .wait_for(Duration::from_secs(30), |lines| {
                lines
                    .iter()
                    .find(|l| l.text.contains("cron started"))
                    .map(|l| l.epoch)
            })
            .expect("the runner started within 30 s");
        last = last.max(at);
    }
    last
}

fn write_crontab(dir: &tempfile::TempDir, text: &str) -> String {
    let file = dir.path().join("crontab");
    std::fs::write(&file, text).expect("write the cron file");
    file.to_str().expect("utf-8 path").to_owned()
}

/// What a command printed: `KIND TICK ...` after the `[JOB] ` prefix.
fn events<'a>(job: &str, lines: &'a [Line], kind: &str) -> Vec<(i64, &'a Line)> {
    let prefix = format!("[{job}] {kind} ");
    lines
        .iter()
        .filter_map(|l| {
            let rest = l.text.strip_prefix(&prefix)?;
            let tick = rest.split_whitespace().next()?;
            let tick = DateTime::parse_from_rfc3339(tick)
                .expect("rfc3339 tick")
                .timestamp();
            Some((tick, l))
        })
        .collect()
}

/// The shell and grandchild of the command `runner` is running now, if its
/// last two lines are a command's `start` and `child` and the shell runs.
fn running(lines: &[Line]) -> Option<(u32, u32)> {
    let n = lines.len();
    let (start, child) = (lines.get(n.checked_sub(2)?)?, lines.get(n - 1)?);
    if !(start.text.contains("] start ") && child.text.contains("] child=")) {
        return None;
    }
    let shell = field(&start.text, "pid")?;
    let grandchild = field(&child.text, "child")?;
    alive(shell).then_some((shell, grandchild))
}
