//! The `etcd_cluster` factory: every conformance case against a private
//! 3-member cluster, the library connected with all three endpoints.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_etcd::EtcdBackend;

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

/// Replicas are separate `EtcdBackend` connections to one private cluster,
/// started on first use so that filtered runs that skip it do not pay for it.
#[derive(Debug, Default)]
pub struct EtcdClusterFactory {
    cluster: OnceLock<Result<Arc<EtcdCluster>, String>>,
}

/// The cluster factory for this run, or missing when etcd is not on `PATH`.
pub fn cluster_factory() -> Availability<Arc<dyn BackendFactory>> {
    match which("etcd") {
        Some(_) => Availability::Ready(Arc::new(EtcdClusterFactory::default())),
        None => Availability::Missing("etcd is not on PATH".to_owned()),
    }
}

impl EtcdClusterFactory {
    /// The cluster, started on first call.
    pub fn cluster(&self) -> Result<&Arc<EtcdCluster>, BoxError> {
        self.cluster
            .get_or_init(|| {
                EtcdCluster::start()
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| format!("private etcd cluster: {e}").into())
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
impl BackendFactory for EtcdClusterFactory {
    fn connect_url(&self) -> Option<String> {
        Some(self.cluster().ok()?.url())
    }

    fn has_connect_url(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        "etcd_cluster"
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
        Ok(Box::new(
            EtcdSaboteur::connect(&endpoints, lock_etcd::DEFAULT_PREFIX).await?,
        ))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.connect().await?)))
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        server::unreachable()
    }
}
