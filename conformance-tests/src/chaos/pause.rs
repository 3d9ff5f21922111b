//! X1: a holder in its own process is stopped (SIGSTOP) past its TTL while
//! a successor takes the lock and writes; the holder's writes are applied
//! to the fenced store in the order they arrive.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{LockOptions, Locker};
use prometheus::Registry;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{ChildStdout, Command};
use tokio::time::Instant;

use super::cases::{wind_down, Handover};
use super::figures::Row;
use super::holder::Resource;
use super::procs::{process_url, signal};
use super::Target;
use crate::mono::now_ns;
use crate::Ctx;

/// The holder's reports, read line by line with a bound on each wait.
pub(super) struct Reports {
    lines: Lines<BufReader<ChildStdout>>,
}

impl Reports {
    /// Reads the reports of a holder from its piped stdout.
    pub(super) fn new(stdout: ChildStdout) -> Self {
        Self {
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// The next line if one comes `within`; `None` if none does (the
    /// holder is stopped, or has nothing to say).
    pub(super) async fn poll(&mut self, within: Duration) -> Option<String> {
        tokio::time::timeout(within, self.lines.next_line())
            .await
            .ok()
            .and_then(|line| line.expect("the holder's stdout reads"))
    }

    /// The next line, failing the case if none comes `within`.
    pub(super) async fn next(&mut self, within: Duration) -> Option<String> {
        tokio::time::timeout(within, self.lines.next_line())
            .await
            .expect("the holder reports in time")
            .expect("the holder's stdout reads")
    }

    /// The fencing token of the holder's first report, `ACQUIRED <token>`
    /// (timed or not), which must come `within`.
    pub(super) async fn acquired(&mut self, within: Duration) -> u64 {
        let first = self.next(within).await.expect("the holder reports");
        first
            .strip_prefix("ACQUIRED ")
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("expected ACQUIRED, got {first:?}"))
    }

    /// Applies the holder's writes to `resource` while it runs healthy, for
    /// half of `ttl` (each must come within `ttl`); returns how many it
    /// made and how many of those were late.
    pub(super) async fn healthy_writes(
        &mut self,
        ttl: Duration,
        resource: &Resource,
    ) -> (usize, usize) {
        let (mut writes, mut late) = (0, 0);
        let healthy_until = Instant::now() + ttl / 2;
        while Instant::now() < healthy_until {
            let line = self.next(ttl).await.expect("a write");
            writes += usize::from(apply(&line, resource, &mut late));
        }
        (writes, late)
    }
}

/// The successor of a holder in its own process: a `Locker` connected to
/// `url` as a user of the library would be (`scheduler::connect`, default
/// configuration), as the holder is.
pub(super) async fn successor_at(url: &str) -> Locker {
    scheduler::connect(url)
        .await
        .expect("the successor connects")
        .locker(&Registry::new())
        .expect("locker")
}

/// Applies one report; returns whether it was a write, and counts late ones.
pub(super) fn apply(line: &str, resource: &Resource, late: &mut usize) -> bool {
    let mut parts = line.split(' ');
    if parts.next() != Some("WRITE") {
        return false;
    }
    let token: u64 = parts.next().and_then(|t| t.parse().ok()).expect("a token");
    if parts.next() == Some("1") {
        *late += 1;
    }
    resource.write(token);
    true
}

/// X1 against the backend at `url`, with the holder binary at `holder`.
pub(super) async fn holder_pause(ctx: Ctx, target: Target, holder: &Path) {
    let timing = ctx.timing();
    let (ttl, tol) = (timing.ttl, timing.tolerance);
    let url = process_url(&ctx);
    let successor = successor_at(&url).await;
    let opts = LockOptions::new(ttl);
    let mut row = Row::of(&ctx, "chaos_holder_pause");
    for i in 0..target.iterations {
        let name = ctx.name(&format!("pause-{i}"));
        let resource = Arc::new(Resource::default());
        let mut child = Command::new(holder)
            .arg(&url)
            .arg(name.as_str())
            .arg(ttl.as_millis().to_string())
            .arg((ttl * 10).as_millis().to_string())
            // Lines end in CLOCK_MONOTONIC, for the overlap count (I1).
            .env("CHAOS_HOLDER_TIMES", "1")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the holder starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut reports = Reports::new(stdout);
        let token = reports.acquired(ttl * 5).await;
        let (mut writes, mut late) = reports.healthy_writes(ttl, &resource).await;
        signal(&child, "STOP");
        let stopped_at = Instant::now();
        row.faults += 1;
        // The successor waits out the stopped holder's lease and writes.
        let guard = successor
            .lock(&name, &opts.clone().with_acquire_timeout(ttl * 4))
            .await
            .expect("the successor acquires while the holder is stopped");
        let acquired_at = Instant::now();
        let acquired_mono = now_ns();
        let succ_token = guard.handle().fencing_token().expect("fenced");
        assert!(succ_token > token, "the successor's token is newer");
        assert!(resource.write(succ_token), "the successor writes");
        tokio::time::sleep_until(stopped_at + ttl * 3 / 2).await;
        signal(&child, "CONT");
        let resumed_at = Instant::now();
        // Writes reported before the stop are still in the pipe; apply them
        // in order, then the holder's first guard after the thaw must fail.
        let lost_line = loop {
            let line = reports
                .next(ttl)
                .await
                .expect("the holder reports its loss");
            if !apply(&line, &resource, &mut late) {
                break line;
            }
            writes += 1;
        };
        let abort = resumed_at.elapsed();
        row.abort.push(abort);
        assert!(
            lost_line.starts_with("LOST"),
            "the first failed guard: {lost_line:?}"
        );
        // I1: the holder believed itself inside its section until it saw
        // the loss; the successor entered before that. Expected of a paused
        // holder; its writes are what must not land.
        let lost_mono: u64 = lost_line
            .rsplit(' ')
            .next()
            .and_then(|t| t.parse().ok())
            .expect("a timed LOST line");
        row.overlaps += usize::from(acquired_mono < lost_mono);
        assert!(
            abort <= tol,
            "the holder saw its loss {abort:?} after the thaw"
        );
        let status = tokio::time::timeout(ttl * 2, child.wait())
            .await
            .expect("the holder exits after its loss")
            .expect("wait");
        assert!(status.success(), "the holder exited with {status}");
        let h = Handover::new(&successor, &name, &opts);
        wind_down(&mut row, h, guard, &resource, acquired_at, (writes, late)).await;
    }
    row.iterations = target.iterations;
    row.finish();
}
