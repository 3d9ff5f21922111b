//! Child processes for the clock and churn cases: started with an optional
//! libfaketime wall-clock offset, their report lines collected with the
//! monotonic time each ends in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::figures::Row;

/// The libfaketime preload library (the thread-safe build); the cases that
/// step clocks fail without it.
pub(super) fn libfaketime() -> PathBuf {
    find_libfaketime().expect("libfaketime is installed (apt-get install faketime libfaketime)")
}

fn find_libfaketime() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ]
    .iter()
    .map(|dir| Path::new(dir).join("libfaketimeMT.so.1"))
    .find(|p| p.is_file())
}

/// A file libfaketime re-reads on every clock call: writing an offset into
/// it steps the wall clock of every process started over it, at once.
/// Only the wall clock moves; `CLOCK_MONOTONIC` is left alone.
#[derive(Debug)]
pub(super) struct WallClock {
    lib: PathBuf,
    file: tempfile::NamedTempFile,
}

impl WallClock {
    /// A clock offset by `offset_s` seconds from the real one.
    pub(super) fn new(lib: PathBuf, offset_s: i64) -> Self {
        let file = tempfile::NamedTempFile::new().expect("a temp file for the clock");
        let clock = Self { lib, file };
        clock.set(offset_s);
        clock
    }

    /// Steps the clock to `offset_s` seconds from the real one.
    pub(super) fn set(&self, offset_s: i64) {
        // Written whole and renamed over, so a reader never sees half a line.
        let tmp = self.file.path().with_extension("new");
        std::fs::write(&tmp, format!("{offset_s:+}\n")).expect("write the clock offset");
        std::fs::rename(&tmp, self.file.path()).expect("install the clock offset");
    }

    fn apply(&self, cmd: &mut Command) {
        cmd.env("LD_PRELOAD", &self.lib)
            .env("FAKETIME_TIMESTAMP_FILE", self.file.path())
            .env("FAKETIME_NO_CACHE", "1")
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
}

/// One report line: who said it, its words (without the time), and the
/// monotonic time it ends in.
#[derive(Debug, Clone)]
pub(super) struct Line {
    /// The child's label, given at spawn.
    pub who: usize,
    /// The words before the time.
    pub words: Vec<String>,
    /// `CLOCK_MONOTONIC` nanoseconds when the child wrote it.
    pub mono: u64,
}

impl Line {
    /// The first word.
    pub(super) fn kind(&self) -> &str {
        self.words.first().map_or("", String::as_str)
    }

    /// Word `i` (0 is the kind) parsed as a number.
    pub(super) fn num(&self, i: usize) -> i64 {
        self.words
            .get(i)
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("word {i} of {:?} is a number", self.words))
    }
}

/// The URL the case's server is reached by from a child process.
pub(super) fn process_url(ctx: &crate::Ctx) -> String {
    ctx.factory()
        .connect_url()
        .expect("the server has a URL for other processes")
}

/// The `chaos-replica` command line: the server's `url`, the `mode`
/// (`per-tick` or `leader`), `ttl` as both the job's and the election's
/// TTL, and how long to run.
pub(super) fn replica_args(
    url: String,
    mode: &str,
    ttl: Duration,
    run_for: Duration,
) -> Vec<String> {
    let ttl_ms = ttl.as_millis().to_string();
    vec![
        url,
        mode.to_owned(),
        ttl_ms.clone(),
        ttl_ms,
        run_for.as_millis().to_string(),
    ]
}

/// Every line of every child, in arrival order, plus a feed of the same.
#[derive(Debug)]
pub(super) struct Journal {
    lines: Arc<Mutex<Vec<Line>>>,
    tx: mpsc::UnboundedSender<Line>,
    readers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Journal {
    /// An empty journal and the receiving end of its feed.
    pub(super) fn new() -> (Self, mpsc::UnboundedReceiver<Line>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let readers = Mutex::default();
        (Self { lines, tx, readers }, rx)
    }

    /// A copy of every line so far.
    pub(super) fn lines(&self) -> Vec<Line> {
        self.lines.lock().expect("journal lock").clone()
    }

    /// Starts `program args` labelled `who`, over `clock` if given, and
    /// feeds its timed stdout lines into the journal (`CHAOS_HOLDER_TIMES=1`
    /// makes `chaos-holder` time its lines; `chaos-replica` always does).
    /// The child dies with its handle.
    pub(super) fn spawn(
        &self,
        who: usize,
        program: &Path,
        args: &[String],
        clock: Option<&WallClock>,
    ) -> Child {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("CHAOS_HOLDER_TIMES", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if let Some(clock) = clock {
            clock.apply(&mut cmd);
        }
        let mut child = cmd.spawn().expect("the child starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (lines, tx) = (Arc::clone(&self.lines), self.tx.clone());
        let reader = tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(text)) = reader.next_line().await {
                let mut words: Vec<String> = text.split(' ').map(str::to_owned).collect();
                let Some(mono) = words.pop().and_then(|w| w.parse().ok()) else {
                    panic!("child {who} wrote an untimed line: {text:?}");
                };
                let line = Line { who, words, mono };
                lines.lock().expect("journal lock").push(line.clone());
                let _ = tx.send(line);
            }
        });
        self.readers.lock().expect("journal lock").push(reader);
        child
    }

    /// Waits (up to `within`) until every child's output has been read to
    /// its end: call it once the children have exited.
    pub(super) async fn drained(&self, within: Duration) {
        let readers = std::mem::take(&mut *self.readers.lock().expect("journal lock"));
        tokio::time::timeout(within, futures_all(readers))
            .await
            .expect("the children's output ends after they exit");
    }
}

async fn futures_all(readers: Vec<tokio::task::JoinHandle<()>>) {
    for r in readers {
        r.await.expect("a report reader panicked");
    }
}

/// Sends `sig` (`STOP`, `CONT`, `KILL`) to a child we started.
pub(super) fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("the child runs");
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{sig} {pid}");
}

/// Whether the child we started is stopped: every one of its threads in
/// state `T` (`/proc/<pid>/task/<tid>/stat`), so a SIGSTOP has landed on
/// the whole process.
pub(super) fn is_stopped(child: &Child) -> bool {
    let Some(pid) = child.id() else {
        return false;
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks {
        let Ok(task) = task else {
            return false;
        };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return false;
        };
        // `tid (comm) state …`: the name may hold spaces and parentheses,
        // so the state is the first word after the last `)`.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if state != Some("T") {
            return false;
        }
        any = true;
    }
    any
}

impl Journal {
    /// Waits until some child reports its first `RUN`, and fails the case
    /// if none has within 30 s: the scheduler cases inject their first fault
    /// only once the job runs, so that a slow start is not blamed on it.
    pub(super) async fn wait_first_run(&self) {
        let started = tokio::time::Instant::now();
        while !self.lines().iter().any(|l| l.kind() == "RUN") {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no tick ran within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The first line after `since` (monotonic ns) that `want` accepts,
    /// waiting up to `within` for it. Polls the journal, so waiting for one
    /// kind of line consumes no other. Panics on time out, naming `what`
    /// and quoting the children's latest lines.
    pub(super) async fn wait_for(
        &self,
        since: u64,
        within: Duration,
        what: &str,
        want: impl Fn(&Line) -> bool,
    ) -> Line {
        let until = tokio::time::Instant::now() + within;
        loop {
            if let Some(line) = self
                .lines()
                .into_iter()
                .find(|l| l.mono >= since && want(l))
            {
                return line;
            }
            if tokio::time::Instant::now() >= until {
                let recent: Vec<String> = self
                    .lines()
                    .iter()
                    .filter(|l| l.mono >= since && l.kind() != "WRITE")
                    .map(|l| format!("{} {}", l.who, l.words.join(" ")))
                    .collect();
                let tail = &recent[recent.len().saturating_sub(20)..];
                panic!("no {what} within {within:?}; the children said since: {tail:#?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The `RUN` lines of a scheduler journal by their tick (word 1), and its
/// `WRITE` lines; `row` counts the writes, and those made at or after their
/// lease's deadline (word 3 is 1).
pub(super) fn runs_and_writes<'a>(
    lines: &'a [Line],
    row: &mut Row,
) -> (BTreeMap<i64, Vec<&'a Line>>, Vec<&'a Line>) {
    let mut runs: BTreeMap<i64, Vec<&Line>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.kind() == "RUN") {
        runs.entry(l.num(1)).or_default().push(l);
    }
    let writes: Vec<&Line> = lines.iter().filter(|l| l.kind() == "WRITE").collect();
    row.writes = writes.len();
    row.after_deadline = writes.iter().filter(|w| w.num(3) == 1).count();
    (runs, writes)
}

/// Writes `lines` but the `WRITE`s to `file` beside the figures table, for
/// whoever reads a failed case, and says where on stderr.
pub(super) fn keep_journal(lines: &[Line], file: &str) {
    let path = super::figures::path().with_file_name(file);
    let text: String = lines
        .iter()
        .filter(|l| l.kind() != "WRITE")
        .map(|l| format!("{} {} {}\n", l.mono, l.who, l.words.join(" ")))
        .collect();
    let _ = std::fs::write(&path, text);
    eprintln!("journal written to {}", path.display());
}
