//! Release notification over `LISTEN`/`NOTIFY`, so waiters wake when a lock
//! is released instead of at their next poll.
//!
//! Each backend keeps one extra connection that listens on the channel
//! `lock_release`. While a process waits for a key, that connection holds a
//! shared advisory lock on the key's *wait marker* ([`wait_marker`]); a
//! release through this crate sends `NOTIFY lock_release, 'key1:key2'` in
//! its unlock statement only if it cannot take the marker exclusively, that
//! is, only if someone waits. `NOTIFY` serialises every notifying commit on
//! the server, so a release nobody waits for does not pay for it. Locks that
//! end otherwise (a session that dies, a `psql` unlock) send nothing;
//! waiters still find them free by polling, as they do a release that
//! raced a waiter's first subscription (best effort: the wait is bounded by
//! the poll either way).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{backend::ReleaseSignal, BackendError};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_postgres::Client;
use tracing::debug;

use crate::error::{convert, timed_out};
use crate::session::{open_client, Watch};
use crate::{AdvisoryKey, PostgresConfig};

/// The channel every release is announced on.
pub(crate) const CHANNEL: &str = "lock_release";

/// The payload announcing the release of `key`.
pub(crate) fn payload(key: AdvisoryKey) -> String {
    format!("{}:{}", key.key1, key.key2)
}

/// Flips the first half of a key into the wait markers' own space.
const MARKER_SALT: i32 = 0x5741_4954; // "WAIT"

/// The `bigint` advisory lock a waiter's listener holds shared while it
/// waits for `key`. The `bigint` form shows in `pg_locks` with
/// `objsubid = 1`, apart from the `(int4, int4)` locks themselves
/// (`objsubid = 2`), and its high half is salted so that it does not read
/// as `key` there either.
pub(crate) fn wait_marker(key: AdvisoryKey) -> i64 {
    let high = i64::from(key.key1 ^ MARKER_SALT) << 32;
    high | i64::from(u32::from_ne_bytes(key.key2.to_ne_bytes()))
}

const MARK: &str = "SELECT pg_advisory_lock_shared($1)";
const UNMARK: &str = "SELECT pg_advisory_unlock_shared($1)";

/// Waiters by the payload of the key they wait for.
///
/// An entry lives exactly as long as a signal for its key does: a release
/// (or the end of the listening connection) removes it, and so does the
/// last of its signals being dropped (a wait that timed out or was
/// cancelled, a waiter that got the lock after it ended without a release
/// announcement). The map holds O(live waiters) entries, however many waits
/// came and went.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<String, Entry>>,
    /// Where the markers of entries that went are sent to be unlocked (on
    /// the listening connection); none in unit tests.
    unmark: Option<mpsc::UnboundedSender<i64>>,
}

/// The waiters of one key: their wake-up, how many signals share it, and
/// the wait marker it holds, once taken.
#[derive(Debug, Default)]
struct Entry {
    notify: Arc<Notify>,
    signals: usize,
    marker: Option<i64>,
}

impl Waiters {
    fn with_unmark(unmark: mpsc::UnboundedSender<i64>) -> Self {
        Self {
            map: Mutex::default(),
            unmark: Some(unmark),
        }
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // One map operation per critical section: poison carries no half-state.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives the marker of an entry that went back to the server.
    fn unmark(&self, marker: Option<i64>) {
        if let (Some(m), Some(tx)) = (marker, &self.unmark) {
            // A closed channel means the connection, and its locks, are gone.
            let _ = tx.send(m);
        }
    }

    /// Wakes the waiters of the key named by `payload`.
    pub(crate) fn released(&self, payload: &str) {
        let gone = self.map().remove(payload);
        if let Some(e) = gone {
            e.notify.notify_waiters();
            self.unmark(e.marker);
        }
    }

    /// Records that the entry `notify` belongs to holds `marker` now; if
    /// that entry went meanwhile, the marker goes back at once.
    fn marked(&self, payload: &str, notify: &Arc<Notify>, marker: i64) {
        let kept = {
            let mut map = self.map();
            match map.get_mut(payload) {
                Some(e) if Arc::ptr_eq(&e.notify, notify) => {
                    e.marker = Some(marker);
                    true
                }
                _ => false,
            }
        };
        if !kept {
            self.unmark(Some(marker));
        }
    }

    /// Wakes every waiter (the listening connection ended, and its
    /// markers with it).
    pub(crate) fn wake_all(&self) {
        for (_, e) in self.map().drain() {
            e.notify.notify_waiters();
        }
    }

    /// A signal that completes at the next release of `key` (or when the
    /// listening connection ends), registered before this returns.
    #[cfg(test)]
    pub(crate) fn signal(self: &Arc<Self>, key: AdvisoryKey) -> ReleaseSignal {
        self.register(key).0
    }

    /// [`Waiters::signal`], and the new entry's wake-up if this signal is
    /// its key's first (whose caller takes the wait marker).
    fn register(self: &Arc<Self>, key: AdvisoryKey) -> (ReleaseSignal, Option<Arc<Notify>>) {
        let payload = payload(key);
        let (notify, first) = {
            let mut map = self.map();
            let entry = map.entry(payload.clone()).or_default();
            entry.signals += 1;
            (Arc::clone(&entry.notify), entry.signals == 1)
        };
        let registration = Registration {
            waiters: Arc::clone(self),
            payload,
            notify: Arc::clone(&notify),
        };
        let mut notified = Box::pin(Arc::clone(&notify).notified_owned());
        // Enabled now, so a release between this call and the first poll
        // still wakes the signal.
        notified.as_mut().enable();
        let signal = ReleaseSignal::new(async move {
            let _registration = registration;
            notified.await;
        });
        (signal, first.then_some(notify))
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
        let gone = {
            let mut map = self.waiters.map();
            // A release may have replaced the entry since; only ours is counted.
            match map.get_mut(&self.payload) {
                Some(e) if Arc::ptr_eq(&e.notify, &self.notify) => {
                    e.signals = e.signals.saturating_sub(1);
                    if e.signals == 0 {
                        map.remove(&self.payload)
                    } else {
                        None
                    }
                }
                _ => None,
            }
        };
        if let Some(e) = gone {
            self.waiters.unmark(e.marker);
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
    client: Arc<Client>,
    driver: JoinHandle<()>,
    /// Unlocks the markers of entries that went, in order, on `client`.
    unmarker: JoinHandle<()>,
    waiters: Arc<Waiters>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.driver.abort();
        self.unmarker.abort();
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
        let Some((waiters, client)) = slot
            .as_ref()
            .map(|l| (Arc::clone(&l.waiters), Arc::clone(&l.client)))
        else {
            return Err(BackendError::unavailable("the release listener is gone"));
        };
        drop(slot);
        let (signal, first) = waiters.register(key);
        if let Some(notify) = first {
            // Releasers announce only while the marker is held: take it
            // before the caller's next attempt. A failure costs only the
            // announcement (the waiter still polls), not the wait.
            let marker = wait_marker(key);
            match timeout(cfg.statement_timeout, client.execute(MARK, &[&marker])).await {
                Ok(Ok(_)) => waiters.marked(&payload(key), &notify, marker),
                Ok(Err(e)) => debug!(error = %e, "taking a wait marker failed; the wait polls"),
                Err(_) => debug!("taking a wait marker timed out; the wait polls"),
            }
        }
        Ok(signal)
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
    let (unmark, mut markers) = mpsc::unbounded_channel();
    let waiters = Arc::new(Waiters::with_unmark(unmark));
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
    let client = Arc::new(client);
    let on = Arc::clone(&client);
    let unmarker = tokio::spawn(async move {
        while let Some(marker) = markers.recv().await {
            if let Err(e) = on.execute(UNMARK, &[&marker]).await {
                // The connection ended, and every marker with it.
                debug!(error = %e, "giving a wait marker back failed");
                break;
            }
        }
    });
    Ok(Listening {
        client,
        driver,
        unmarker,
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
