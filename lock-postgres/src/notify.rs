//! Release notification over `LISTEN`/`NOTIFY`, so waiters wake when a lock
//! is released instead of at their next poll.
//!
//! Every release through this crate sends `NOTIFY lock_release, 'key1:key2'`
//! after unlocking. Each backend keeps one extra connection that listens on
//! that channel. Locks that end otherwise (a session that dies, a `psql`
//! unlock) send nothing; waiters still find them free by polling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{backend::ReleaseSignal, BackendError};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_postgres::Client;

use crate::error::{convert, timed_out};
use crate::session::{open_client, Watch};
use crate::{AdvisoryKey, PostgresConfig};

/// The channel every release is announced on.
pub(crate) const CHANNEL: &str = "lock_release";

/// The payload announcing the release of `key`.
pub(crate) fn payload(key: AdvisoryKey) -> String {
    format!("{}:{}", key.key1, key.key2)
}

/// Waiters by the payload of the key they wait for.
///
/// An entry lives exactly as long as a signal for its key does: a release
/// (or the end of the listening connection) removes it, and so does the
/// last of its signals being dropped (a wait that timed out or was
/// cancelled, a waiter that got the lock after it ended without a release
/// announcement). The map holds O(live waiters) entries, however many waits
/// came and went.
#[derive(Debug, Default)]
pub(crate) struct Waiters(Mutex<HashMap<String, Entry>>);

/// The waiters of one key: their wake-up, and how many signals share it.
#[derive(Debug, Default)]
struct Entry {
    notify: Arc<Notify>,
    signals: usize,
}

impl Waiters {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // One map operation per critical section: poison carries no half-state.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the waiters of the key named by `payload`.
    pub(crate) fn released(&self, payload: &str) {
        if let Some(e) = self.map().remove(payload) {
            e.notify.notify_waiters();
        }
    }

    /// Wakes every waiter (the listening connection ended).
    pub(crate) fn wake_all(&self) {
        for (_, e) in self.map().drain() {
            e.notify.notify_waiters();
        }
    }

    /// A signal that completes at the next release of `key` (or when the
    /// listening connection ends), registered before this returns.
    pub(crate) fn signal(self: &Arc<Self>, key: AdvisoryKey) -> ReleaseSignal {
        let payload = payload(key);
        let notify = {
            let mut map = self.map();
            let entry = map.entry(payload.clone()).or_default();
            entry.signals += 1;
            Arc::clone(&entry.notify)
        };
        let registration = Registration {
            waiters: Arc::clone(self),
            payload,
            notify: Arc::clone(&notify),
        };
        let mut notified = Box::pin(notify.notified_owned());
        // Enabled now, so a release between this call and the first poll
        // still wakes the signal.
        notified.as_mut().enable();
        ReleaseSignal::new(async move {
            let _registration = registration;
            notified.await;
        })
    }

    /// How many keys have waiters registered.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

/// One signal's share of its key's entry, given back when the signal is
/// dropped, woken or not.
struct Registration {
    waiters: Arc<Waiters>,
    payload: String,
    notify: Arc<Notify>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.waiters.map();
        // A release may have replaced the entry since; only ours is counted.
        if let Some(e) = map.get_mut(&self.payload) {
            if Arc::ptr_eq(&e.notify, &self.notify) {
                e.signals = e.signals.saturating_sub(1);
                if e.signals == 0 {
                    map.remove(&self.payload);
                }
            }
        }
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
        Ok(waiters.signal(key))
    }
}

#[cfg(feature = "test-util")]
impl ReleaseListener {
    /// How many keys have waiters registered (0 before the first subscription).
    pub(crate) async fn waiting_keys(&self) -> usize {
        self.current
            .lock()
            .await
            .as_ref()
            .map_or(0, |l| l.waiters.len())
    }
}

async fn listen(cfg: &PostgresConfig) -> Result<Listening, BackendError> {
    let what = "connecting the release listener";
    let waiters = Arc::new(Waiters::default());
    let connect = async {
        let (client, driver) =
            open_client(cfg, what, Watch::Listener(Arc::clone(&waiters))).await?;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn key(i: u32) -> AdvisoryKey {
        AdvisoryKey::new(7, i32::from_ne_bytes(i.to_ne_bytes()))
    }

    #[tokio::test(start_paused = true)]
    async fn timed_out_waits_leave_no_entries() {
        let waiters = Arc::new(Waiters::default());
        let live: Vec<ReleaseSignal> = (0..3).map(|i| waiters.signal(key(i))).collect();
        for i in 0..100_000u32 {
            // Distinct keys, and repeats of the live ones.
            let signal = waiters.signal(key(i % 50_000));
            let waited = tokio::time::timeout(Duration::from_millis(1), signal).await;
            assert!(waited.is_err(), "nothing was released");
        }
        assert_eq!(waiters.len(), live.len(), "one entry per live waiter's key");
        waiters.released(&payload(key(1)));
        assert_eq!(waiters.len(), 2);
        drop(live);
        assert_eq!(waiters.len(), 0, "no entry outlives its waiters");
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_wakes_every_waiter_of_its_key_only() {
        let waiters = Arc::new(Waiters::default());
        let (a1, a2, b) = (
            waiters.signal(key(1)),
            waiters.signal(key(1)),
            waiters.signal(key(2)),
        );
        waiters.released(&payload(key(1)));
        let woken = tokio::time::timeout(Duration::from_secs(1), async {
            a1.await;
            a2.await;
        })
        .await;
        assert!(woken.is_ok(), "both waiters of the released key wake");
        assert!(tokio::time::timeout(Duration::from_secs(1), b)
            .await
            .is_err());
        assert_eq!(waiters.len(), 0, "the last waiter gone, its entry went too");
    }
}
