//! A command in a process group of its own: spawned, signalled as a whole,
//! and known to be empty before the lock is let go.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use distlock::CancellationToken;
use rustix::io::Errno;
use rustix::process::{Pid, Signal, WaitStatus};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::warn;

use crate::keeper::Keeper;
use crate::reaper::Reaper;

/// How often emptiness is re-checked between reaps: a member whose parent is
/// another member is reaped by that parent, which the runner does not see.
const RECHECK: Duration = Duration::from_millis(10);

/// The longest the runner waits for a SIGKILLed group to empty; only a
/// process stuck in the kernel (uninterruptible I/O) takes longer.
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(5);

/// A running command and its process group.
#[derive(Debug)]
pub(crate) struct Group {
    pgid: Pid,
    exit: Option<oneshot::Receiver<WaitStatus>>,
    status: Option<WaitStatus>,
    reaper: Reaper,
    keeper: Arc<Keeper>,
    empty: bool,
}

impl Group {
    /// Spawns `command` as the leader of a new process group, and lists the
    /// group with the watchdog.
    pub(crate) fn spawn(
        reaper: &Reaper,
        keeper: &Arc<Keeper>,
        command: &mut Command,
    ) -> io::Result<(Self, Child)> {
        command.process_group(0);
        let (child, exit) = reaper.spawn(command)?;
        let pgid = Pid::from_child(&child);
        keeper.watch(pgid);
        let group = Self {
            pgid,
            exit: Some(exit),
            status: None,
            reaper: reaper.clone(),
            keeper: Arc::clone(keeper),
            empty: false,
        };
        Ok((group, child))
    }

    /// The group's id (the leader's pid).
    pub(crate) fn id(&self) -> i32 {
        self.pgid.as_raw_nonzero().get()
    }

    /// The leader's exit status, once it has exited and been reaped.
    ///
    /// Cancel safe: the status stays available to a later call.
    pub(crate) async fn leader_exit(&mut self) -> Option<WaitStatus> {
        if let Some(exit) = self.exit.as_mut() {
            let received = exit.await.ok();
            self.exit = None;
            self.status = received;
        }
        self.status
    }

    /// Sends `signal` to every process of the group; an empty group is not
    /// an error.
    pub(crate) fn signal(&self, signal: Signal) {
        match rustix::process::kill_process_group(self.pgid, signal) {
            Ok(()) | Err(Errno::SRCH) => {}
            Err(e) => {
                warn!(pgid = self.id(), error = %e, "cannot signal the command's process group")
            }
        }
    }

    /// Whether no process is left in the group (zombies count until reaped).
    pub(crate) fn is_empty(&self) -> bool {
        matches!(
            rustix::process::test_kill_process_group(self.pgid),
            Err(Errno::SRCH)
        )
    }

    /// Waits until the group is empty or `until`; returns whether it is.
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn wait_empty(&mut self, until: Instant) -> bool {
        let reaper = self.reaper.clone();
        loop {
            let reaped = reaper.reaped();
            if self.is_empty() {
                self.mark_empty();
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return false;
            }
            let next = until.min(now + RECHECK);
            tokio::select! {
                _ = reaped => {}
                _ = tokio::time::sleep_until(next) => {}
            }
        }
    }

    /// Stops the group: SIGTERM (and SIGCONT, so stopped members see it) to
    /// all of it at once, SIGKILL at `kill_at` if anything is left, then
    /// waits for it to empty. `hard` brings the SIGKILL forward to the
    /// instant it is cancelled. Returns whether the group emptied.
    pub(crate) async fn terminate(&mut self, kill_at: Instant, hard: &CancellationToken) -> bool {
        self.signal(Signal::TERM);
        self.signal(Signal::CONT);
        let emptied = tokio::select! {
            emptied = self.wait_empty(kill_at) => emptied,
            _ = hard.cancelled() => false,
        };
        if emptied {
            return true;
        }
        self.signal(Signal::KILL);
        self.wait_empty(Instant::now() + KILL_WAIT).await
    }

    fn mark_empty(&mut self) {
        if !self.empty {
            self.empty = true;
            self.keeper.unwatch(self.pgid);
        }
    }
}

impl Drop for Group {
    /// A group dropped before it was seen empty (its supervisor was
    /// aborted) gets SIGKILL: nothing of a command may outlive its run.
    fn drop(&mut self) {
        if !self.empty {
            self.signal(Signal::KILL);
            self.keeper.unwatch(self.pgid);
        }
    }
}
