//! A 3-member etcd cluster in containers (the `docker` feature), for
//! partitions between hosts: each member is a container whose raft traffic
//! runs on a private network of its own, and whose client port is published
//! on the host's loopback from a second network. `docker network
//! disconnect` from the raft network cuts a member off from its peers both
//! ways while its clients still reach it, the fault the nftables-based
//! `etcd_cluster::chaos_minority_partition` injects on processes.

use std::time::Duration;

use lock_etcd::EtcdBuilder;

use super::etcd::leader::{leader_among, wait_for_leader};
use super::etcd::{DeploymentFactory, EtcdDeployment};
use crate::harness::docker::{etcd_flags, Container, Kind, Network, Spec};
use crate::BoxError;

/// Members in the cluster: the smallest that survives losing one.
pub const MEMBERS: usize = 3;

/// A 3-member cluster. Members drop (are removed) before the networks.
#[derive(Debug)]
pub struct DockerEtcdCluster {
    members: Vec<Container>,
    ports: Vec<u16>,
    raft: Network,
    _clients: Network,
}

fn member_name(i: usize) -> String {
    format!("m{i}")
}

impl DockerEtcdCluster {
    /// Creates the networks and the three members, starts them together and
    /// waits until each serves clients (once the cluster has a leader).
    ///
    /// # Errors
    ///
    /// No engine, no image (the error names `.ci/images`), or a member that
    /// does not become ready; everything made so far is removed.
    pub fn start() -> Result<Self, BoxError> {
        let raft = Network::create("etcd-raft")?;
        let clients = Network::create("etcd-clients")?;
        let initial: Vec<String> = (0..MEMBERS)
            .map(|i| format!("{0}=http://{0}:2380", member_name(i)))
            .collect();
        let token = format!("distlock-{}", crate::harness::docker::run_id());
        let mut members = Vec::with_capacity(MEMBERS);
        for i in 0..MEMBERS {
            let name = member_name(i);
            let mut command: Vec<String> = [
                "etcd",
                "--name",
                &name,
                "--data-dir",
                "/var/lib/etcd/data",
                "--listen-client-urls",
                "http://0.0.0.0:2379",
                "--advertise-client-urls",
                &format!("http://{name}:2379"),
                "--listen-peer-urls",
                "http://0.0.0.0:2380",
                "--initial-advertise-peer-urls",
                &format!("http://{name}:2380"),
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-token",
                &token,
                "--initial-cluster-state",
                "new",
            ]
            .map(str::to_owned)
            .to_vec();
            command.extend(etcd_flags());
            // Three members on a loaded 2-core machine: a longer election
            // timeout than a lone member's, against leader churn.
            if let Some(at) = command.iter().position(|a| a == "--election-timeout") {
                if let Some(value) = command.get_mut(at + 1) {
                    "1000".clone_into(value);
                }
            }
            members.push(Container::create(&Spec {
                image: Kind::Etcd.image(),
                publish: vec![Kind::Etcd.port()],
                network: Some(clients.name().to_owned()),
                also_on: vec![(raft.name().to_owned(), name.clone())],
                // Raft fsyncs of three members on one shared disk would
                // push requests past their 1 s timeout.
                tmpfs: vec!["/var/lib/etcd"],
                command,
                ..Spec::default()
            })?);
        }
        for m in &members {
            m.start()?;
        }
        let mut ports = Vec::with_capacity(MEMBERS);
        for m in &members {
            m.wait_for_log(Kind::Etcd.ready_line(), Duration::from_secs(60))?;
            ports.push(m.host_port(Kind::Etcd.port())?);
        }
        Ok(Self {
            members,
            ports,
            raft,
            _clients: clients,
        })
    }

    /// The loopback endpoints of the members, in order.
    pub fn endpoints(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect()
    }

    /// A builder over the given members, with the suite's timeouts.
    ///
    /// # Errors
    ///
    /// If a member index is out of range.
    pub fn builder_over(&self, members: &[usize]) -> Result<EtcdBuilder, BoxError> {
        let hosts: Vec<String> = members
            .iter()
            .map(|i| {
                self.ports
                    .get(*i)
                    .map(|p| format!("127.0.0.1:{p}"))
                    .ok_or_else(|| BoxError::from(format!("no member {i}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(
            EtcdBuilder::from_url(&format!("etcd://{}", hosts.join(",")))?
                .with_connect_timeout(Duration::from_secs(2))
                .with_request_timeout(Duration::from_secs(1)),
        )
    }

    /// A builder over every member.
    ///
    /// # Errors
    ///
    /// As [`Self::builder_over`].
    pub fn builder(&self) -> Result<EtcdBuilder, BoxError> {
        let all: Vec<usize> = (0..MEMBERS).collect();
        self.builder_over(&all)
    }

    /// Cuts member `i` off from its peers: off the raft network.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn cut(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.disconnect(self.raft.name())
    }

    /// Puts member `i` back on the raft network under its name.
    ///
    /// # Errors
    ///
    /// If the engine refuses.
    pub fn heal(&self, i: usize) -> Result<(), BoxError> {
        self.member(i)?.connect(self.raft.name(), &member_name(i))
    }

    fn member(&self, i: usize) -> Result<&Container, BoxError> {
        self.members
            .get(i)
            .ok_or_else(|| format!("no member {i}").into())
    }

    /// Every member, by index and client port.
    fn member_ports(&self) -> Vec<(usize, u16)> {
        self.ports.iter().copied().enumerate().collect()
    }

    /// The member that leads: the one that reports itself as leader with the
    /// highest raft term among those that answer within 1 s (a cut-off old
    /// leader may still believe it leads until its check-quorum timeout).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn leader(&self) -> Result<usize, BoxError> {
        leader_among(self.member_ports()).await
    }

    /// Waits up to `within` for a leader other than `not`, and returns it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn wait_leader(
        &self,
        not: Option<usize>,
        within: Duration,
    ) -> Result<usize, BoxError> {
        wait_for_leader(|| self.member_ports(), not, within).await
    }
}

/// `docker_etcd_cluster`: replicas connected to all three members of a
/// [`DockerEtcdCluster`], started on first use.
pub type DockerEtcdClusterFactory = DeploymentFactory<DockerEtcdCluster>;

impl EtcdDeployment for DockerEtcdCluster {
    const ROW: &'static str = "docker_etcd_cluster";
    const WHAT: &'static str = "etcd cluster in containers";
    // Only this process reaches the published ports.
    const HAS_CONNECT_URL: bool = false;

    fn start() -> Result<Self, BoxError> {
        DockerEtcdCluster::start()
    }

    fn builder(&self) -> Result<EtcdBuilder, BoxError> {
        DockerEtcdCluster::builder(self)
    }

    fn endpoints(&self) -> Vec<String> {
        DockerEtcdCluster::endpoints(self)
    }

    fn connect_url(&self) -> Option<String> {
        None
    }
}
