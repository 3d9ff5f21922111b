//! The raw protocol floor of each backend: the same work done with the
//! backend's own client crate and no library on top, measured in the same run.

mod etcd;
mod postgres;
mod redis;
mod rslock;

pub(crate) use postgres::query_one as postgres_query_one;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance_tests::backends::redis::RedisFactory;
use conformance_tests::{BackendFactory, BoxError};
use lock_core::{LockBackend, LockName, OwnerToken};

/// One uncontended acquire + release cycle without the library.
#[async_trait]
pub(crate) trait Floor: Send + Sync {
    /// What the floor does and over which connections, for the table.
    fn describe(&self) -> String;
    /// One cycle on `name`, by the `task`-th concurrent task.
    async fn cycle(&self, task: usize, name: &LockName) -> Result<(), BoxError>;
}

/// Where a backend's floor gets its server from (the factory's own).
#[derive(Debug, Clone)]
pub(crate) enum FloorSource {
    /// No separate client (memory): the backend's single attempts.
    Trait,
    /// `redis` crate on this URL, keys under this prefix; `unfenced` is the
    /// library on the same server without fencing tokens, which is what
    /// the peer (rslock, which has none) is compared with.
    Redis {
        url: String,
        prefix: String,
        unfenced: Arc<RedisFactory>,
    },
    /// `tokio-postgres` on this URL.
    Postgres { url: String },
    /// `etcd-client` on these endpoints.
    Etcd { endpoints: Vec<String> },
}

impl FloorSource {
    /// How many leases the renewal measurement can hold at once. Postgres
    /// keeps every session's advisory locks in one shared table of
    /// `max_locks_per_transaction × (max_connections +
    /// max_prepared_transactions)` slots (6,400 with the defaults; past it,
    /// `53200 out of shared memory`). The library's leases and the batched
    /// floor's are held at the same time, so each gets under half of what
    /// the server reports, leaving room for other sessions.
    pub(crate) async fn max_leases(&self) -> Result<Option<usize>, BoxError> {
        match self {
            Self::Postgres { url } => Ok(Some(postgres::lock_table_slots(url).await? * 2 / 5)),
            _ => Ok(None),
        }
    }
}

/// The Postgres floor on `url` (for the Postgres-only rows).
pub(crate) async fn postgres_floor(url: &str) -> Result<Arc<dyn Floor>, BoxError> {
    Ok(Arc::new(postgres::PgFloor::connect(url).await?))
}

/// A second raw floor beside the first, where the backend has one: etcd's
/// shared-lease cycle (one long-lived lease for every lock), next to its
/// lease-per-lock floor. Named as the figures call it.
pub(crate) async fn second_floor(
    source: &FloorSource,
) -> Result<Option<(&'static str, Arc<dyn Floor>)>, BoxError> {
    Ok(match source {
        FloorSource::Etcd { endpoints } => Some((
            "shared-lease floor",
            Arc::new(etcd::EtcdSharedFloor::connect(endpoints).await?),
        )),
        _ => None,
    })
}

/// Another library doing the same cycle on `factory`'s server, if there is
/// one to compare with (Redis: `rslock`).
pub(crate) fn peer_for(
    factory: &Arc<dyn BackendFactory>,
    source: &FloorSource,
) -> Option<Arc<dyn Floor>> {
    match source {
        FloorSource::Redis { url, prefix, .. } => Some(Arc::new(rslock::RslockPeer::new(
            url,
            prefix,
            factory.timing().ttl,
        ))),
        _ => None,
    }
}

/// For backends without a separate client (memory): the backend's own
/// single attempts through the trait, without `Locker`.
struct TraitFloor {
    backend: Arc<dyn LockBackend>,
    ttl: Duration,
}

#[async_trait]
impl Floor for TraitFloor {
    fn describe(&self) -> String {
        "LockBackend::try_acquire + release, no Locker".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let owner = OwnerToken::generate()?;
        self.backend.try_acquire(name, &owner, self.ttl).await?;
        self.backend.release(name, &owner).await?;
        Ok(())
    }
}

/// The floor for `factory`'s backend.
pub(crate) async fn floor_for(
    factory: &Arc<dyn BackendFactory>,
    source: &FloorSource,
) -> Result<Arc<dyn Floor>, BoxError> {
    let ttl = factory.timing().ttl;
    Ok(match source {
        FloorSource::Trait => Arc::new(TraitFloor {
            backend: factory.replica().await?,
            ttl,
        }),
        FloorSource::Redis { url, prefix, .. } => {
            Arc::new(redis::RedisFloor::connect(url, prefix, ttl).await?)
        }
        FloorSource::Postgres { url } => Arc::new(postgres::PgFloor::connect(url).await?),
        FloorSource::Etcd { endpoints } => {
            Arc::new(etcd::EtcdFloor::connect(endpoints, ttl).await?)
        }
    })
}
