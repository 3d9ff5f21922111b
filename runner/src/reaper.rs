//! Reaps every child of the runner, its commands' orphans included.
//!
//! The runner marks itself a child subreaper (Linux), so a grandchild whose
//! parent exits is re-parented to the runner rather than to init: the
//! runner then waits for it, and no process of a command's tree is left a
//! zombie or running unwatched. Since any `waitpid(-1)` also collects the
//! runner's direct children, this module is the only place that waits:
//! commands are spawned through [`Reaper::spawn`], which hands back a
//! receiver for the exit status.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rustix::io::Errno;
use rustix::process::{Pid, WaitOptions, WaitStatus};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{oneshot, Notify};
use tracing::debug;

/// Sweeps for exits even without a SIGCHLD, in case one was coalesced
/// away between a sweep and the next registration.
const SWEEP_INTERVAL: Duration = Duration::from_millis(250);

/// How often [`Reaper::drain`] looks again while children are left.
const DRAIN_RECHECK: Duration = Duration::from_millis(10);

#[derive(Default)]
struct Waiters(HashMap<i32, oneshot::Sender<WaitStatus>>);

/// The process-wide reaper; cheap to clone.
#[derive(Clone)]
pub(crate) struct Reaper {
    waiters: Arc<Mutex<Waiters>>,
    reaped: Arc<Notify>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").finish_non_exhaustive()
    }
}

impl Reaper {
    /// Becomes the subreaper of every descendant and starts reaping on the
    /// current runtime. Call it before spawning anything.
    pub(crate) fn start() -> io::Result<Self> {
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
        let mut sigchld = signal(SignalKind::child())?;
        let reaper = Self {
            waiters: Arc::default(),
            reaped: Arc::new(Notify::new()),
        };
        let task = reaper.clone();
        tokio::spawn(async move {
            loop {
                task.sweep();
                tokio::select! {
                    _ = sigchld.recv() => {}
                    _ = tokio::time::sleep(SWEEP_INTERVAL) => {}
                }
            }
        });
        Ok(reaper)
    }

    /// Spawns `command` and returns it with a receiver of its exit status.
    /// The waiter is registered before the reaper can see the exit.
    pub(crate) fn spawn(
        &self,
        command: &mut Command,
    ) -> io::Result<(Child, oneshot::Receiver<WaitStatus>)> {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let child = command.spawn()?;
        let (tx, rx) = oneshot::channel();
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        waiters.0.insert(pid, tx);
        Ok((child, rx))
    }

    /// Resolves after the next time some process was reaped (create it
    /// before checking, so a reap in between is not missed).
    pub(crate) fn reaped(&self) -> tokio::sync::futures::Notified<'_> {
        self.reaped.notified()
    }

    /// Reaps children until none is left, or `limit` has passed; returns
    /// whether none is left. For the runner's last moments: whatever path
    /// it ends by, no child of its is left a zombie for init to collect.
    ///
    /// Cancel safe: what it reaped is delivered as by the sweep.
    pub(crate) async fn drain(&self, limit: Duration) -> bool {
        let until = tokio::time::Instant::now() + limit;
        loop {
            let reaped = self.reaped();
            match rustix::process::wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    self.deliver(pid, status);
                    continue;
                }
                Err(Errno::CHILD) => return true,
                Ok(None) | Err(_) => {}
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::select! {
                _ = reaped => {}
                _ = tokio::time::sleep(DRAIN_RECHECK) => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Collects every exited child without blocking.
    fn sweep(&self) {
        let mut any = false;
        // Bounded: a sweep cannot reap more processes than could exist.
        for _ in 0..100_000 {
            match rustix::process::wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    any = true;
                    self.deliver(pid, status);
                }
                Ok(None) | Err(_) => break,
            }
        }
        if any {
            self.reaped.notify_waiters();
        }
    }

    fn deliver(&self, pid: Pid, status: WaitStatus) {
        let waiter = self
            .waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .remove(&pid.as_raw_nonzero().get());
        match waiter {
            Some(tx) => {
                let _ = tx.send(status);
            }
            None => debug!(
                pid = pid.as_raw_nonzero().get(),
                "reaped an orphaned descendant"
            ),
        }
    }
}
