//! A private primary with a streaming standby, for failover cases: the
//! primary from `initdb`, the standby from `pg_basebackup -R` of it, both run
//! as the `postgres` user on loopback ports of their own.
//!
//! The pair keeps its two ports for its whole life: after a failover the
//! old primary's port is free, and [`PgPair::rebuild_standby`] starts a new
//! standby of the promoted server there. So one multi-host URL
//! ([`PgPair::url`]) reaches the primary of every generation.
//!
//! Every process is started and stopped here by its PID, and its data dir
//! removed on drop, whether or not the case passed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::server::{bindir, postgres_ids, psql, server_spec, wait_accepting};
use super::{PostgresFactory, Source};
use crate::harness::{free_port, ServerProcess};
use crate::BoxError;

/// How long a server may take to accept connections, a standby to stream,
/// or a promotion to finish, on a loaded 2-core machine.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// How long `initdb`, `pg_basebackup` or `pg_ctl` may run.
const TOOL_WITHIN: Duration = Duration::from_secs(60);

/// How the primary is stopped: `pg_ctl`'s fast (SIGINT) or immediate
/// (SIGQUIT) mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Sessions are terminated, a shutdown checkpoint is written, and the
    /// WAL senders pass everything to the standby before the server exits.
    Fast,
    /// The server exits at once, without a checkpoint: WAL not yet sent to
    /// the standby is lost to it.
    Immediate,
}

/// The Postgres binaries and the user that runs them.
#[derive(Debug, Clone)]
struct Tools {
    bin: PathBuf,
    uid: u32,
    gid: u32,
}

impl Tools {
    fn find() -> Result<Self, BoxError> {
        let bin = bindir().ok_or("pg_config --bindir found no Postgres server")?;
        let (uid, gid) = postgres_ids()?;
        Ok(Self { bin, uid, gid })
    }

    /// Runs a Postgres tool as the `postgres` user in `cwd`, killing it if
    /// it has not finished within [`TOOL_WITHIN`]; its output on failure.
    fn run(&self, tool: &str, args: &[&str], cwd: &Path) -> Result<String, BoxError> {
        use std::os::unix::process::CommandExt;
        // Files, not pipes: a child blocked on a full pipe would look hung.
        let out_path = cwd.join(format!("{tool}.out"));
        let out = std::fs::File::create(&out_path)?;
        let mut child = Command::new(self.bin.join(tool))
            .args(args)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .uid(self.uid)
            .gid(self.gid)
            .spawn()
            .map_err(|e| format!("cannot start {tool}: {e}"))?;
        let until = Instant::now() + TOOL_WITHIN;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() >= until {
                child.kill()?;
                child.wait()?;
                return Err(format!("{tool} did not finish within {TOOL_WITHIN:?}").into());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        if !status.success() {
            return Err(format!("{tool} failed ({status}): {text}").into());
        }
        Ok(text)
    }

    /// A temp dir owned by `postgres`, where it may create a data dir.
    fn dir(&self) -> Result<TempDir, BoxError> {
        let dir = tempfile::Builder::new().prefix("lock-pgha-").tempdir()?;
        std::os::unix::fs::chown(dir.path(), Some(self.uid), Some(self.gid))?;
        Ok(dir)
    }
}

/// One running `postgres` server: its process, port and data dir. Stopped
/// (immediate, then SIGKILL) and its dir removed on drop.
#[derive(Debug)]
pub struct PgNode {
    server: ServerProcess,
    tools: Tools,
    data: PathBuf,
    dir: TempDir,
}

impl PgNode {
    /// Starts `postgres` on an existing data dir and waits until it accepts
    /// connections (a hot standby does once it is consistent).
    fn start(tools: Tools, dir: TempDir, port: u16) -> Result<Self, BoxError> {
        let data = dir.path().join("data");
        let settings = [
            "max_connections=60",
            "shared_buffers=16MB",
            "wal_level=replica",
            "max_wal_senders=4",
            "hot_standby=on",
            "wal_keep_size=64MB",
            // A standby sends its replay position often, so that the
            // primary's view of it (and the case's wait) is fresh.
            "wal_receiver_status_interval=1s",
        ];
        let spec = server_spec(&tools.bin, &data, (tools.uid, tools.gid), &settings);
        // The pair's fixed port, and no second listener.
        let server = ServerProcess::launch(spec, (port, port), Some(dir.path()))?;
        let node = Self {
            server,
            tools,
            data,
            dir,
        };
        node.wait_ready().map_err(|e| node.server.with_log(e))?;
        Ok(node)
    }

    /// A fresh primary, from `initdb`, on `port`.
    fn primary(tools: Tools, port: u16) -> Result<Self, BoxError> {
        let dir = tools.dir()?;
        let data = dir.path().join("data");
        let data = data.to_string_lossy();
        tools.run(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale",
                "C",
            ],
            dir.path(),
        )?;
        Self::start(tools, dir, port)
    }

    /// A standby of `primary` on `port`: `pg_basebackup -R` (which writes
    /// `standby.signal` and the `primary_conninfo`), then started; returns
    /// once its WAL receiver streams.
    fn standby_of(primary: &PgNode, port: u16) -> Result<Self, BoxError> {
        let tools = primary.tools.clone();
        let dir = tools.dir()?;
        let data = dir.path().join("data");
        let data = data.to_string_lossy();
        let from = primary.port().to_string();
        tools.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &from,
                "-U",
                "postgres",
                "-D",
                &data,
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
            dir.path(),
        )?;
        let node = Self::start(tools, dir, port)?;
        node.wait_streaming(READY_WITHIN)
            .map_err(|e| node.server.with_log(e))?;
        Ok(node)
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// The postmaster's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    /// Runs SQL as `postgres` on this server.
    ///
    /// # Errors
    ///
    /// `psql`'s error text.
    pub fn psql(&self, sql: &str) -> Result<String, BoxError> {
        psql(&self.tools.bin, self.port(), sql)
    }

    /// Whether the server is a standby (`pg_is_in_recovery()`).
    ///
    /// # Errors
    ///
    /// If it cannot be asked.
    pub fn in_recovery(&self) -> Result<bool, BoxError> {
        Ok(self.psql("SELECT pg_is_in_recovery()")?.trim() == "t")
    }

    fn wait_ready(&self) -> Result<(), BoxError> {
        wait_accepting(&self.tools.bin, self.port(), READY_WITHIN)
    }

    /// Waits until this standby's WAL receiver reports `streaming`.
    fn wait_streaming(&self, within: Duration) -> Result<(), BoxError> {
        let start = Instant::now();
        loop {
            let status = self.psql("SELECT status FROM pg_stat_wal_receiver")?;
            if status.trim() == "streaming" {
                return Ok(());
            }
            if start.elapsed() > within {
                return Err(format!(
                    "the standby on port {} did not stream within {within:?} (status {:?})",
                    self.port(),
                    status.trim()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Promotes this standby (`pg_ctl promote`, waiting for it) and checks
    /// that it left recovery.
    fn promote(&self) -> Result<(), BoxError> {
        let data = self.data.to_string_lossy();
        let secs = READY_WITHIN.as_secs().to_string();
        self.tools.run(
            "pg_ctl",
            &["promote", "-D", &data, "-w", "-t", &secs],
            self.dir.path(),
        )?;
        if self.in_recovery()? {
            return Err(format!("the server on port {} is still a standby", self.port()).into());
        }
        Ok(())
    }

    /// Stops the server by signalling its postmaster (`mode`), waits up to
    /// `within` for it to exit, then kills it; reaps it either way.
    ///
    /// # Errors
    ///
    /// If it could not be signalled or reaped, or had to be killed.
    pub fn stop(&self, mode: StopMode, within: Duration) -> Result<(), BoxError> {
        let sig = match mode {
            StopMode::Fast => "INT",
            StopMode::Immediate => "QUIT",
        };
        if self.server.stop(sig, within)? {
            return Ok(());
        }
        Err(format!(
            "postgres on port {} did not stop within {within:?} ({mode:?}); killed",
            self.port()
        )
        .into())
    }
}

impl Drop for PgNode {
    fn drop(&mut self) {
        // Immediate: nothing of a test server needs a checkpoint, and its
        // backends exit with the postmaster rather than linger orphaned.
        if let Err(e) = self.stop(StopMode::Immediate, Duration::from_secs(5)) {
            eprintln!("stopping a test Postgres: {e}");
        }
    }
}

/// What one failover took, each from the moment the old primary was told
/// to stop.
#[derive(Debug, Clone, Copy)]
pub struct Failover {
    /// When the old primary was told to stop.
    pub stop_sent: Instant,
    /// When it had exited.
    pub stopped: Instant,
    /// When the promoted standby had left recovery.
    pub promoted: Instant,
}

/// A primary and its streaming standby on two fixed loopback ports.
#[derive(Debug)]
pub struct PgPair {
    ports: [u16; 2],
    nodes: [Option<PgNode>; 2],
    primary: usize,
}

impl PgPair {
    /// A fresh primary and a standby of it, streaming.
    ///
    /// # Errors
    ///
    /// If there is no Postgres or `postgres` user, or a step failed (with
    /// the server's log).
    pub fn start() -> Result<Self, BoxError> {
        let tools = Tools::find()?;
        // Distinct: free_port never hands out a port twice.
        let (first, second) = (free_port()?, free_port()?);
        let primary = PgNode::primary(tools, first)?;
        let standby = PgNode::standby_of(&primary, second)?;
        Ok(Self {
            ports: [first, second],
            nodes: [Some(primary), Some(standby)],
            primary: 0,
        })
    }

    /// The current primary.
    ///
    /// # Errors
    ///
    /// If it is not running (after a failover without a rebuild).
    pub fn primary(&self) -> Result<&PgNode, BoxError> {
        self.nodes[self.primary]
            .as_ref()
            .ok_or_else(|| "no primary runs".into())
    }

    /// The current standby.
    ///
    /// # Errors
    ///
    /// If none runs (after a failover, until [`PgPair::rebuild_standby`]).
    pub fn standby(&self) -> Result<&PgNode, BoxError> {
        self.nodes[1 - self.primary]
            .as_ref()
            .ok_or_else(|| "no standby runs".into())
    }

    /// The multi-host URL (as `postgres`, database `postgres`) that finds
    /// whichever of the two is the primary.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
            self.ports[0], self.ports[1]
        )
    }

    /// A URL of the standby's port alone.
    ///
    /// # Errors
    ///
    /// If no standby runs.
    pub fn standby_url(&self) -> Result<String, BoxError> {
        Ok(format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.standby()?.port()
        ))
    }

    /// Stops the primary (`mode`) and, once it is gone, promotes the
    /// standby; the standby is the primary from then on.
    ///
    /// # Errors
    ///
    /// If either step failed; the pair is unusable then.
    pub fn fail_over(&mut self, mode: StopMode) -> Result<Failover, BoxError> {
        let (stop_sent, stopped) = self.stop_primary(mode)?;
        let promoted = self.promote_standby()?;
        Ok(Failover {
            stop_sent,
            stopped,
            promoted,
        })
    }

    /// Stops the primary (`mode`) and removes its data dir; when the stop
    /// was sent and when the server had exited.
    ///
    /// # Errors
    ///
    /// If no primary runs or it did not stop in time (it is killed then).
    pub fn stop_primary(&mut self, mode: StopMode) -> Result<(Instant, Instant), BoxError> {
        let old = self.primary;
        let sent = Instant::now();
        let node = self.nodes[old].take().ok_or("no primary runs")?;
        node.stop(mode, READY_WITHIN)?;
        Ok((sent, Instant::now()))
    }

    /// Promotes the standby once the primary is gone; when it had left
    /// recovery. The standby is the primary from then on.
    ///
    /// # Errors
    ///
    /// If the primary still runs, no standby runs, or the promotion failed.
    pub fn promote_standby(&mut self) -> Result<Instant, BoxError> {
        if self.nodes[self.primary].is_some() {
            return Err("the primary still runs: stop it first".into());
        }
        let next = 1 - self.primary;
        self.nodes[next]
            .as_ref()
            .ok_or("no standby runs")?
            .promote()?;
        self.primary = next;
        Ok(Instant::now())
    }

    /// A new standby of the current primary, on the port of the one that
    /// was stopped.
    ///
    /// # Errors
    ///
    /// If a standby already runs, or a step failed.
    pub fn rebuild_standby(&mut self) -> Result<(), BoxError> {
        let slot = 1 - self.primary;
        if self.nodes[slot].is_some() {
            return Err("a standby already runs".into());
        }
        let standby = PgNode::standby_of(self.primary()?, self.ports[slot])?;
        self.nodes[slot] = Some(standby);
        Ok(())
    }
}

/// A factory whose replicas connect through `url` (a [`PgPair::url`]),
/// named `postgres` in figures.
pub fn pair_factory(run: &str, url: String) -> Arc<PostgresFactory> {
    Arc::new(PostgresFactory::new("postgres", Source::Env(url), run))
}
