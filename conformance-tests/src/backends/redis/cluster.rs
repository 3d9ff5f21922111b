//! A private Redis Cluster on loopback: three primaries, one replica each,
//! started with `redis-server --cluster-enabled yes` and joined with
//! `redis-cli --cluster create`. Every process is killed (by PID) when it is
//! dropped.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::server;
use crate::harness::{which, ServerProcess};
use crate::BoxError;

/// Nodes of the deployment: three primaries and three replicas.
const NODES: usize = 6;
/// How long a node must be unreachable before it is deemed failed: short so
/// a killed primary is replaced in about 2.5 s, above the stalls a loaded
/// 2-core machine gives a healthy node.
const NODE_TIMEOUT_MS: &str = "1000";
/// Bound of every readiness wait.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How many slots a cluster has.
pub const SLOTS: u16 = 16_384;

/// Six cluster nodes; which are primaries is read from the nodes.
#[derive(Debug)]
pub struct ClusterSet {
    nodes: Vec<ServerProcess>,
}

/// One node as `CLUSTER NODES` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Its port.
    pub port: u16,
    /// Its node id.
    pub id: String,
    /// Whether it is a primary (and not marked failed).
    pub primary: bool,
    /// The slot ranges it serves (primaries only).
    pub slots: Vec<(u16, u16)>,
}

impl ClusterSet {
    /// Starts six nodes, joins them into a cluster with one replica per
    /// primary, and waits (bounded) until every node reports
    /// `cluster_state:ok`, all agree on who serves which slot, and every
    /// replica is linked to its primary.
    pub fn start() -> Result<Self, BoxError> {
        let spec = server::spec(server::without_persistence(&[
            "--port",
            "{port}",
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            NODE_TIMEOUT_MS,
            "--cluster-config-file",
            "{dir}/nodes.conf",
            "--repl-diskless-sync-delay",
            "0",
        ]))?;
        let cli = which("redis-cli").ok_or("redis-cli is not on PATH")?;
        let mut nodes = Vec::with_capacity(NODES);
        for _ in 0..NODES {
            let port = port_with_free_bus()?;
            nodes.push(ServerProcess::launch(spec.clone(), (port, port), None)?);
        }
        for n in &nodes {
            n.wait_ready()?;
        }
        let set = Self { nodes };
        let mut create = Command::new(cli);
        create.arg("--cluster").arg("create");
        for n in &set.nodes {
            create.arg(format!("127.0.0.1:{}", n.port()));
        }
        create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        run_bounded(create, READY_WITHIN)?;
        set.wait_settled(READY_WITHIN)?;
        Ok(set)
    }

    /// `redis+cluster://127.0.0.1:p1,...,127.0.0.1:p6`: every node as a seed.
    pub fn url(&self) -> String {
        let hosts = super::local_hosts(self.nodes.iter().map(|n| n.port()));
        format!("redis+cluster://{hosts}")
    }

    /// `redis://127.0.0.1:<port>` of every node, for plain cluster clients.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port()))
            .collect()
    }

    /// The node listening on `port`.
    pub fn node(&self, port: u16) -> Result<&ServerProcess, BoxError> {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .ok_or_else(|| format!("no cluster node on port {port}").into())
    }

    /// The cluster as the first running node that answers sees it.
    pub fn view(&self) -> Result<Vec<NodeView>, BoxError> {
        let mut last: BoxError = "no cluster node is running".into();
        for n in self.nodes.iter().filter(|n| n.running()) {
            match nodes_of(n.port()) {
                Ok(v) => return Ok(v),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The ports of the primaries that serve slots now.
    pub fn primaries(&self) -> Result<Vec<u16>, BoxError> {
        Ok(self
            .view()?
            .into_iter()
            .filter(|n| n.primary && !n.slots.is_empty())
            .map(|n| n.port)
            .collect())
    }

    /// The port of the primary serving `slot`.
    pub fn owner_of(&self, slot: u16) -> Result<u16, BoxError> {
        self.view()?
            .into_iter()
            .find(|n| n.primary && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .map(|n| n.port)
            .ok_or_else(|| format!("no primary serves slot {slot}").into())
    }

    /// Waits until every running node reports `cluster_state:ok`, all see
    /// the same primaries serving the same slots (all 16,384), and every
    /// running replica's link to its primary is up.
    pub fn wait_settled(&self, within: Duration) -> Result<(), BoxError> {
        let until = Instant::now() + within;
        loop {
            let last = match self.settled() {
                Ok(None) => return Ok(()),
                Ok(Some(why)) => why,
                Err(e) => e.to_string(),
            };
            if Instant::now() >= until {
                return Err(format!("the cluster did not settle within {within:?}: {last}").into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `None` when settled, else what is not yet.
    fn settled(&self) -> Result<Option<String>, BoxError> {
        let mut layouts = Vec::new();
        for n in self.nodes.iter().filter(|n| n.running()) {
            let info = query(n.port(), &["CLUSTER", "INFO"])?;
            if !info.contains("cluster_state:ok") {
                return Ok(Some(format!("node {} is not ok yet", n.port())));
            }
            let view = nodes_of(n.port())?;
            let me = view.iter().find(|v| v.port == n.port());
            if me.is_some_and(|m| !m.primary) {
                let repl = query(n.port(), &["INFO", "replication"])?;
                if !repl.contains("master_link_status:up") {
                    return Ok(Some(format!("replica {} is not linked yet", n.port())));
                }
            }
            let layout: BTreeMap<u16, Vec<(u16, u16)>> = view
                .into_iter()
                .filter(|v| v.primary && !v.slots.is_empty())
                .map(|v| (v.port, v.slots))
                .collect();
            let covered: u32 = layout
                .values()
                .flatten()
                .map(|(a, b)| u32::from(*b) - u32::from(*a) + 1)
                .sum();
            if covered != u32::from(SLOTS) {
                return Ok(Some(format!(
                    "node {} sees {covered} slots served",
                    n.port()
                )));
            }
            layouts.push(layout);
        }
        if layouts.windows(2).any(|w| w[0] != w[1]) {
            return Ok(Some("the nodes disagree on the slot layout".to_owned()));
        }
        Ok(None)
    }
}

/// A loopback port that is free, and whose cluster bus port (+10000) is too.
fn port_with_free_bus() -> Result<u16, BoxError> {
    for _ in 0..100 {
        let port = crate::harness::free_port()?;
        if port > 55_000 {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port + 10_000)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free port pair (p, p+10000) for a cluster node".into())
}

/// Runs `cmd` to completion within `within`, killing it (by PID) if not.
fn run_bounded(mut cmd: Command, within: Duration) -> Result<(), BoxError> {
    let mut child = cmd.spawn()?;
    let until = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait()? {
            let out = child.wait_with_output()?;
            if status.success() {
                return Ok(());
            }
            return Err(format!(
                "redis-cli --cluster create failed ({status}): {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(
                format!("redis-cli --cluster create did not finish within {within:?}").into(),
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn connect(port: u16) -> Result<redis::Connection, BoxError> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let c = client.get_connection_with_timeout(Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(c)
}

/// A command's text reply from the node on `port`.
pub fn query(port: u16, args: &[&str]) -> Result<String, BoxError> {
    let mut c = connect(port)?;
    let mut cmd = redis::cmd(args.first().ok_or("no command")?);
    for a in args.iter().skip(1) {
        cmd.arg(*a);
    }
    Ok(cmd.query(&mut c)?)
}

/// `CLUSTER NODES` of the node on `port`, parsed.
pub fn nodes_of(port: u16) -> Result<Vec<NodeView>, BoxError> {
    let text = query(port, &["CLUSTER", "NODES"])?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(id), Some(addr), Some(flags)) = (fields.first(), fields.get(1), fields.get(2))
        else {
            continue;
        };
        let port: u16 = addr
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("unexpected CLUSTER NODES line {line:?}"))?;
        let primary = flags.contains("master") && !flags.contains("fail");
        let slots = fields
            .iter()
            .skip(8)
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|x| (x, x)),
            })
            .collect();
        out.push(NodeView {
            port,
            id: (*id).to_owned(),
            primary,
            slots,
        });
    }
    Ok(out)
}
