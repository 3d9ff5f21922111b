//! A private server process: own port, own temp dir, pausable and killable.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::BoxError;

/// How to start a server: program, arguments, user, and readiness port.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    /// The binary.
    pub program: PathBuf,
    /// Its arguments. `{dir}` is replaced by the temp dir and `{port}` by the port.
    /// `{port2}` is replaced by a second free port, for servers that need two
    /// listeners (etcd's client and peer URLs).
    pub args: Vec<String>,
    /// Run as this uid/gid instead of root (Postgres refuses to run as root).
    pub run_as: Option<(u32, u32)>,
    /// How long to wait for the port to accept connections.
    pub ready_timeout: Duration,
}

/// A server started by the tests. Stopped (SIGKILL) when dropped.
#[derive(Debug)]
pub struct ServerProcess {
    spec: ServerSpec,
    port: u16,
    port2: u16,
    dir: TempDir,
    child: Mutex<Option<Child>>,
}

/// A loopback port that was free a moment ago and that this process has
/// not handed out before. Trials that run side by side each start servers
/// on such ports, and some kill a server and start it again on its port: no
/// other trial may be given that port meanwhile. Each port handed out also
/// keeps the port 10,000 above it from being handed out, which a Redis
/// cluster node listens on for its bus.
pub fn free_port() -> Result<u16, BoxError> {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    for _ in 0..100 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        let mut given = GIVEN.lock().unwrap_or_else(PoisonError::into_inner);
        if given.insert(port) {
            if let Some(bus) = port.checked_add(10_000) {
                given.insert(bus);
            }
            return Ok(port);
        }
    }
    Err("no free loopback port that was not handed out before".into())
}

/// Waits until `127.0.0.1:port` accepts TCP connections.
pub fn wait_for_port(port: u16, timeout: Duration) -> Result<(), BoxError> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let start = Instant::now();
    while start.elapsed() < timeout {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("nothing accepted connections on {addr} within {timeout:?}").into())
}

/// Stops a server process: thaws it (a stopped process would not act on
/// the signal) and sends it `sig` (`TERM`, or Postgres's `INT` or `QUIT`),
/// then waits up to `within` for it to exit, killing (SIGKILL) and reaping
/// it if it has not. Whether it exited by itself.
fn stop_child(child: &mut Child, sig: &str, within: Duration) -> Result<bool, BoxError> {
    let pid = child.id().to_string();
    let _ = Command::new("kill").arg("-CONT").arg(&pid).status();
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(&pid)
        .status();
    let until = Instant::now() + within;
    while Instant::now() < until {
        if child.try_wait()?.is_some() {
            return Ok(true);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill()?;
    child.wait()?;
    Ok(false)
}

impl ServerProcess {
    /// Starts the server on a free port with a fresh temp dir and waits until it listens.
    pub fn start(spec: ServerSpec) -> Result<Self, BoxError> {
        let ports = (free_port()?, free_port()?);
        let server = Self::launch(spec, ports, None)?;
        server.wait_ready()?;
        Ok(server)
    }

    /// Starts the server on the given ports with a fresh temp dir, without
    /// waiting for it to listen: members of a cluster listen only once a
    /// quorum of them runs, so all must be launched before any is waited for
    /// ([`ServerProcess::wait_ready`]). The temp dir is made under `parent`
    /// when given (a tmpfs, where fsync costs nothing).
    pub fn launch(
        spec: ServerSpec,
        (port, port2): (u16, u16),
        parent: Option<&Path>,
    ) -> Result<Self, BoxError> {
        let mut builder = tempfile::Builder::new();
        builder.prefix("lock-test-");
        let dir = match parent {
            Some(parent) => builder.tempdir_in(parent)?,
            None => builder.tempdir()?,
        };
        if let Some((uid, gid)) = spec.run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let server = Self {
            port,
            port2,
            spec,
            dir,
            child: Mutex::new(None),
        };
        server.spawn_child()?;
        Ok(server)
    }

    /// Waits until a [`ServerProcess::launch`]ed server listens.
    pub fn wait_ready(&self) -> Result<(), BoxError> {
        wait_for_port(self.port, self.spec.ready_timeout).map_err(|e| self.with_log(e))
    }

    /// `e` with the server's log so far appended, for a failure to start.
    pub fn with_log(&self, e: BoxError) -> BoxError {
        let log = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
        format!("{e}; server log:\n{log}").into()
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The second port, substituted for `{port2}`.
    pub fn port2(&self) -> u16 {
        self.port2
    }

    /// Its private directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().ok()?.as_ref().map(Child::id)
    }

    fn spawn(&self) -> Result<(), BoxError> {
        self.spawn_child()?;
        self.wait_ready()
    }

    fn spawn_child(&self) -> Result<(), BoxError> {
        let dir = self.dir.path().to_string_lossy().into_owned();
        let port = self.port.to_string();
        let port2 = self.port2.to_string();
        let args: Vec<String> = self
            .spec
            .args
            .iter()
            .map(|a| {
                a.replace("{dir}", &dir)
                    .replace("{port}", &port)
                    .replace("{port2}", &port2)
            })
            .collect();
        let log = std::fs::File::create(self.dir.path().join("server.log"))?;
        let mut cmd = Command::new(&self.spec.program);
        cmd.args(&args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some((uid, gid)) = self.spec.run_as {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(gid);
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.spec.program.display()))?;
        *self.child.lock().map_err(|_| "server lock poisoned")? = Some(child);
        Ok(())
    }

    fn signal(&self, sig: &str) -> Result<(), BoxError> {
        let pid = self.pid().ok_or("the server is not running")?;
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill -{sig} {pid} failed").into())
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) -> Result<(), BoxError> {
        self.signal("STOP")
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) -> Result<(), BoxError> {
        self.signal("CONT")
    }

    /// Stops the server with `sig` (`TERM`, or Postgres's `INT` or `QUIT`),
    /// killing it if it has not exited within `within`, and reaps it.
    /// Whether it exited by itself (or was not running).
    pub fn stop(&self, sig: &str, within: Duration) -> Result<bool, BoxError> {
        let mut slot = self.child.lock().map_err(|_| "server lock poisoned")?;
        match slot.take() {
            Some(mut child) => stop_child(&mut child, sig, within),
            None => Ok(true),
        }
    }

    /// Whether the server process is running (neither killed nor stopped).
    pub fn running(&self) -> bool {
        self.pid().is_some()
    }

    /// Kills the server (SIGKILL) and reaps it.
    pub fn kill(&self) -> Result<(), BoxError> {
        let mut slot = self.child.lock().map_err(|_| "server lock poisoned")?;
        if let Some(mut child) = slot.take() {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(child.id().to_string())
                .status();
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Kills the server if running, then starts it again on the same port and dir.
    pub fn restart(&self) -> Result<(), BoxError> {
        self.kill()?;
        self.spawn()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}
