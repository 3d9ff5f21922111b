//! A private 3-member etcd cluster on loopback: three processes with their
//! own data dirs, client and peer ports, and control over each member (kill,
//! pause, restart, cut its peer traffic), plus which one leads.

use std::path::Path;
use std::time::Duration;

use lock_etcd::EtcdBuilder;

use super::leader::{leader_among, wait_for_leader};
use super::server::{QUIET_LOGS, RAFT_TUNING};
use crate::harness::nft::OutputTable;
use crate::harness::{free_port, which, ServerProcess, ServerSpec};
use crate::BoxError;

/// Members in the cluster: the smallest that survives losing one.
pub const MEMBERS: usize = 3;

/// Each member runs as its own uid, so that nftables can tell the
/// connections a member dials (`meta skuid`) from those of the others: all
/// of them come from 127.0.0.1. No account is needed for a bare uid.
const FIRST_UID: u32 = 61_001;

/// Where data dirs go when it exists: every raft write is fsynced by the
/// leader and a follower, and three members fsyncing to one shared disk of
/// a loaded 2-core machine push requests past their 1 s timeout. A killed
/// or stopped member loses nothing on tmpfs that it would keep on a disk.
const SHM: &str = "/dev/shm";

/// A private 3-member cluster. Every member is killed when it is dropped.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<ServerProcess>,
}

impl EtcdCluster {
    /// Starts three members from `PATH` and waits until each serves clients
    /// (which an etcd member does only once the cluster has a leader).
    pub fn start() -> Result<Self, BoxError> {
        let program = which("etcd").ok_or("etcd is not on PATH")?;
        // Distinct: free_port never hands out a port twice.
        let ports = (0..MEMBERS * 2)
            .map(|_| free_port())
            .collect::<Result<Vec<_>, _>>()?;
        let (client, peer) = ports.split_at(MEMBERS);
        let initial: Vec<String> = (0..MEMBERS)
            .map(|i| format!("m{i}=http://127.0.0.1:{}", peer[i]))
            .collect();
        let initial = initial.join(",");
        let token = format!("lock-test-{:08x}", getrandom::u32().unwrap_or(0));
        let shm = Path::new(SHM).is_dir();
        let mut members = Vec::with_capacity(MEMBERS);
        for i in 0..MEMBERS {
            let uid = FIRST_UID + u32::try_from(i)?;
            let name = format!("m{i}");
            let args: Vec<String> = [
                "--name",
                &name,
                "--data-dir",
                "{dir}/data",
                "--listen-client-urls",
                "http://127.0.0.1:{port}",
                "--advertise-client-urls",
                "http://127.0.0.1:{port}",
                "--listen-peer-urls",
                "http://127.0.0.1:{port2}",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:{port2}",
                "--initial-cluster",
                &initial,
                "--initial-cluster-token",
                &token,
                "--initial-cluster-state",
                "new",
                // Without pre-vote (etcd 3.5's default, off in 3.4), a member
                // that rejoins after a restart or a partition campaigns with a
                // higher term and deposes a healthy leader.
                "--pre-vote",
            ]
            .iter()
            .chain(RAFT_TUNING)
            .chain(QUIET_LOGS)
            .map(|s| (*s).to_owned())
            .collect();
            let spec = ServerSpec {
                program: program.clone(),
                args,
                run_as: Some((uid, uid)),
                ready_timeout: Duration::from_secs(30),
            };
            members.push(ServerProcess::launch(
                spec,
                (client[i], peer[i]),
                shm.then_some(Path::new(SHM)),
            )?);
        }
        let cluster = Self { members };
        for m in &cluster.members {
            m.wait_ready()?;
        }
        Ok(cluster)
    }

    /// Member `i`'s process.
    pub fn member(&self, i: usize) -> Result<&ServerProcess, BoxError> {
        self.members
            .get(i)
            .ok_or_else(|| format!("no member {i} in a {MEMBERS}-member cluster").into())
    }

    /// The client ports, by member.
    pub fn client_ports(&self) -> Vec<u16> {
        self.members.iter().map(ServerProcess::port).collect()
    }

    /// The peer port of member `i`.
    pub fn peer_port(&self, i: usize) -> Result<u16, BoxError> {
        Ok(self.member(i)?.port2())
    }

    /// Client endpoints as `http://` URLs, by member.
    pub fn endpoints(&self) -> Vec<String> {
        self.client_ports()
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect()
    }

    /// `etcd://h1:p1,h2:p2,h3:p3`: the URL a user would configure.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .client_ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    /// A builder over every member, with the suite's timeouts.
    pub fn builder(&self) -> Result<EtcdBuilder, BoxError> {
        Ok(with_timeouts(EtcdBuilder::from_url(&self.url())?))
    }

    /// A builder over the given members only: a client pinned to them.
    pub fn builder_over(&self, members: &[usize]) -> Result<EtcdBuilder, BoxError> {
        let hosts: Vec<String> = members
            .iter()
            .map(|i| Ok(format!("127.0.0.1:{}", self.member(*i)?.port())))
            .collect::<Result<_, BoxError>>()?;
        let url = format!("etcd://{}", hosts.join(","));
        Ok(with_timeouts(EtcdBuilder::from_url(&url)?))
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.kill()
    }

    /// Freezes member `i` (SIGSTOP).
    pub fn pause(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.pause()
    }

    /// Thaws member `i` (SIGCONT).
    pub fn resume(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.resume()
    }

    /// Thaws every member that runs (after a failed case).
    pub fn resume_all(&self) {
        for m in &self.members {
            if m.running() {
                let _ = m.resume();
            }
        }
    }

    /// Restarts member `i` on its data dir and ports (killing it first if it
    /// runs) and waits until it serves clients again.
    pub fn restart(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.restart()
    }

    /// The member that leads: the one that reports itself as leader with the
    /// highest raft term, among the members that answer within 1 s. An
    /// isolated old leader may still believe it leads until its check-quorum
    /// timeout, so the highest term wins.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn leader(&self) -> Result<usize, BoxError> {
        leader_among(self.running()).await
    }

    /// Waits up to `within` for a leader among the members other than
    /// `not` (a member just killed or cut away), and returns it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn wait_leader(
        &self,
        not: Option<usize>,
        within: Duration,
    ) -> Result<usize, BoxError> {
        wait_for_leader(|| self.running(), not, within).await
    }

    /// The running members, by index and client port.
    fn running(&self) -> Vec<(usize, u16)> {
        let running = self.members.iter().enumerate().filter(|(_, m)| m.running());
        running.map(|(i, m)| (i, m.port())).collect()
    }

    /// Cuts member `i` off from the other members' peer traffic both ways,
    /// until the returned table is dropped. Client traffic is untouched: a
    /// client connected to `i` still reaches it, and `i` must refuse it.
    ///
    /// Connections to `i`'s peer port are dropped by port. Connections `i`
    /// dials to the others' peer ports come from ephemeral ports on the same
    /// address as everyone else's, so they are told apart by `i`'s uid; the
    /// conntrack mark set on `i`'s first packet then drops the answers too.
    pub fn cut_peers(&self, i: usize) -> Result<OutputTable, BoxError> {
        let mine = self.peer_port(i)?.to_string();
        let uid = (FIRST_UID + u32::try_from(i)?).to_string();
        let others: Vec<String> = (0..MEMBERS)
            .filter(|j| *j != i)
            .map(|j| self.peer_port(j).map(|p| p.to_string()))
            .collect::<Result<_, _>>()?;
        let set = format!("{{ {} }}", others.join(", "));
        let mark = "0x4c4b";
        let words = |s: &str| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
        let rules = vec![
            words(&format!("tcp dport {mine} drop")),
            words(&format!("tcp sport {mine} drop")),
            {
                let mut r = words(&format!("meta skuid {uid} tcp dport"));
                r.push(set);
                r.extend(words(&format!("ct mark set {mark} drop")));
                r
            },
            words(&format!("ct mark {mark} drop")),
        ];
        OutputTable::create(&format!("lock_ct_etcd_{mine}"), &rules)
    }
}

fn with_timeouts(b: EtcdBuilder) -> EtcdBuilder {
    b.with_connect_timeout(Duration::from_secs(2))
        .with_request_timeout(Duration::from_secs(1))
}
