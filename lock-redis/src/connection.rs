//! The command connection: one multiplexed connection that reconnects after
//! failures, with every call bounded by the operation timeout.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::BackendError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind};
use tracing::debug;

use crate::cluster::Link;
use crate::cluster_link::ClusterLink;
use crate::error::{from_redis, timed_out};
use crate::sentinel::Resolver;

/// Where connections go: one fixed server, the primary the sentinels name
/// at the time of connecting, or a Redis Cluster.
#[derive(Clone)]
pub(crate) enum Source {
    Direct(Box<redis::Client>),
    Sentinel(Arc<Resolver>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl Source {
    /// A client for the server to use now.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub(crate) async fn client(&self) -> Result<redis::Client, BackendError> {
        match self {
            Self::Direct(c) => Ok((**c).clone()),
            Self::Sentinel(r) => r.primary().await,
            Self::Cluster(_) => Err(BackendError::new(
                lock_core::BackendErrorKind::Config,
                "a Redis Cluster has no single server to connect to",
            )),
        }
    }
}

/// Commands go through a [`ConnectionManager`] (or, for a cluster, a
/// cluster connection), created on first use so the backend can be built
/// outside a runtime and against a server that is down.
pub(crate) struct Connection {
    source: Source,
    target: String,
    connect_timeout: Duration,
    op_timeout: Duration,
    manager: Mutex<Option<Link>>,
}

impl Connection {
    pub(crate) fn new(
        source: Source,
        target: String,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Self {
        Self {
            source,
            target,
            connect_timeout,
            op_timeout,
            manager: Mutex::new(None),
        }
    }

    pub(crate) fn target(&self) -> &str {
        &self.target
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    pub(crate) fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    async fn manager(&self, op: &str) -> Result<Link, BackendError> {
        if let Some(m) = self
            .manager
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            return Ok(m.clone());
        }
        if let Source::Cluster(client) = &self.source {
            // The cluster client follows redirects and reconnects to nodes
            // by itself; it fetches the slot map from the seeds here. Our
            // link sends again what the cluster did not run, for as long as
            // a call may take.
            let cluster = client
                .get_async_connection()
                .await
                .map_err(|e| from_redis(e, op, &self.target))?;
            let mut slot = self.manager.lock().unwrap_or_else(PoisonError::into_inner);
            return Ok(slot
                .get_or_insert(Link::Cluster(ClusterLink::new(cluster, self.op_timeout)))
                .clone());
        }
        let client = self.source.client().await?;
        // No retries inside the manager: a failed connect fails this call at
        // once (fail closed) and the next call tries again. The response
        // timeout matches ours so a stalled connection is replaced.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.op_timeout))
            .set_number_of_retries(0);
        let manager = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| from_redis(e, op, &self.target))?;
        if matches!(self.source, Source::Sentinel(_)) {
            // The sentinels may name a server that was demoted a moment ago;
            // a replica would answer reads with stale data.
            check_primary(manager.clone(), op, &self.target).await?;
        }
        let mut slot = self.manager.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(slot.get_or_insert(Link::Single(manager)).clone())
    }

    /// Forgets the manager after a failure it would never recover from by
    /// itself (refused credentials are not retried by the client).
    fn reset(&self) {
        *self.manager.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Runs `call` on the connection within the operation timeout, including
    /// any reconnect it has to wait for.
    pub(crate) async fn run<T, F, Fut>(&self, op: &str, call: F) -> Result<T, BackendError>
    where
        F: FnOnce(Link) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.run_within(op, self.op_timeout, call).await
    }

    /// [`Connection::run`] with another time limit.
    pub(crate) async fn run_within<T, F, Fut>(
        &self,
        op: &str,
        limit: Duration,
        call: F,
    ) -> Result<T, BackendError>
    where
        F: FnOnce(Link) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let sentinel = matches!(self.source, Source::Sentinel(_));
        let attempt = async {
            let manager = self.manager(op).await?;
            Ok::<_, BackendError>(call(manager).await)
        };
        match tokio::time::timeout(limit, attempt).await {
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(e))) => {
                if e.kind() == ErrorKind::AuthenticationFailed
                    || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
                    || (sentinel && primary_may_have_moved(&e))
                {
                    debug!(server = %self.target, error = %e, "dropping the connection; the next call connects afresh");
                    self.reset();
                }
                Err(from_redis(e, op, &self.target))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => {
                if sentinel {
                    self.reset();
                }
                Err(timed_out(op, &self.target, limit))
            }
        }
    }
}

/// Whether after `e` the sentinels should be asked again: the server is
/// gone, stalled, demoted to a replica, not serving, or cut off from its
/// replicas (`NOREPLICAS`, under `min-replicas-to-write`).
fn primary_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.code() == Some("NOREPLICAS")
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
            )
        )
}

/// Refuses a server whose `ROLE` is not `master`.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
async fn check_primary(
    mut manager: ConnectionManager,
    op: &str,
    target: &str,
) -> Result<(), BackendError> {
    let role: Vec<redis::Value> = redis::cmd("ROLE")
        .query_async(&mut manager)
        .await
        .map_err(|e| from_redis(e, op, target))?;
    match role.first() {
        Some(redis::Value::BulkString(r)) if r.as_slice() == b"master" => Ok(()),
        Some(redis::Value::SimpleString(r)) if r == "master" => Ok(()),
        _ => Err(BackendError::unavailable(format!(
            "{op} on {target}: the server the sentinels named is not a primary (a failover may be under way); locks are never taken on a replica"
        ))),
    }
}
