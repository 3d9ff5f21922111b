//! Test hooks, behind the `test-util` feature: a pause point inside
//! renewals, so a test can run another operation on the same lock between
//! a renewal's keep-alive and its read of the key. Not part of the API.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{watch, Notify};

use crate::connection::{Connected, Inner};

/// Where an armed pause waits: told when a renewal arrives, opened to let
/// it go on.
#[derive(Debug)]
pub(crate) struct Gate {
    reached: Arc<Notify>,
    open: watch::Receiver<bool>,
}

/// The pause slot of one backend instance (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct PauseSlot(Mutex<Option<Gate>>);

impl PauseSlot {
    fn arm(&self, gate: Gate) {
        // One assignment per critical section: a poisoned slot is consistent.
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(gate);
    }

    fn take(&self) -> Option<Gate> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// A pause armed with [`EtcdBackend::pause_next_renewal_before_read`](crate::EtcdBackend::pause_next_renewal_before_read). The
/// renewal it catches stays parked until [`RenewalPause::resume`] is called
/// or the pause is dropped; the backend's request timeout still bounds it.
#[derive(Debug)]
pub struct RenewalPause {
    reached: Arc<Notify>,
    open: watch::Sender<bool>,
}

impl RenewalPause {
    /// Completes once a renewal is parked at the pause point.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call loses no arrival; the next call sees it.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Lets the parked renewal (or the next one to arrive) go on.
    pub fn resume(self) {
        // Dropping the sender opens the gate too; sending says it outright.
        let _ = self.open.send(true);
    }
}

impl Connected {
    /// Test hook: the next renewal of this instance (single or batch) that
    /// has sent its keep-alives stops before it reads the keys, until the
    /// returned pause is resumed or dropped.
    pub(crate) fn pause_next_renewal_before_read(&self) -> RenewalPause {
        let reached = Arc::new(Notify::new());
        let (open, rx) = watch::channel(false);
        self.inner.pause.arm(Gate {
            reached: Arc::clone(&reached),
            open: rx,
        });
        RenewalPause { reached, open }
    }
}

impl Inner {
    /// Parks here if a pause is armed; the first renewal to arrive takes it.
    pub(crate) async fn renewal_pause_point(&self) {
        let Some(mut gate) = self.pause.take() else {
            return;
        };
        gate.reached.notify_one();
        // An error means the pause was dropped: go on.
        let _ = gate.open.wait_for(|open| *open).await;
    }
}
