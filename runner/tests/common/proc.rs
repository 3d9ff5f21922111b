//! Spawned processes that are killed and reaped when the test ends, passed
//! or failed, with their output captured line by line.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustix::process::{Pid, Signal};

/// One line a process printed, with when the test read it.
#[derive(Debug, Clone)]
pub struct Line {
    pub at: Instant,
    /// Wall-clock seconds since the epoch when it was read.
    pub epoch: f64,
    pub text: String,
}

/// Lines read so far from one pipe; a reader thread appends to it.
#[derive(Debug, Clone, Default)]
pub struct Lines {
    lines: Arc<Mutex<Vec<Line>>>,
    closed: Arc<AtomicBool>,
}

impl Lines {
    /// Everything read so far.
    pub fn snapshot(&self) -> Vec<Line> {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether the pipe reached end-of-file (every line is in).
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Polls (every 5 ms, at most `limit`) until `found` returns something
    /// for the lines read so far.
    pub fn wait_for<T>(
        &self,
        limit: Duration,
        mut found: impl FnMut(&[Line]) -> Option<T>,
    ) -> Option<T> {
        let start = Instant::now();
        loop {
            if let Some(t) = found(&self.snapshot()) {
                return Some(t);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

pub fn epoch() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The number after `key=` in `text` (`pid=123`), if any.
pub fn field(text: &str, key: &str) -> Option<u32> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// A spawned process (lockrun), SIGKILLed and reaped on drop unless it has
/// exited, together with every process its output named as `pid=N` or
/// `child=N` (the commands and their children: the tests' commands print
/// those words), which get SIGKILL too, as a group and alone, if they are
/// still the processes that were named.
#[derive(Debug)]
pub struct Spawned {
    child: Child,
    pub stdout: Lines,
    pub stderr: Lines,
    named: Arc<Mutex<Vec<Named>>>,
}

/// A process named in the output, with its start time (clock ticks since
/// boot) when it was read: pids are reused (pid_max may be 32768), so only
/// a process that still has that start time is the one that was named.
#[derive(Debug, Clone, Copy)]
struct Named {
    pid: u32,
    started: Option<u64>,
}

/// Field 22 of /proc/PID/stat: when the process started.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Spawned {
    /// Spawns `command` with stdout and stderr captured; stderr lines are
    /// echoed to the test's stderr prefixed by `label`.
    pub fn start(mut command: Command, label: &str) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lockrun");
        let named: Arc<Mutex<Vec<Named>>> = Arc::default();
        let stdout = capture(
            child.stdout.take().expect("stdout"),
            None,
            Arc::clone(&named),
        );
        let stderr = capture(
            child.stderr.take().expect("stderr"),
            Some(label.to_owned()),
            Arc::clone(&named),
        );
        Self {
            child,
            stdout,
            stderr,
            named,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.id()).expect("pid")).expect("pid");
        rustix::process::kill_process(pid, signal).expect("signal lockrun");
    }

    /// Waits for the exit at most `limit`; fails (the drop then kills) past it.
    pub fn wait_bounded(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                start.elapsed() <= limit,
                "lockrun did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for the exit and for both pipes to close (every line read),
    /// at most `limit` in all.
    pub fn finish(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        let status = self.wait_bounded(limit);
        while !(self.stdout.closed() && self.stderr.closed()) {
            assert!(
                start.elapsed() <= limit,
                "lockrun's output still open {limit:?} after it was told to stop"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        status
    }

    /// Every pid its output named (`pid=N`, `child=N`).
    pub fn named(&self) -> Vec<u32> {
        self.named
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|n| n.pid)
            .collect()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let named = self
            .named
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for n in named {
            let Some(pid) = i32::try_from(n.pid).ok().and_then(Pid::from_raw) else {
                continue;
            };
            match (n.started, start_time(n.pid)) {
                // Still the process that was named: it and its group.
                (Some(then), Some(now)) if then == now => {
                    let _ = rustix::process::kill_process_group(pid, Signal::KILL);
                    let _ = rustix::process::kill_process(pid, Signal::KILL);
                }
                // Gone: a group of that number is what it left (a group's
                // number is not handed out again while the group lives).
                (_, None) => {
                    let _ = rustix::process::kill_process_group(pid, Signal::KILL);
                }
                // The number belongs to another process now.
                _ => {}
            }
        }
    }
}

/// Reads `pipe` line by line on a thread until it closes.
fn capture(
    pipe: impl Read + Send + 'static,
    echo: Option<String>,
    named: Arc<Mutex<Vec<Named>>>,
) -> Lines {
    let lines = Lines::default();
    let sink = lines.clone();
    std::thread::spawn(move || {
        for text in BufReader::new(pipe).lines().map_while(Result::ok) {
            if let Some(label) = &echo {
                eprintln!("{label}| {text}");
            }
            let mut pids = named.lock().unwrap_or_else(PoisonError::into_inner);
            pids.extend(
                ["pid", "child"]
                    .iter()
                    .filter_map(|k| field(&text, k))
                    .map(|pid| Named {
                        pid,
                        started: start_time(pid),
                    }),
            );
            drop(pids);
            let line = Line {
                at: Instant::now(),
                epoch: epoch(),
                text,
            };
            sink.lines
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(line);
        }
        sink.closed.store(true, Ordering::Release);
    });
    lines
}
