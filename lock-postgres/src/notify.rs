//! Release notification over `LISTEN`/`NOTIFY`, so waiters wake when a lock
//! is released instead of at their next poll.
//!
//! Every release through this crate sends `NOTIFY lock_release, 'key1:key2'`
//! after unlocking. Each backend keeps one extra connection that listens on
//! that channel. Locks that end otherwise (a session that dies, a `psql`
//! unlock) send nothing; waiters still find them free by polling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{BackendError, ReleaseSignal};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_postgres::Client;

use crate::error::{convert, timed_out};
use crate::session::open_client;
use crate::{AdvisoryKey, PostgresConfig};

/// The channel every release is announced on.
pub(crate) const CHANNEL: &str = "lock_release";

/// The payload announcing the release of `key`.
pub(crate) fn payload(key: AdvisoryKey) -> String {
    format!("{}:{}", key.key1, key.key2)
}

/// Waiters by the payload of the key they wait for.
#[derive(Debug, Default)]
pub(crate) struct Waiters(Mutex<HashMap<String, Arc<Notify>>>);

impl Waiters {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        // One map operation per critical section: poison carries no half-state.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the waiters of the key named by `payload`.
    pub(crate) fn released(&self, payload: &str) {
        if let Some(n) = self.map().remove(payload) {
            n.notify_waiters();
        }
    }

    /// Wakes every waiter (the listening connection ended).
    pub(crate) fn wake_all(&self) {
        for (_, n) in self.map().drain() {
            n.notify_waiters();
        }
    }

    fn register(&self, key: AdvisoryKey) -> Arc<Notify> {
        Arc::clone(self.map().entry(payload(key)).or_default())
    }
}

/// The listening connection, connected on the first subscription.
#[derive(Debug, Default)]
pub(crate) struct ReleaseListener {
    current: tokio::sync::Mutex<Option<Listening>>,
}

#[derive(Debug)]
struct Listening {
    _client: Client,
    driver: JoinHandle<()>,
    waiters: Arc<Waiters>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.driver.abort();
        self.waiters.wake_all();
    }
}

impl ReleaseListener {
    /// Subscribes to releases of `key`. The `LISTEN` has completed and the
    /// waiter is registered when this returns, so no later release is missed.
    pub(crate) async fn subscribe(
        &self,
        cfg: &PostgresConfig,
        key: AdvisoryKey,
    ) -> Result<ReleaseSignal, BackendError> {
        let mut slot = self.current.lock().await;
        let alive = slot.as_ref().is_some_and(|l| !l.driver.is_finished());
        if !alive {
            *slot = None;
            *slot = Some(listen(cfg).await?);
        }
        let waiters = slot
            .as_ref()
            .map(|l| Arc::clone(&l.waiters))
            .unwrap_or_default();
        drop(slot);
        let mut notified = Box::pin(waiters.register(key).notified_owned());
        notified.as_mut().enable();
        Ok(ReleaseSignal::new(notified))
    }
}

async fn listen(cfg: &PostgresConfig) -> Result<Listening, BackendError> {
    let what = "connecting the release listener";
    let waiters = Arc::new(Waiters::default());
    let connect = async {
        let (client, driver) = open_client(cfg, what, Some(Arc::clone(&waiters))).await?;
        client
            .batch_execute(&format!("LISTEN {CHANNEL}"))
            .await
            .map_err(|e| convert("LISTEN", e))?;
        Ok::<_, BackendError>((client, driver))
    };
    let (client, driver) = timeout(cfg.connect_timeout, connect)
        .await
        .map_err(|_| timed_out(what, cfg.connect_timeout))??;
    Ok(Listening {
        _client: client,
        driver,
        waiters,
    })
}
