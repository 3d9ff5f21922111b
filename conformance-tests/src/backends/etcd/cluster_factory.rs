//! The 3-member cluster rows: every conformance case against a cluster of
//! processes (`etcd_cluster`) or of containers (`docker_etcd_cluster`), the
//! library connected with all three endpoints. One factory serves both: a
//! deployment differs only in how it is started and reached.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_etcd::{EtcdBackend, EtcdBuilder};

use super::cluster::EtcdCluster;
use super::{server, EtcdSaboteur, TTL};
use crate::harness::{which, Availability};
use crate::{BackendFactory, BoxError, Saboteur, Timing};

/// The timing of a 3-member cluster, processes or containers: the single
/// member's TTL, and its slack plus a raft round trip to two followers on
/// the same loaded 2-core machine.
pub(crate) const CLUSTER_TIMING: Timing = Timing {
    ttl: TTL,
    tolerance: Duration::from_millis(900),
    paused_clock: false,
};

/// A 3-member etcd cluster a [`DeploymentFactory`] starts and connects to.
pub trait EtcdDeployment: std::fmt::Debug + Send + Sync + Sized + 'static {
    /// The row: the prefix of its test names.
    const ROW: &'static str;
    /// What it is, for the error when it cannot be started.
    const WHAT: &'static str;
    /// Whether [`EtcdDeployment::connect_url`] gives a URL, known without
    /// starting it.
    const HAS_CONNECT_URL: bool;

    /// Starts it and waits until every member serves clients.
    ///
    /// # Errors
    ///
    /// When it cannot be started.
    fn start() -> Result<Self, BoxError>;

    /// A builder over every member, with the suite's timeouts.
    ///
    /// # Errors
    ///
    /// If the members' URL does not parse.
    fn builder(&self) -> Result<EtcdBuilder, BoxError>;

    /// The client endpoints of the members, in order.
    fn endpoints(&self) -> Vec<String>;

    /// The URL another process reaches it by, for the cases that run the
    /// library in a child process; `None` when only this process can.
    fn connect_url(&self) -> Option<String>;
}

impl EtcdDeployment for EtcdCluster {
    const ROW: &'static str = "etcd_cluster";
    const WHAT: &'static str = "private etcd cluster";
    const HAS_CONNECT_URL: bool = true;

    fn start() -> Result<Self, BoxError> {
        EtcdCluster::start()
    }

    fn builder(&self) -> Result<EtcdBuilder, BoxError> {
        EtcdCluster::builder(self)
    }

    fn endpoints(&self) -> Vec<String> {
        EtcdCluster::endpoints(self)
    }

    fn connect_url(&self) -> Option<String> {
        Some(self.url())
    }
}

/// Replicas are separate `EtcdBackend` connections to one deployment `D`,
/// started on first use so that filtered runs that skip it do not pay for
/// it.
#[derive(Debug)]
pub struct DeploymentFactory<D> {
    cluster: OnceLock<Result<Arc<D>, String>>,
}

/// The `etcd_cluster` factory: a cluster of private processes.
pub type EtcdClusterFactory = DeploymentFactory<EtcdCluster>;

impl<D> Default for DeploymentFactory<D> {
    fn default() -> Self {
        Self {
            cluster: OnceLock::new(),
        }
    }
}

/// The cluster factory for this run, or missing when etcd is not on `PATH`.
pub fn cluster_factory() -> Availability<Arc<dyn BackendFactory>> {
    match which("etcd") {
        Some(_) => Availability::Ready(Arc::new(EtcdClusterFactory::default())),
        None => Availability::Missing("etcd is not on PATH".to_owned()),
    }
}

impl<D: EtcdDeployment> DeploymentFactory<D> {
    /// The cluster, started on first call.
    ///
    /// # Errors
    ///
    /// When it cannot be started (on this call or an earlier one).
    pub fn cluster(&self) -> Result<&Arc<D>, BoxError> {
        self.cluster
            .get_or_init(|| D::start().map(Arc::new).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| format!("{}: {e}", D::WHAT).into())
    }

    /// A backend connected with all three endpoints; waits for a freshly
    /// started cluster to answer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`server::connect_when_ready`].
    pub async fn connect(&self) -> Result<EtcdBackend, BoxError> {
        let builder = self.cluster()?.builder()?;
        server::connect_when_ready(builder).await
    }
}

#[async_trait]
impl<D: EtcdDeployment> BackendFactory for DeploymentFactory<D> {
    fn connect_url(&self) -> Option<String> {
        self.cluster().ok()?.connect_url()
    }

    fn has_connect_url(&self) -> bool {
        D::HAS_CONNECT_URL
    }

    fn name(&self) -> &str {
        D::ROW
    }

    fn capabilities(&self) -> Capabilities {
        super::capabilities()
    }

    fn timing(&self) -> Timing {
        CLUSTER_TIMING
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        let endpoints = self.cluster()?.endpoints();
        Ok(Box::new(EtcdSaboteur::connect_default(&endpoints).await?))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.connect().await?)))
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        server::unreachable()
    }
}
