//! Private Redis processes on loopback (redis-server from PATH) that a test
//! may stop, continue, kill and restart by PID.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::BoxError;

/// Whether `program --version` runs.
pub(crate) fn on_path(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `Ok(true)` when redis-server and redis-cli are on PATH; `Ok(false)`
/// (printed) when not, which fails under CI=true.
pub(crate) fn redis_on_path() -> bool {
    if on_path("redis-server") && on_path("redis-cli") {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "redis-server/redis-cli not on PATH and CI=true"
    );
    eprintln!("skipped: redis-server or redis-cli is not on PATH");
    false
}

/// A loopback port nothing listens on right now and that this process has
/// not handed out before: tests run side by side, and one that kills a
/// server and starts it again on its port must not find it taken by
/// another's. The port 10,000 above it (a cluster node's bus port) is held
/// back too, and must be free now.
pub(crate) fn free_port() -> std::io::Result<u16> {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    for _ in 0..100 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", bus)).is_err() {
            continue;
        }
        let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
        if !given.contains(&port) && !given.contains(&bus) {
            given.insert(port);
            given.insert(bus);
            return Ok(port);
        }
    }
    Err(std::io::Error::other(
        "no free loopback port (and bus port) not handed out before",
    ))
}

/// A directory removed when dropped.
pub(crate) struct Dir(pub(crate) PathBuf);

impl Dir {
    pub(crate) fn new(tag: &str) -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!("rl-{tag}-{}", super::run_id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How long one redis-cli call may take before coreutils' `timeout` kills
/// it: a stopped server accepts the connection and never answers, and
/// `redis-cli --cluster create` waits for nodes to join without a limit.
pub(crate) const CLI_PATIENCE: &str = "20";

/// `redis-cli -p port args...` under [`CLI_PATIENCE`].
pub(crate) fn redis_cli(port: u16, args: &[&str]) -> Command {
    let mut command = Command::new("timeout");
    command
        .args([
            "-s",
            "KILL",
            CLI_PATIENCE,
            "redis-cli",
            "-p",
            &port.to_string(),
        ])
        .args(args)
        .stdin(Stdio::null());
    command
}

/// `redis-cli -p port args...`'s standard output, or "" when it did not run
/// or did not finish within [`CLI_PATIENCE`].
pub(crate) fn cli(port: u16, args: &[&str]) -> String {
    redis_cli(port, args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Polls `redis-cli -p port args` every 50 ms until its output contains
/// `want`, for at most `patience`.
pub(crate) fn wait_for(port: u16, args: &[&str], want: &str, patience: Duration) -> bool {
    let until = Instant::now() + patience;
    loop {
        if cli(port, args).contains(want) {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One redis-server (or sentinel) process on a fixed loopback port. Dropping
/// it continues (if stopped), kills and reaps the process.
pub(crate) struct Server {
    child: Option<Child>,
    port: u16,
    args: Vec<String>,
    dir: PathBuf,
    /// A data server (no persistence), not a sentinel.
    data: bool,
}

impl Server {
    /// Starts `redis-server` without persistence on `port` in `dir` with
    /// `extra` arguments and waits up to 10 s for PING.
    pub(crate) fn start(dir: &Path, port: u16, extra: &[String]) -> Result<Self, BoxError> {
        let mut s = Self {
            child: None,
            port,
            args: extra.to_vec(),
            dir: dir.to_path_buf(),
            data: true,
        };
        s.spawn()?;
        Ok(s)
    }

    /// Starts `redis-server <config> --sentinel` on `port` in `dir` and
    /// waits up to 10 s for PING.
    pub(crate) fn start_sentinel(dir: &Path, port: u16, config: &Path) -> Result<Self, BoxError> {
        let mut s = Self {
            child: None,
            port,
            args: vec![config.to_string_lossy().into_owned(), "--sentinel".into()],
            dir: dir.to_path_buf(),
            data: false,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<(), BoxError> {
        let mut command = Command::new("redis-server");
        command
            .args(&self.args)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"]);
        if self.data {
            command.args(["--save", "", "--appendonly", "no"]);
        }
        let child = command
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        if !wait_for(self.port, &["PING"], "PONG", Duration::from_secs(10)) {
            return Err(format!("redis-server on {} did not answer PING", self.port).into());
        }
        Ok(())
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> Result<u32, BoxError> {
        Ok(self.child.as_ref().ok_or("the server is not running")?.id())
    }

    fn signal(&self, signal: &str) -> Result<(), BoxError> {
        let status = Command::new("kill")
            .args([signal, &self.pid()?.to_string()])
            .status()?;
        if !status.success() {
            return Err(format!("kill {signal} failed").into());
        }
        Ok(())
    }

    /// The process's state letter from /proc (`T` when stopped).
    fn state(&self) -> Result<char, BoxError> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?))?;
        let after = stat.rsplit_once(") ").ok_or("unreadable /proc stat")?.1;
        after
            .chars()
            .next()
            .ok_or_else(|| "empty /proc stat".into())
    }

    /// SIGSTOP, returning once /proc says the process is stopped (at most
    /// 2 s): from then on it answers nothing, its connections stay open.
    pub(crate) fn pause(&self) -> Result<(), BoxError> {
        self.signal("-STOP")?;
        let until = Instant::now() + Duration::from_secs(2);
        while self.state()? != 'T' {
            if Instant::now() >= until {
                return Err("the server did not stop".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// SIGCONT.
    pub(crate) fn resume(&self) -> Result<(), BoxError> {
        self.signal("-CONT")
    }

    /// SIGKILL and reap: its connections are reset, its data gone.
    pub(crate) fn kill(&mut self) -> Result<(), BoxError> {
        let mut child = self.child.take().ok_or("the server is not running")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Starts the process again on the same port, with the same arguments.
    pub(crate) fn restart(&mut self) -> Result<(), BoxError> {
        if self.child.is_some() {
            return Err("the server is still running".into());
        }
        self.spawn()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
