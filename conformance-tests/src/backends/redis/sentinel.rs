//! A private Sentinel deployment on loopback: a primary, two replicas and
//! three sentinels, with control over failover (`SENTINEL FAILOVER`, or
//! killing the primary). Every process is killed and every dir removed when
//! it is dropped.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::server;
use crate::harness::{poll_until, ServerProcess};
use crate::BoxError;

/// The name the sentinels know the primary by.
pub const MASTER_NAME: &str = "lockprimary";
/// Sentinels that must agree the primary is down before a failover: a
/// majority of the three.
pub(crate) const QUORUM: usize = 2;
/// How long a primary must be silent before a sentinel deems it down. Short
/// so a killed primary is replaced in about 2 s; above the stalls a loaded
/// 2-core machine gives a healthy server.
pub(crate) const DOWN_AFTER_MS: u64 = 1_000;
/// How long a failover may take before another sentinel may retry it.
pub(crate) const FAILOVER_TIMEOUT_MS: u64 = 4_000;
/// How long a sentinel stays in TILT mode, in ms (Redis: 30 s).
///
/// A sentinel whose timer runs 2 s late (the process starved of CPU, or
/// blocked in the `fsync` of its config file behind a build's writes, as on
/// the shared CI machine) enters TILT: it keeps watching but takes no
/// action, and ignores what `INFO` tells it, for the TILT period. A
/// `SENTINEL FAILOVER` caught by it waits out the whole period (measured
/// here: a 2.5 s `SIGSTOP` of the sentinel just after the request made the
/// sentinels agree after 33.8 s instead of 1.2 s), and one caught while it
/// waits for the promoted replica's `INFO` is aborted when TILT ends, as
/// the failover timeout has passed by then (`-failover-abort-slave-timeout`;
/// a requested failover is never retried by the sentinels). Stalls on that
/// machine are a fact of the environment, not the fault under test; TILT
/// stays on, so a stalled sentinel still distrusts what it saw, but for 5 s.
pub(crate) const TILT_PERIOD_MS: u64 = 5_000;
/// `SENTINEL FAILOVER` requests [`SentinelSet::failover`] makes in all when
/// the sentinels abort the earlier ones.
const FAILOVER_REQUESTS: usize = 3;
/// Every data server (each may be promoted) refuses writes with no replica
/// acknowledging within 5 s: the old primary, once a failover repointed its
/// replicas, then stops granting locks instead of granting them until the
/// sentinels demote it seconds later. A replica that needs a full sync gets
/// it at once, not after the default 5 s wait for more replicas, since the
/// new primary refuses writes until one is linked.
pub(crate) const DATA_ARGS: &[&str] = &[
    "--min-replicas-to-write",
    "1",
    "--min-replicas-max-lag",
    "5",
    "--repl-diskless-sync-delay",
    "0",
];
/// Bound of every readiness wait.
pub(crate) const READY_WITHIN: Duration = Duration::from_secs(40);

/// Three data servers (index 0 starts as primary) and three sentinels.
/// Fields drop in order: processes before the dir holding their configs.
#[derive(Debug)]
pub struct SentinelSet {
    servers: Vec<ServerProcess>,
    sentinels: Vec<ServerProcess>,
    _configs: TempDir,
}

impl SentinelSet {
    /// Starts the deployment and waits (bounded) until both replicas are
    /// linked and every sentinel sees the primary, both replicas and the
    /// two other sentinels.
    pub fn start() -> Result<Self, BoxError> {
        let configs = tempfile::Builder::new()
            .prefix("lock-test-sentinel-")
            .tempdir()?;
        let primary = server::start_with(DATA_ARGS)?;
        let primary_port = primary.port();
        let mut servers = vec![primary];
        for _ in 0..2 {
            servers.push(server::start_replica_of_with(primary_port, DATA_ARGS)?);
        }
        let mut sentinels = Vec::with_capacity(3);
        for i in 0..3 {
            let path = configs.path().join(format!("sentinel-{i}.conf"));
            sentinels.push(start_sentinel(&path, primary_port, QUORUM)?);
        }
        let set = Self {
            servers,
            sentinels,
            _configs: configs,
        };
        set.wait_settled(primary_port, READY_WITHIN)?;
        Ok(set)
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/<name>`.
    pub fn url(&self) -> String {
        let hosts = super::local_hosts(self.sentinels.iter().map(|s| s.port()));
        format!("redis+sentinel://{hosts}/{MASTER_NAME}")
    }

    /// Sentinel `i`'s process.
    pub fn sentinel(&self, i: usize) -> Result<&ServerProcess, BoxError> {
        self.sentinels
            .get(i)
            .ok_or_else(|| format!("no sentinel {i}").into())
    }

    /// The data servers' ports (index 0 was the first primary).
    pub fn server_ports(&self) -> Vec<u16> {
        self.servers.iter().map(ServerProcess::port).collect()
    }

    /// The data server listening on `port`.
    pub fn server(&self, port: u16) -> Result<&ServerProcess, BoxError> {
        self.servers
            .iter()
            .find(|s| s.port() == port)
            .ok_or_else(|| format!("no data server on port {port}").into())
    }

    /// The primary's port as the first sentinel that answers names it.
    pub fn primary_port(&self) -> Result<u16, BoxError> {
        let mut last: BoxError = "no sentinel answered".into();
        for s in &self.sentinels {
            match master_addr(s.port()) {
                Ok(p) => return Ok(p),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Asks a sentinel to fail over now (`SENTINEL FAILOVER`, no agreement
    /// needed) and waits until every sentinel names a new primary that
    /// reports `role:master`. Returns `(old, new)` ports.
    ///
    /// A requested failover that the sentinel aborts (see
    /// `TILT_PERIOD_MS`) is requested again, up to `FAILOVER_REQUESTS`
    /// times in all, within `within`.
    pub fn failover(&self, within: Duration) -> Result<(u16, u16), BoxError> {
        let old = self.primary_port()?;
        let asked = self.sentinels.first().ok_or("no sentinel")?.port();
        let until = Instant::now() + within;
        for request in 1..=FAILOVER_REQUESTS {
            request_failover(asked)?;
            if let Some(new) = self.wait_for_switch(old, Some(asked), until, within)? {
                return Ok((old, new));
            }
            eprintln!(
                "    [redis_sentinel] requested failover {request} of {FAILOVER_REQUESTS} was aborted: {}",
                self.sentinel_events()
            );
        }
        Err(format!(
            "the sentinels aborted {FAILOVER_REQUESTS} requested failovers; sentinel logs:\n{}",
            self.sentinel_logs()
        )
        .into())
    }

    /// Kills the primary (SIGKILL) and waits until the sentinels agree on
    /// a promoted replica. Returns `(old, new)` ports.
    pub fn kill_primary(&self, within: Duration) -> Result<(u16, u16), BoxError> {
        let old = self.primary_port()?;
        self.server(old)?.kill()?;
        let new = self.wait_new_primary(old, within)?;
        Ok((old, new))
    }

    /// Waits until every sentinel names the same primary other than `old`
    /// and it reports `role:master`; returns its port.
    pub fn wait_new_primary(&self, old: u16, within: Duration) -> Result<u16, BoxError> {
        self.wait_for_switch(old, None, Instant::now() + within, within)?
            .ok_or_else(|| "no failover to wait for".into())
    }

    /// [`SentinelSet::wait_new_primary`] until `until`; with `asked`, ends
    /// with `None` as soon as that sentinel has no failover in progress and
    /// still names `old` (it aborted the one it was asked for).
    fn wait_for_switch(
        &self,
        old: u16,
        asked: Option<u16>,
        until: Instant,
        within: Duration,
    ) -> Result<Option<u16>, BoxError> {
        loop {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .map(|s| master_addr(s.port()).ok())
                .collect();
            if let Some(Some(p)) = named.first() {
                if *p != old
                    && named.iter().all(|n| *n == Some(*p))
                    && role(*p).is_ok_and(|r| r == "master")
                {
                    return Ok(Some(*p));
                }
            }
            if let Some(port) = asked {
                if master_addr(port).is_ok_and(|p| p == old)
                    && failover_in_progress(port).is_ok_and(|busy| !busy)
                {
                    return Ok(None);
                }
            }
            if Instant::now() >= until {
                return Err(format!(
                    "the sentinels did not agree on a new primary within {within:?} (they name {named:?}; old {old}); sentinel logs:\n{}",
                    self.sentinel_logs()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running data server other than `primary` is its
    /// linked replica and every sentinel knows them and its two peers.
    pub fn wait_settled(&self, primary: u16, within: Duration) -> Result<(), BoxError> {
        let replicas: Vec<u16> = self
            .servers
            .iter()
            .filter(|s| s.running() && s.port() != primary)
            .map(ServerProcess::port)
            .collect();
        poll_until(within, Duration::from_millis(100), || {
            self.settled(primary, &replicas)
        })
        .map_err(|last| {
            format!(
                "the Sentinel deployment did not settle within {within:?} ({last}); sentinel logs:\n{}",
                self.sentinel_logs()
            )
            .into()
        })
    }

    /// The latest TILT and failover-abort lines of the sentinels' logs.
    fn sentinel_events(&self) -> String {
        let logs = self.sentinel_logs();
        let events: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains("tilt") || l.contains("-failover-abort"))
            .collect();
        events[events.len().saturating_sub(4)..].join("; ")
    }

    /// Every sentinel's log, for a failure message: the `+`/`-` events
    /// there say which step of a failover stalled or was aborted.
    fn sentinel_logs(&self) -> String {
        let logs: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| std::fs::read_to_string(s.dir().join("server.log")).unwrap_or_default())
            .collect();
        logs.join("\n---\n")
    }

    fn settled(&self, primary: u16, replicas: &[u16]) -> Result<bool, BoxError> {
        for r in replicas {
            let info = info_replication(*r)?;
            if !info.contains(&format!("master_port:{primary}"))
                || !info.contains("master_link_status:up")
            {
                return Ok(false);
            }
        }
        for s in &self.sentinels {
            let mut c = connect(s.port())?;
            let m: HashMap<String, String> = redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(MASTER_NAME)
                .query(&mut c)?;
            let field = |k: &str| m.get(k).cloned().unwrap_or_default();
            if field("port") != primary.to_string()
                || field("num-slaves").parse::<usize>().unwrap_or(0) < replicas.len()
                || field("num-other-sentinels") != "2"
            {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Starts a sentinel that monitors `127.0.0.1:monitored` as
/// [`MASTER_NAME`] with `quorum`, its config written to `config` (a sentinel
/// rewrites its config file, so the file must outlive it).
pub fn start_sentinel(
    config: &Path,
    monitored: u16,
    quorum: usize,
) -> Result<ServerProcess, BoxError> {
    std::fs::write(
        config,
        format!(
            "sentinel monitor {MASTER_NAME} 127.0.0.1 {monitored} {quorum}\n\
             sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n\
             sentinel parallel-syncs {MASTER_NAME} 2\n"
        ),
    )?;
    let config = config.to_string_lossy().into_owned();
    let sentinel = ServerProcess::start(server::spec(
        [
            config.as_str(),
            "--sentinel",
            "--port",
            "{port}",
            "--bind",
            "127.0.0.1",
            "--dir",
            "{dir}",
        ]
        .map(String::from)
        .to_vec(),
    )?)?;
    // Runtime-only setting (`SENTINEL DEBUG`, Redis 7.0): no config line.
    let mut c = connect(sentinel.port())?;
    let _: String = redis::cmd("SENTINEL")
        .arg("DEBUG")
        .arg("TILT-PERIOD")
        .arg(TILT_PERIOD_MS)
        .query(&mut c)?;
    Ok(sentinel)
}

/// Sends `SENTINEL FAILOVER` to the sentinel on `port`; one already in
/// progress (`INPROG`) counts as sent.
fn request_failover(port: u16) -> Result<(), BoxError> {
    let mut c = connect(port)?;
    match redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER_NAME)
        .query::<String>(&mut c)
    {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("INPROG") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether the sentinel on `port` has a failover of [`MASTER_NAME`] under way.
fn failover_in_progress(port: u16) -> Result<bool, BoxError> {
    let mut c = connect(port)?;
    let m: HashMap<String, String> = redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(MASTER_NAME)
        .query(&mut c)?;
    Ok(m.get("flags")
        .is_some_and(|f| f.split(',').any(|f| f == "failover_in_progress")))
}

fn connect(port: u16) -> Result<redis::Connection, BoxError> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let c = client.get_connection_with_timeout(Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(c)
}

/// The primary's port as the sentinel on `port` names it.
fn master_addr(port: u16) -> Result<u16, BoxError> {
    let mut c = connect(port)?;
    let addr: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(MASTER_NAME)
        .query(&mut c)?;
    let (_, p) = addr.ok_or("the sentinel knows no such primary")?;
    Ok(p.parse()?)
}

/// The `ROLE` of the data server on `port`: `master` or `slave`.
pub fn role(port: u16) -> Result<String, BoxError> {
    let mut c = connect(port)?;
    let v: Vec<redis::Value> = redis::cmd("ROLE").query(&mut c)?;
    match v.first() {
        Some(redis::Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        other => Err(format!("unexpected ROLE reply {other:?}").into()),
    }
}

fn info_replication(port: u16) -> Result<String, BoxError> {
    let mut c = connect(port)?;
    Ok(redis::cmd("INFO").arg("replication").query(&mut c)?)
}
