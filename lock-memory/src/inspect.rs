//! Who holds a lock in memory, and a forced release: the holder data kept
//! with each entry and the marks forced releases leave for their holders.

use std::time::SystemTime;

use lock_core::inspect::MAX_LIST_PAGE;
use lock_core::{ForceOutcome, Holder, HolderPage, Identity, LockName, OwnerToken};
use tokio::time::Instant;

use crate::State;

/// What an entry records for inspections.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    holder: Option<Identity>,
    acquired_at: SystemTime,
    renewed_at: SystemTime,
}

impl Meta {
    /// Taken now by `holder` (`None`: a holder that gave no identity).
    pub(crate) fn new(holder: Option<Identity>) -> Self {
        let now = SystemTime::now();
        Self {
            holder,
            acquired_at: now,
            renewed_at: now,
        }
    }

    pub(crate) fn renewed(&mut self, at: SystemTime) {
        self.renewed_at = at;
    }
}

impl State {
    /// Whether a forced release freed `owner`'s lease on `name` and its
    /// lease would still be running.
    pub(crate) fn was_forced(&mut self, name: &LockName, owner: &OwnerToken, now: Instant) -> bool {
        if self.forced.is_empty() {
            return false;
        }
        match self.forced.get(name) {
            Some((freed, until)) if *until > now => freed == owner,
            Some(_) => {
                self.forced.remove(name);
                false
            }
            None => false,
        }
    }

    pub(crate) fn describe(&mut self, name: &LockName, now: Instant) -> Option<Holder> {
        let entry = self.live(name, now)?;
        Some(holder_of(name, entry, now))
    }

    /// Live entries under `prefix` after `cursor`, by name. Sorting every
    /// matching name per page is fine for an in-process map an operator
    /// pages through; it changes nothing.
    pub(crate) fn list(
        &mut self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
        now: Instant,
    ) -> HolderPage {
        let limit = limit.clamp(1, MAX_LIST_PAGE);
        let mut names: Vec<&LockName> = self
            .locks
            .iter()
            .filter(|(n, e)| {
                e.expires_at > now
                    && n.as_str().starts_with(prefix)
                    && cursor.is_none_or(|c| n.as_str() > c)
            })
            .map(|(n, _)| n)
            .collect();
        names.sort_unstable();
        let more = names.len() > limit;
        names.truncate(limit);
        let holders: Vec<Holder> = names
            .into_iter()
            .filter_map(|n| self.locks.get(n).map(|e| holder_of(n, e, now)))
            .collect();
        let next = if more {
            holders.last().map(|h| h.name.as_str().to_owned())
        } else {
            None
        };
        HolderPage::new(holders, next)
    }

    pub(crate) fn force(&mut self, name: &LockName, expected: u64, now: Instant) -> ForceOutcome {
        let (owner, fence, until) = match self.live(name, now) {
            Some(e) => (e.owner, e.fence, e.expires_at),
            None => return ForceOutcome::NotHeld,
        };
        if fence != expected {
            return ForceOutcome::TokenMismatch { held: Some(fence) };
        }
        self.locks.remove(name);
        self.forced.insert(name.clone(), (owner, until));
        self.wake(name);
        ForceOutcome::Released
    }
}

fn holder_of(name: &LockName, e: &crate::Entry, now: Instant) -> Holder {
    let left = e.expires_at.saturating_duration_since(now);
    Holder::unknown(name.clone())
        .with_identity(e.meta.holder.clone())
        .with_fencing_token(Some(e.fence))
        .with_times(Some(e.meta.acquired_at), Some(e.meta.renewed_at))
        .with_expires_at(SystemTime::now().checked_add(left))
}
