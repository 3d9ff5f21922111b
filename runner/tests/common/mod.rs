//! Helpers of the real-process tests: the binary, bounded waits, unique names.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub const LOCKRUN: &str = env!("CARGO_BIN_EXE_lockrun");

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

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

/// Waits for `child` at most `limit`; kills it (SIGKILL) and fails past that.
pub fn wait_bounded(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lockrun did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs to completion within `limit`.
pub fn output_bounded(mut command: Command, limit: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lockrun");
    let status = wait_bounded(&mut child, limit);
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    use std::io::Read;
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_end(&mut stdout);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_end(&mut stderr);
    }
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Reads one line of `out` on a thread, failing after `limit`.
pub fn read_line(out: ChildStdout, limit: Duration) -> (String, ChildStdout) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send((line, reader.into_inner()));
    });
    rx.recv_timeout(limit)
        .expect("a line from the command in time")
}

/// Whether `pid` runs: exists and is not a zombie (a process re-parented
/// to an ancestor outside the test may wait there to be reaped).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Waits until none of `pids` runs, polling every
/// 2 ms for at most `limit`; returns when the last one went.
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

/// Runs a stock client, failing the test if it fails.
pub fn client(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} could not run: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
