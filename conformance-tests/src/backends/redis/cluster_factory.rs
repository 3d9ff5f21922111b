//! The `redis_cluster` factory: every conformance case against a private
//! 3-primary, 3-replica Redis Cluster, the library connected through its
//! seed nodes.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_redis::{RedisBackend, RedisBuilder};

use super::cluster::ClusterSet;
use super::{capabilities_of, config_for, unreachable, RedisSaboteur, TIMING};
use crate::harness::{which, Availability};
use crate::{BackendFactory, BoxError, Saboteur, Timing};

/// Replicas are separate `RedisBackend`s on one private cluster, started on
/// first use (once per test binary) so that filtered runs that skip it do
/// not pay for it.
#[derive(Debug)]
pub struct ClusterFactory {
    prefix: String,
    set: OnceLock<Result<Arc<ClusterSet>, String>>,
}

/// The cluster factory for this run (keys under `prefix`), or missing when
/// `redis-server` or `redis-cli` is not on `PATH`.
pub fn cluster_factory(prefix: &str) -> Availability<Arc<ClusterFactory>> {
    match (which("redis-server"), which("redis-cli")) {
        (Some(_), Some(_)) => Availability::Ready(Arc::new(ClusterFactory::new(prefix))),
        _ => Availability::Missing("redis-server or redis-cli is not on PATH".to_owned()),
    }
}

impl ClusterFactory {
    /// A factory whose cluster is not started yet.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            set: OnceLock::new(),
        }
    }

    /// The cluster, started on first call.
    pub fn set(&self) -> Result<&Arc<ClusterSet>, BoxError> {
        self.set
            .get_or_init(|| ClusterSet::start().map(Arc::new).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| format!("private Redis Cluster: {e}").into())
    }

    /// The cluster, if a case started it.
    pub fn started(&self) -> Option<&Arc<ClusterSet>> {
        self.set.get()?.as_ref().ok()
    }

    /// The key prefix every replica uses.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The configuration replicas use.
    pub fn config(&self) -> Result<RedisBuilder, BoxError> {
        Ok(config_for(&self.set()?.url())?.with_key_prefix(&self.prefix))
    }

    /// A backend on the cluster, with the test profile's timeouts.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call leaves no connection behind.
    pub async fn connect(&self) -> Result<RedisBackend, BoxError> {
        Ok(self.config()?.connect().await?)
    }

    /// A plain (non-library) cluster client's saboteur over this cluster.
    pub async fn saboteur(&self) -> Result<RedisSaboteur, BoxError> {
        RedisSaboteur::connect_cluster(&self.set()?.node_urls(), &self.prefix).await
    }
}

#[async_trait]
impl BackendFactory for ClusterFactory {
    fn connect_url(&self) -> Option<String> {
        Some(self.set().ok()?.url())
    }

    fn has_connect_url(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        "redis_cluster"
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_of(
            RedisBuilder::from_url("redis+cluster://127.0.0.1:1").and_then(RedisBuilder::build),
        )
    }

    fn timing(&self) -> Timing {
        TIMING
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.connect().await?))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        Ok(Box::new(ClusterFactory::saboteur(self).await?))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.connect().await?)))
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        unreachable(|port| format!("redis+cluster://127.0.0.1:{port}"))
    }
}
