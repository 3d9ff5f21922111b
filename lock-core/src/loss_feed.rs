//! The loss feed: how a backend tells lock-core at once that leases ended.
//!
//! A renewal finds a lost lease at the latest one renewal interval after the
//! loss. Some losses the backend learns of sooner, and for many leases at once:
//! a Postgres session that closed took every lock on it, an etcd lease that
//! keep-alive reports gone took every key on it. Through the feed the
//! backend marks those leases lost in every `Locker` that holds them, before
//! it returns, so no handle keeps saying "held" while another replica may
//! already have the lock.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::lease::LeaseState;
use crate::{LossReason, OwnerToken};

/// A channel from a backend to every [`Locker`](crate::Locker) over it, for
/// leases that ended on the server (see [`LockBackend::loss_feed`]).
///
/// Cheap to clone; clones share subscribers. A backend keeps one, hands a
/// clone out from [`LockBackend::loss_feed`], declares
/// [`Capabilities::loss_push`], and calls [`LossFeed::leases_ended`] as soon
/// as it knows.
///
/// [`LockBackend::loss_feed`]: crate::LockBackend::loss_feed
/// [`Capabilities::loss_push`]: crate::Capabilities::loss_push
#[derive(Clone, Default)]
pub struct LossFeed {
    subscribers: Arc<Mutex<Vec<Weak<LeaseRegistry>>>>,
}

impl fmt::Debug for LossFeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LossFeed")
            .field("subscribers", &self.subscribers().len())
            .finish()
    }
}

impl LossFeed {
    /// A feed with no subscribers yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn subscribers(&self) -> MutexGuard<'_, Vec<Weak<LeaseRegistry>>> {
        // A push or a copy per critical section: poison carries no half-state.
        self.subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks every live lease held under one of `owners` as lost with
    /// `reason`, in every `Locker` over this backend, before returning: their
    /// handles fail `assert_held`, `lost()` completes, their tokens fire and
    /// the loss is counted. Owners with no live lease are ignored. Returns how
    /// many leases this call ended.
    ///
    /// Call it *before* doing what frees the locks on the server (closing a
    /// session), where the backend is the one ending them, so no other client
    /// can be granted a lock while a handle here still says "held".
    pub fn leases_ended<'a>(
        &self,
        owners: impl IntoIterator<Item = &'a OwnerToken>,
        reason: LossReason,
    ) -> usize {
        let registries: Vec<Arc<LeaseRegistry>> = {
            let mut subs = self.subscribers();
            subs.retain(|w| w.strong_count() > 0);
            subs.iter().filter_map(Weak::upgrade).collect()
        };
        if registries.is_empty() {
            return 0;
        }
        let owners: Vec<&OwnerToken> = owners.into_iter().collect();
        let mut ended = 0;
        for registry in registries {
            for lease in registry.take(&owners, reason) {
                if lease.mark_lost(reason) {
                    ended += 1;
                }
            }
        }
        ended
    }

    /// Adds a `Locker`'s registry; dropped registries are pruned on use.
    pub(crate) fn subscribe(&self, registry: &Arc<LeaseRegistry>) {
        let mut subs = self.subscribers();
        subs.retain(|w| w.strong_count() > 0);
        subs.push(Arc::downgrade(registry));
    }
}

/// One `Locker`'s live leases by owner token, for the loss feed to find,
/// and the owners of acquires still on their way.
#[derive(Default)]
pub(crate) struct LeaseRegistry {
    leases: Mutex<HashMap<OwnerToken, Slot>>,
}

/// A registered owner: an acquire not answered yet (and any loss pushed for
/// it meanwhile), or a live lease.
enum Slot {
    Expected(Option<LossReason>),
    Live(Weak<LeaseState>),
}

impl fmt::Debug for LeaseRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseRegistry")
            .field("leases", &self.map().len())
            .finish()
    }
}

impl LeaseRegistry {
    fn map(&self) -> MutexGuard<'_, HashMap<OwnerToken, Slot>> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `owner` before its acquire is sent, so a loss pushed
    /// between the server's grant and the lease's registration is kept for
    /// the lease instead of being ignored. The returned guard unregisters
    /// the owner if no lease takes its place.
    pub(crate) fn expect(self: &Arc<Self>, owner: OwnerToken) -> Expected {
        self.map().insert(owner, Slot::Expected(None));
        Expected {
            registry: Arc::clone(self),
            owner,
        }
    }

    /// Registers a live lease; returns the loss pushed for its owner while
    /// its acquire was on the way, if any.
    pub(crate) fn insert(&self, lease: &Arc<LeaseState>) -> Option<LossReason> {
        match self
            .map()
            .insert(lease.owner, Slot::Live(Arc::downgrade(lease)))
        {
            Some(Slot::Expected(pushed)) => pushed,
            _ => None,
        }
    }

    pub(crate) fn remove(&self, owner: &OwnerToken) {
        self.map().remove(owner);
    }

    /// The live leases among `owners`; owners still expected keep the loss
    /// for their lease. Ending the leases happens outside the registry's
    /// lock, since an ending removes its lease from the registry.
    fn take(&self, owners: &[&OwnerToken], reason: LossReason) -> Vec<Arc<LeaseState>> {
        let mut map = self.map();
        owners
            .iter()
            .filter_map(|o| match map.get_mut(*o)? {
                Slot::Live(lease) => lease.upgrade(),
                Slot::Expected(pushed) => {
                    pushed.get_or_insert(reason);
                    None
                }
            })
            .collect()
    }
}

/// An owner registered before its acquire; unregistered when dropped unless
/// a live lease has replaced it.
pub(crate) struct Expected {
    registry: Arc<LeaseRegistry>,
    owner: OwnerToken,
}

impl Drop for Expected {
    fn drop(&mut self) {
        let mut map = self.registry.map();
        if matches!(map.get(&self.owner), Some(Slot::Expected(_))) {
            map.remove(&self.owner);
        }
    }
}
