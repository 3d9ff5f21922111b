//! The `redis_sentinel` factory: every conformance case against a private
//! Sentinel deployment, the library connected through the sentinels.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, TickStore};
use lock_redis::RedisBackend;

use super::sentinel::{SentinelSet, MASTER_NAME};
use super::{config_for, sentinel_capabilities, unreachable, RedisSaboteur, TIMING};
use crate::harness::{which, Availability};
use crate::{BackendFactory, BoxError, Saboteur, Timing};

/// Replicas are separate `RedisBackend`s through the sentinels of one
/// private deployment, started on first use so that filtered runs that skip
/// it do not pay for it.
#[derive(Debug)]
pub struct SentinelFactory {
    prefix: String,
    set: OnceLock<Result<Arc<SentinelSet>, String>>,
    replica_ack: Option<(u8, Duration)>,
}

/// The Sentinel factory for this run (keys under `prefix`), or missing when
/// `redis-server` is not on `PATH`.
pub fn sentinel_factory(prefix: &str) -> Availability<Arc<SentinelFactory>> {
    match which("redis-server") {
        Some(_) => Availability::Ready(Arc::new(SentinelFactory::new(prefix))),
        None => Availability::Missing("redis-server is not on PATH".to_owned()),
    }
}

impl SentinelFactory {
    /// A factory whose deployment is not started yet.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            set: OnceLock::new(),
            replica_ack: None,
        }
    }

    /// Makes every backend it builds wait for `replicas` acknowledgements
    /// within `timeout` (`RedisBuilder::with_replica_ack`).
    pub fn with_replica_ack(mut self, replicas: u8, timeout: Duration) -> Self {
        self.replica_ack = Some((replicas, timeout));
        self
    }

    /// The acknowledgement its backends ask for, if any.
    pub fn replica_ack(&self) -> Option<(u8, Duration)> {
        self.replica_ack
    }

    /// The deployment, started on first call.
    pub fn set(&self) -> Result<&Arc<SentinelSet>, BoxError> {
        self.set
            .get_or_init(|| {
                SentinelSet::start()
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| format!("private Sentinel deployment: {e}").into())
    }

    /// The deployment, if a case started it.
    pub fn started(&self) -> Option<&Arc<SentinelSet>> {
        self.set.get()?.as_ref().ok()
    }

    /// The key prefix every replica uses.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A backend through the sentinels, with the test profile's timeouts.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call leaves no connection behind.
    pub async fn connect(&self) -> Result<RedisBackend, BoxError> {
        let url = self.set()?.url();
        let mut config = config_for(&url)?.with_key_prefix(&self.prefix);
        if let Some((n, t)) = self.replica_ack {
            config = config.with_replica_ack(n, t);
        }
        Ok(config.connect().await?)
    }
}

#[async_trait]
impl BackendFactory for SentinelFactory {
    fn connect_url(&self) -> Option<String> {
        Some(self.set().ok()?.url())
    }

    fn has_connect_url(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        "redis_sentinel"
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
        let set = Arc::clone(self.set()?);
        let primary = tokio::task::spawn_blocking(move || set.primary_port()).await??;
        Ok(Box::new(
            RedisSaboteur::connect(&format!("redis://127.0.0.1:{primary}"), &self.prefix).await?,
        ))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.connect().await?)))
    }

    async fn unreachable(&self) -> Option<Arc<dyn LockBackend>> {
        unreachable(|port| format!("redis+sentinel://127.0.0.1:{port}/{MASTER_NAME}"))
    }
}
