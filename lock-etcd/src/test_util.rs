//! Test hooks, behind the `test-util` feature: pause points inside
//! renewals (between a renewal's keep-alive and its read of the key) and
//! inside acquires (between the proof that the shared lease lives and the
//! record of the hold, and after that record), so a test can run another
//! operation there; and a put that reaches the server late, after calls
//! sent later. Not part of the API.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{KvClient, Txn, TxnResponse};
use lock_core::LockName;
use tokio::sync::{watch, Notify};

use crate::connection::{Connected, Inner};

/// Where an armed pause waits: told when a call arrives, opened to let
/// it go on.
#[derive(Debug)]
pub(crate) struct Gate {
    reached: Arc<Notify>,
    open: watch::Receiver<bool>,
}

impl Gate {
    /// Says the call arrived, then waits until the pause is resumed or
    /// dropped.
    async fn pass(mut self) {
        self.reached.notify_one();
        // An error means the pause was dropped: go on.
        let _ = self.open.wait_for(|open| *open).await;
    }
}

/// One pause point of one backend instance (shared by its clones): the
/// gate armed there, and the lock it is for (`None`: any call).
#[derive(Debug, Default)]
pub(crate) struct PauseSlot(Mutex<Option<(Option<LockName>, Gate)>>);

impl PauseSlot {
    fn arm(&self, name: Option<LockName>) -> Pause {
        let reached = Arc::new(Notify::new());
        let (open, rx) = watch::channel(false);
        let gate = Gate {
            reached: Arc::clone(&reached),
            open: rx,
        };
        // One assignment per critical section: a poisoned slot is consistent.
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some((name, gate));
        Pause { reached, open }
    }

    /// The armed gate, taken, if it is for any call or for `name`.
    fn take_for(&self, name: Option<&LockName>) -> Option<Gate> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.as_ref() {
            Some((Some(armed), _)) if Some(armed) != name => None,
            _ => slot.take().map(|(_, gate)| gate),
        }
    }
}

/// The name whose next acquire's put reaches the server late, and by how
/// much (one per backend instance, shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct LatePut(Mutex<Option<(LockName, Duration)>>);

impl LatePut {
    fn take_for(&self, name: &LockName) -> Option<Duration> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.as_ref() {
            Some((armed, by)) if armed == name => {
                let by = *by;
                *slot = None;
                Some(by)
            }
            _ => None,
        }
    }
}

/// A pause armed with
/// [`EtcdBackend::pause_next_renewal_before_read`](crate::EtcdBackend::pause_next_renewal_before_read)
/// or one of the acquire pauses
/// ([`EtcdBackend::pause_next_acquire_before_record`](crate::EtcdBackend::pause_next_acquire_before_record),
/// [`EtcdBackend::pause_next_acquire_after_record`](crate::EtcdBackend::pause_next_acquire_after_record)).
/// The call it catches stays parked until [`Pause::resume`] is called or
/// the pause is dropped; the backend's request timeout still bounds it.
#[derive(Debug)]
pub struct Pause {
    reached: Arc<Notify>,
    open: watch::Sender<bool>,
}

impl Pause {
    /// Completes once a call is parked at the pause point.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call loses no arrival; the next call sees it.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the parked call (or the next one to arrive) go on.
    pub fn resume(self) {
        // Dropping the sender opens the gate too; sending says it outright.
        let _ = self.open.send(true);
    }
}

impl Connected {
    /// Test hook: the put of the next acquire of `name` on this instance is
    /// sent `by` later, from a task of its own (see [`Inner::send_put`]).
    pub(crate) fn delay_next_put(&self, name: &LockName, by: Duration) {
        *self
            .inner
            .late_put
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((name.clone(), by));
    }

    /// Test hook: the next renewal of this instance (single or batch) that
    /// has sent its keep-alives stops before it reads the keys, until the
    /// returned pause is resumed or dropped.
    pub(crate) fn pause_next_renewal_before_read(&self) -> Pause {
        self.inner.renewal_pause.arm(None)
    }

    /// Test hook: the next acquire of `name` on this instance that has put
    /// its key and proven its shared lease alive stops before it records
    /// the hold, until the returned pause is resumed or dropped.
    pub(crate) fn pause_next_acquire_before_record(&self, name: &LockName) -> Pause {
        self.inner.acquire_pause.arm(Some(name.clone()))
    }

    /// Test hook: the next acquire of `name` on this instance that has
    /// recorded its hold stops before it looks at its shared lease again
    /// and answers, until the returned pause is resumed or dropped.
    pub(crate) fn pause_next_acquire_after_record(&self, name: &LockName) -> Pause {
        self.inner.recorded_pause.arm(Some(name.clone()))
    }
}

impl Inner {
    /// Sends `txn`, the put of an acquire of `name`; if a late put is armed
    /// for `name`, from a task of its own after the delay, so the put
    /// reaches the server even if the acquire is dropped meanwhile, as a
    /// request already on the wire (or queued in the server) does.
    pub(crate) async fn send_put(
        &self,
        name: &LockName,
        mut kv: KvClient,
        txn: Txn,
    ) -> Result<TxnResponse, etcd_client::Error> {
        let Some(by) = self.late_put.take_for(name) else {
            return kv.txn(txn).await;
        };
        let sent = tokio::spawn(async move {
            tokio::time::sleep(by).await;
            kv.txn(txn).await
        });
        sent.await
            .unwrap_or_else(|e| Err(etcd_client::Error::Internal(format!("the late put: {e}"))))
    }

    /// Parks here if a renewal pause is armed; the first renewal to arrive
    /// takes it.
    pub(crate) async fn renewal_pause_point(&self) {
        if let Some(gate) = self.renewal_pause.take_for(None) {
            gate.pass().await;
        }
    }

    /// Parks here if an acquire pause before the record is armed for `name`.
    pub(crate) async fn acquire_pause_point(&self, name: &LockName) {
        if let Some(gate) = self.acquire_pause.take_for(Some(name)) {
            gate.pass().await;
        }
    }

    /// Parks here if an acquire pause after the record is armed for `name`.
    pub(crate) async fn recorded_pause_point(&self, name: &LockName) {
        if let Some(gate) = self.recorded_pause.take_for(Some(name)) {
            gate.pass().await;
        }
    }
}
