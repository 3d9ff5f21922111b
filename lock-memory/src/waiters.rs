//! Waiters: whom to wake when a name is released, kept only while someone
//! still waits.
//!
//! Each waiting acquire holds a [`Subscription`]; the entry for a name goes
//! when it is woken or when its last subscription is dropped, whether that
//! wait was woken, timed out, was cancelled, or saw the lease run out. So
//! the map holds one entry per name with a live wait, never one per name
//! ever waited on.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use lock_core::LockName;
use tokio::sync::Notify;

use crate::Shared;

/// The live waits, per name.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    map: HashMap<LockName, Slot>,
}

/// One generation of waiters on a name: those that subscribed since the
/// name was last woken.
#[derive(Debug)]
struct Slot {
    notify: Arc<Notify>,
    subscribers: usize,
}

impl Waiters {
    /// Counts one more waiter on `name`; returns what it waits on.
    pub(crate) fn subscribe(&mut self, name: &LockName) -> Arc<Notify> {
        let slot = self.map.entry(name.clone()).or_insert_with(|| Slot {
            notify: Arc::new(Notify::new()),
            subscribers: 0,
        });
        slot.subscribers = slot.subscribers.saturating_add(1);
        Arc::clone(&slot.notify)
    }

    /// Wakes every waiter on `name` and forgets them: each tries again and
    /// subscribes anew if it still has to wait.
    pub(crate) fn wake(&mut self, name: &LockName) {
        if let Some(slot) = self.map.remove(name) {
            slot.notify.notify_waiters();
        }
    }

    /// One waiter of the generation behind `notify` is gone. A generation
    /// already woken was removed by [`Waiters::wake`], and a newer one on the
    /// same name is not this waiter's to count down.
    fn unsubscribe(&mut self, name: &LockName, notify: &Arc<Notify>) {
        if let Some(slot) = self.map.get_mut(name) {
            if Arc::ptr_eq(&slot.notify, notify) {
                slot.subscribers = slot.subscribers.saturating_sub(1);
                if slot.subscribers == 0 {
                    self.map.remove(name);
                }
            }
        }
    }

    /// How many names have a live wait.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// One waiter's claim on its entry; dropping it (with the release signal
/// that owns it) counts the waiter out.
#[derive(Debug)]
pub(crate) struct Subscription {
    /// Weak, so that a forgotten signal does not keep the backend alive.
    shared: Weak<Shared>,
    name: LockName,
    notify: Arc<Notify>,
}

impl Subscription {
    pub(crate) fn new(shared: &Arc<Shared>, name: LockName, notify: Arc<Notify>) -> Self {
        Self {
            shared: Arc::downgrade(shared),
            name,
            notify,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.state().waiters.unsubscribe(&self.name, &self.notify);
        }
    }
}
