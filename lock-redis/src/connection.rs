//! The command connection: one multiplexed connection that reconnects after
//! failures, with every call bounded by the operation timeout.

use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lock_core::BackendError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisResult};

use crate::error::{from_redis, timed_out};

/// Commands go through a [`ConnectionManager`], created on first use so the
/// backend can be built outside a runtime and against a server that is down.
pub(crate) struct Connection {
    client: redis::Client,
    target: String,
    connect_timeout: Duration,
    op_timeout: Duration,
    manager: Mutex<Option<ConnectionManager>>,
}

impl Connection {
    pub(crate) fn new(
        client: redis::Client,
        target: String,
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> Self {
        Self {
            client,
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

    fn manager(&self, op: &str) -> Result<ConnectionManager, BackendError> {
        let mut slot = self.manager.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        // No retries inside the manager: a failed connect fails this call at
        // once (fail closed) and the next call tries again. The response
        // timeout matches ours so a stalled connection is replaced.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.op_timeout))
            .set_number_of_retries(0);
        let manager = ConnectionManager::new_lazy_with_config(self.client.clone(), config)
            .map_err(|e| from_redis(e, op, &self.target))?;
        *slot = Some(manager.clone());
        Ok(manager)
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
        F: FnOnce(ConnectionManager) -> Fut,
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
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let manager = self.manager(op)?;
        match tokio::time::timeout(limit, call(manager)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                if e.kind() == ErrorKind::AuthenticationFailed
                    || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
                {
                    self.reset();
                }
                Err(from_redis(e, op, &self.target))
            }
            Err(_) => Err(timed_out(op, &self.target, limit)),
        }
    }
}
