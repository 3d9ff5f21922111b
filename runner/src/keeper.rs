//! The watchdog process: kills the commands' process groups if the runner
//! itself dies without doing so (SIGKILL, OOM killer, a crash).
//!
//! A runner that is killed cannot signal anything, and its commands would
//! run on without a lock until they finish by themselves. So each runner
//! starts one small process of its own (`lockrun` again, with a hidden
//! subcommand) in a process group of its own, and tells it on a pipe which
//! groups are running. When the pipe reaches end-of-file with groups still
//! listed, the runner is gone: the watchdog sends them SIGKILL at once. A
//! normal exit unlists every group first, so the watchdog then does nothing;
//! the runner then closes the pipe itself and reaps the watchdog before it
//! exits ([`Keeper::stop`]), so no watchdog is left a zombie for init.

use std::io::{self, Write};
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use rustix::process::{Pid, Signal, WaitStatus};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::reaper::Reaper;

/// The hidden subcommand that runs the watchdog.
pub(crate) const SUBCOMMAND: &str = "__keeper";

/// The runner's end of the watchdog's pipe.
#[derive(Debug)]
pub(crate) struct Keeper {
    /// `None` once [`Keeper::stop`] closed it.
    pipe: Mutex<Option<ChildStdin>>,
    exit: Mutex<Option<oneshot::Receiver<WaitStatus>>>,
}

impl Keeper {
    /// Starts the watchdog (this same binary) through `reaper`.
    pub(crate) fn start(reaper: &Reaper) -> io::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut command = Command::new(exe);
        command
            .arg(SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .process_group(0);
        let (mut child, exit) = reaper.spawn(&mut command)?;
        let pipe = child
            .stdin
            .take()
            .ok_or_else(|| io::Error::other("the watchdog has no stdin pipe"))?;
        Ok(Self {
            pipe: Mutex::new(Some(pipe)),
            exit: Mutex::new(Some(exit)),
        })
    }

    /// Closes the pipe, so the watchdog exits (killing any group still
    /// listed), and waits at most `limit` for the reaper to collect it.
    /// Returns whether it was collected. Later calls return at once.
    ///
    /// Cancel safe: the pipe is closed on the first poll; a dropped wait
    /// leaves the watchdog to exit and be reaped by the sweep, or by init.
    pub(crate) async fn stop(&self, limit: Duration) -> bool {
        drop(
            self.pipe
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let exit = self
            .exit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(exit) = exit else {
            return true;
        };
        match tokio::time::timeout(limit, exit).await {
            Ok(Ok(_status)) => true,
            Ok(Err(_)) | Err(_) => {
                warn!("the watchdog process did not exit in time; init will reap it");
                false
            }
        }
    }

    /// Lists `pgid`: killed if the runner dies before [`Keeper::unwatch`].
    pub(crate) fn watch(&self, pgid: Pid) {
        self.send('+', pgid);
    }

    /// Unlists `pgid` once its group is empty.
    pub(crate) fn unwatch(&self, pgid: Pid) {
        self.send('-', pgid);
    }

    fn send(&self, op: char, pgid: Pid) {
        let mut pipe = self.pipe.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(pipe) = pipe.as_mut() else {
            warn!(
                "the watchdog was stopped; a crash of this runner would leave this command running"
            );
            return;
        };
        if let Err(e) = writeln!(pipe, "{op}{}", pgid.as_raw_nonzero()) {
            warn!(error = %e, "the watchdog process is gone; a crash of this runner would leave its commands running");
        }
    }
}

/// The watchdog's own main: reads `+PGID`/`-PGID` lines until end-of-file,
/// then SIGKILLs every group still listed. Ignores SIGINT, SIGTERM and
/// SIGHUP (a `systemctl stop` or a terminal's Ctrl-C reach it too; the
/// runner handles those), so only the runner's end decides.
pub(crate) async fn run() -> io::Result<()> {
    let (mut int, mut term, mut hup) = (
        signal(SignalKind::interrupt())?,
        signal(SignalKind::terminate())?,
        signal(SignalKind::hangup())?,
    );
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                _ = hup.recv() => {}
            }
        }
    });
    let mut groups: Vec<Pid> = Vec::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let (op, number) = line.split_at(line.len().min(1));
        let Some(pgid) = number.parse::<i32>().ok().and_then(Pid::from_raw) else {
            continue;
        };
        match op {
            "+" => groups.push(pgid),
            "-" => groups.retain(|g| *g != pgid),
            _ => {}
        }
    }
    for pgid in groups {
        let killed = rustix::process::kill_process_group(pgid, Signal::KILL);
        debug!(
            pgid = pgid.as_raw_nonzero().get(),
            ?killed,
            "the runner is gone; killed its command's group"
        );
    }
    Ok(())
}
