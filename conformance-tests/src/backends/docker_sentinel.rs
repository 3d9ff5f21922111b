//! A Redis Sentinel deployment in containers (the `docker` feature), for
//! partitions between hosts: a primary, two replicas and three sentinels,
//! each a container on one private network of its own, with the settings of
//! the process-based deployment (`redis/sentinel.rs`). `docker network
//! disconnect` takes a member off that network: every packet to or from it
//! stops, both ways, while it keeps running.
//!
//! The sentinels name the primary by its address on that network, and the
//! test process, on the host, reaches those addresses through the
//! network's bridge: no published port and no address map is needed, and
//! what the sentinels hand out is what a client uses, as in a deployment
//! across hosts. The network's subnet is configured, so a member cut off
//! comes back at its own address, where the sentinels still know it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend};
use lock_redis::RedisBackend;

use super::redis::sentinel::{
    DATA_ARGS, DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, MASTER_NAME, QUORUM, READY_WITHIN,
    TILT_PERIOD_MS,
};
use super::redis::{config_for, sentinel_capabilities, RedisSaboteur, TIMING};
use crate::harness::docker::{Container, Kind, Network, Spec};
use crate::harness::poll_until;
use crate::{BackendFactory, BoxError, Saboteur, Timing};

/// Data servers: the primary and two replicas.
pub const SERVERS: usize = 3;
/// Sentinels; the quorum, the sentinels' timers, the data servers' settings
/// and the readiness bound are the process-based deployment's.
const SENTINELS: usize = 3;
/// The port sentinels listen on in their containers.
const SENTINEL_PORT: u16 = 26_379;
/// `min-replicas-max-lag` of the data servers, for the cases.
pub const MAX_LAG: Duration = Duration::from_secs(5);

/// The deployment. Containers drop (are removed) before the network.
#[derive(Debug)]
pub struct DockerSentinelSet {
    servers: Vec<Container>,
    sentinels: Vec<Container>,
    /// The data servers' addresses on the network, in order.
    ips: Vec<String>,
    sentinel_ips: Vec<String>,
    net: Network,
}

fn server_name(i: usize) -> String {
    format!("r{i}")
}

impl DockerSentinelSet {
    /// Creates the network, the data servers (index 0 the primary) and the
    /// sentinels, and waits (bounded) until both replicas are linked and
    /// every sentinel knows the primary, both replicas and its two peers.
    ///
    /// # Errors
    ///
    /// No engine, no image (the error names `.ci/images`), or a deployment
    /// that does not settle; everything made so far is removed.
    pub fn start() -> Result<Self, BoxError> {
        let net = Network::create_pinned("sentinel")?;
        let mut servers = Vec::with_capacity(SERVERS);
        let mut ips = Vec::with_capacity(SERVERS);
        for i in 0..SERVERS {
            let mut command: Vec<String> = [
                "redis-server",
                "--bind",
                "0.0.0.0",
                "--protected-mode",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                // A replica's full sync goes through a temp file in its
                // working dir; the image's user cannot write to `/`.
                "--dir",
                "/tmp",
            ]
            .iter()
            .chain(DATA_ARGS)
            .map(|a| (*a).to_owned())
            .collect();
            if let Some(primary) = ips.first() {
                command.extend(["--replicaof".to_owned(), String::clone(primary)]);
                command.push(Kind::Redis.port().to_string());
            }
            let server = Container::run(&Spec {
                image: Kind::Redis.image(),
                network: Some(net.name().to_owned()),
                hostname: Some(server_name(i)),
                command,
                ready: Kind::Redis.ready_line(),
                ..Spec::default()
            })?;
            ips.push(server.ip(net.name())?);
            servers.push(server);
        }
        let primary = ips.first().ok_or("no primary")?.clone();
        // A sentinel rewrites its config file, so it is written in the
        // container, where the server's user can write.
        let config = format!(
            "printf '%s\\n' \
             'sentinel monitor {MASTER_NAME} {primary} {port} {QUORUM}' \
             'sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}' \
             'sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}' \
             'sentinel parallel-syncs {MASTER_NAME} 2' > /tmp/sentinel.conf && \
             exec redis-server /tmp/sentinel.conf --sentinel --port {SENTINEL_PORT} \
             --bind 0.0.0.0 --protected-mode no",
            port = Kind::Redis.port()
        );
        let mut sentinels = Vec::with_capacity(SENTINELS);
        let mut sentinel_ips = Vec::with_capacity(SENTINELS);
        for i in 0..SENTINELS {
            let sentinel = Container::run(&Spec {
                image: Kind::Redis.image(),
                network: Some(net.name().to_owned()),
                hostname: Some(format!("s{i}")),
                command: vec!["sh".to_owned(), "-c".to_owned(), config.clone()],
                ready: "+monitor master",
                ..Spec::default()
            })?;
            let ip = sentinel.ip(net.name())?;
            // Runtime-only setting (`SENTINEL DEBUG`, Redis 7.0).
            let _: String = redis::cmd("SENTINEL")
                .arg("DEBUG")
                .arg("TILT-PERIOD")
                .arg(TILT_PERIOD_MS)
                .query(&mut connect(&ip, SENTINEL_PORT)?)?;
            sentinels.push(sentinel);
            sentinel_ips.push(ip);
        }
        let set = Self {
            servers,
            sentinels,
            ips,
            sentinel_ips,
            net,
        };
        set.wait_settled(0, READY_WITHIN)?;
        Ok(set)
    }

    /// `redis+sentinel://s1:26379,s2:26379,s3:26379/<name>`, the sentinels
    /// by their addresses on the network.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinel_ips
            .iter()
            .map(|ip| format!("{ip}:{SENTINEL_PORT}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// `redis://<address>:6379` of data server `i`, around the sentinels.
    ///
    /// # Errors
    ///
    /// If there is no data server `i`.
    pub fn server_url(&self, i: usize) -> Result<String, BoxError> {
        let ip = self
            .ips
            .get(i)
            .ok_or_else(|| format!("no data server {i}"))?;
        Ok(format!("redis://{ip}:{}", Kind::Redis.port()))
    }

    /// Which data server the sentinels name as primary (all that answer
    /// must agree).
    ///
    /// # Errors
    ///
    /// If no sentinel answers, they disagree, or they name an address that
    /// is none of the data servers'.
    pub fn primary(&self) -> Result<usize, BoxError> {
        let named: Vec<String> = self
            .sentinel_ips
            .iter()
            .filter_map(|ip| master_ip(ip).ok())
            .collect();
        let first = named.first().ok_or("no sentinel answered")?;
        if named.iter().any(|n| n != first) {
            return Err(format!("the sentinels disagree on the primary: {named:?}").into());
        }
        self.ips
            .iter()
            .position(|ip| ip == first)
            .ok_or_else(|| format!("the sentinels name {first}, no data server of ours").into())
    }

    /// Cuts data server `i` off: off the network, from everyone.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn cut(&self, i: usize) -> Result<(), BoxError> {
        self.server(i)?.disconnect(self.net.name())
    }

    /// Puts data server `i` back on the network at its address.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn heal(&self, i: usize) -> Result<(), BoxError> {
        let ip = self
            .ips
            .get(i)
            .ok_or_else(|| format!("no data server {i}"))?;
        self.server(i)?.connect_at(self.net.name(), ip)
    }

    /// The `ROLE` of data server `i` (`master` or `slave`), asked until it
    /// answers, for at most `within`.
    ///
    /// # Errors
    ///
    /// If it does not answer in time.
    pub fn role_of(&self, i: usize, within: Duration) -> Result<String, BoxError> {
        let ip = self
            .ips
            .get(i)
            .ok_or_else(|| format!("no data server {i}"))?;
        let until = Instant::now() + within;
        loop {
            match role(ip) {
                Ok(r) => return Ok(r),
                Err(e) if Instant::now() >= until => {
                    let server = self.server(i)?;
                    return Err(format!(
                        "data server {i} did not answer at {ip} within {within:?}: {e}; its address on the network now: {:?}; PING from inside: {:?}",
                        server.ip(self.net.name()).map_err(|e| e.to_string()),
                        server.exec(&["redis-cli", "ping"]).map_err(|e| e.to_string()),
                    )
                    .into());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    fn server(&self, i: usize) -> Result<&Container, BoxError> {
        self.servers
            .get(i)
            .ok_or_else(|| format!("no data server {i}").into())
    }

    /// Waits until every sentinel names the same data server other than
    /// `old` and it reports `role:master`; returns its index.
    ///
    /// # Errors
    ///
    /// If that does not happen `within` (the sentinels' logs are in the
    /// error).
    pub fn wait_new_primary(&self, old: usize, within: Duration) -> Result<usize, BoxError> {
        let until = Instant::now() + within;
        loop {
            let named: Vec<Option<String>> = self
                .sentinel_ips
                .iter()
                .map(|ip| master_ip(ip).ok())
                .collect();
            if let Some(Some(first)) = named.first() {
                let new = self.ips.iter().position(|ip| ip == first);
                if let Some(new) = new.filter(|n| *n != old) {
                    if named.iter().all(|n| n.as_ref() == Some(first))
                        && role(first).is_ok_and(|r| r == "master")
                    {
                        return Ok(new);
                    }
                }
            }
            if Instant::now() >= until {
                return Err(format!(
                    "the sentinels did not agree on a new primary within {within:?} (they name {named:?}; the old one is {}); sentinel logs:\n{}",
                    self.ips.get(old).map_or("?", String::as_str),
                    self.sentinel_logs()
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every data server on the network other than `primary`
    /// is its linked replica, and every sentinel knows them and its two
    /// peers.
    ///
    /// # Errors
    ///
    /// If that does not happen `within`.
    pub fn wait_settled(&self, primary: usize, within: Duration) -> Result<(), BoxError> {
        poll_until(within, Duration::from_millis(100), || self.settled(primary)).map_err(|last| {
            format!(
                "the Sentinel deployment did not settle within {within:?} ({last}); sentinel logs:\n{}",
                self.sentinel_logs()
            )
            .into()
        })
    }

    fn settled(&self, primary: usize) -> Result<bool, BoxError> {
        let primary_ip = self.ips.get(primary).ok_or("no such primary")?;
        let replicas: Vec<&String> = self
            .ips
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != primary)
            .map(|(_, ip)| ip)
            .collect();
        for ip in &replicas {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut connect(ip, Kind::Redis.port())?)?;
            if !info.contains(&format!("master_host:{primary_ip}"))
                || !info.contains("master_link_status:up")
            {
                return Ok(false);
            }
        }
        for ip in &self.sentinel_ips {
            let m: HashMap<String, String> = redis::cmd("SENTINEL")
                .arg("MASTER")
                .arg(MASTER_NAME)
                .query(&mut connect(ip, SENTINEL_PORT)?)?;
            let field = |k: &str| m.get(k).cloned().unwrap_or_default();
            if field("ip") != *primary_ip
                || field("num-slaves").parse::<usize>().unwrap_or(0) < replicas.len()
                || field("num-other-sentinels") != (SENTINELS - 1).to_string()
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The sentinels' logs, for a failure message: their `+`/`-` events
    /// say which step of a failover stalled.
    pub fn sentinel_logs(&self) -> String {
        let logs: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| s.logs().unwrap_or_else(|e| e.to_string()))
            .collect();
        logs.join("\n---\n")
    }
}

fn connect(ip: &str, port: u16) -> Result<redis::Connection, BoxError> {
    let client = redis::Client::open(format!("redis://{ip}:{port}"))?;
    let c = client.get_connection_with_timeout(Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(c)
}

/// The primary's address as the sentinel at `ip` names it.
fn master_ip(ip: &str) -> Result<String, BoxError> {
    let addr: Option<(String, String)> = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(MASTER_NAME)
        .query(&mut connect(ip, SENTINEL_PORT)?)?;
    Ok(addr.ok_or("the sentinel knows no such primary")?.0)
}

/// The `ROLE` of the data server at `ip`: `master` or `slave`.
///
/// # Errors
///
/// If it does not answer.
pub fn role(ip: &str) -> Result<String, BoxError> {
    let v: Vec<redis::Value> = redis::cmd("ROLE").query(&mut connect(ip, Kind::Redis.port())?)?;
    match v.first() {
        Some(redis::Value::BulkString(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        other => Err(format!("unexpected ROLE reply {other:?}").into()),
    }
}

/// `docker_redis_sentinel`: replicas connected through the sentinels of the
/// deployment the case started last ([`DockerSentinelFactory::deploy`]).
#[derive(Debug)]
pub struct DockerSentinelFactory {
    prefix: String,
    set: Mutex<Option<Arc<DockerSentinelSet>>>,
}

impl DockerSentinelFactory {
    /// A factory with no deployment yet; keys under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            set: Mutex::new(None),
        }
    }

    /// Starts a fresh deployment and makes it the one replicas connect
    /// to; the previous one goes once its last handle drops.
    ///
    /// # Errors
    ///
    /// As [`DockerSentinelSet::start`].
    pub fn deploy(&self) -> Result<Arc<DockerSentinelSet>, BoxError> {
        self.clear();
        let set = Arc::new(DockerSentinelSet::start()?);
        *self.set.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&set));
        Ok(set)
    }

    /// Forgets the current deployment (it goes with its last handle).
    pub fn clear(&self) {
        let old = self
            .set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(old);
    }

    /// The key prefix every replica uses.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn current(&self) -> Result<Arc<DockerSentinelSet>, BoxError> {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| "no Sentinel deployment in containers is started".into())
    }

    /// A backend through the sentinels of the current deployment, with the
    /// test profile's timeouts.
    ///
    /// # Errors
    ///
    /// With no deployment, or when it cannot connect.
    pub async fn connect(&self) -> Result<RedisBackend, BoxError> {
        let url = self.current()?.url();
        Ok(config_for(&url)?
            .with_key_prefix(&self.prefix)
            .connect()
            .await?)
    }
}

#[async_trait]
impl BackendFactory for DockerSentinelFactory {
    fn name(&self) -> &str {
        "docker_redis_sentinel"
    }

    fn capabilities(&self) -> Capabilities {
        sentinel_capabilities()
    }

    fn timing(&self) -> Timing {
        TIMING
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        let set = self.current()?;
        let url =
            tokio::task::spawn_blocking(move || set.primary().and_then(|i| set.server_url(i)))
                .await??;
        Ok(Box::new(RedisSaboteur::connect(&url, &self.prefix).await?))
    }

    fn server_addr(&self) -> Option<SocketAddr> {
        None
    }
}
