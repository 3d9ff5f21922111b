//! [`LockGuard`]: ownership of a held lock.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::retention::Retained;
use super::{deadline_after, LeaseHandle, LeaseState};
use crate::heartbeat::HeartbeatHandle;
use crate::local::LocalClaim;
use crate::options::{drift_for, MAX_TTL};
use crate::{Error, LeaseStatus, LockBackend, LossReason, ReleaseOutcome, Result};

/// Ownership of a held lock. Dropping it ends the lease for every handle at
/// once, stops renewal and releases the lock in the background;
/// [`LockGuard::release`] releases and reports the result.
///
/// It dereferences to [`LeaseHandle`] for `assert_held`, `lost`, and the
/// fencing token.
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    handle: LeaseHandle,
    heartbeat: Option<HeartbeatHandle>,
    _claim: LocalClaim,
    finished: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lease", &self.handle)
            .finish()
    }
}

impl Deref for LockGuard {
    type Target = LeaseHandle;

    fn deref(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl LockGuard {
    pub(crate) fn new(
        state: Arc<LeaseState>,
        heartbeat: Option<HeartbeatHandle>,
        claim: LocalClaim,
    ) -> Self {
        Self {
            handle: LeaseHandle { state },
            heartbeat,
            _claim: claim,
            finished: false,
        }
    }

    /// A handle to pass to the guarded work.
    pub fn handle(&self) -> LeaseHandle {
        self.handle.clone()
    }

    fn stop_renewing(&self) {
        if let Some(hb) = &self.heartbeat {
            hb.forget(self.handle.state.id);
        }
    }

    /// Stops renewal and keeps the lock for `hold` more, then lets it end,
    /// instead of releasing it now.
    ///
    /// A per-run lock released the moment a short job finishes lets a replica
    /// whose clock is behind take the same run again; keeping the lock as a
    /// completion mark until clock skew can no longer matter prevents that.
    /// TTL backends set the lease to expire after `hold`; session backends
    /// release after `hold` from a background task (or when the session ends).
    /// Handles keep reporting the lease held until `hold` has passed (less the
    /// drift margin); then it ends as [`LossReason::Released`] for all of them.
    ///
    /// A hold that cannot be set is never left half done: when it is refused
    /// (out of range, below the backend's minimum TTL), the backend fails
    /// to set it, or it answers that the lease is gone (unless it is held by
    /// someone else), the lock is released before the error returns, since
    /// nothing else would end it on a session backend or on a lease shared
    /// with other locks.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`]; [`Error::Config`] for a zero `hold`, one
    /// longer than a year or one below the backend's
    /// [`min_ttl`](crate::Capabilities::min_ttl); [`Error::Backend`] when the
    /// backend failed to set the hold. The lock was released instead in each
    /// of these cases (as far as the backend answered).
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the guard is dropped and the lock released.
    pub async fn retain_for(mut self, hold: Duration) -> Result<()> {
        let min = self
            .handle
            .state
            .backend
            .as_ref()
            .map_or(Duration::ZERO, |b| b.capabilities().min_ttl);
        if hold.is_zero() || hold > MAX_TTL || hold < min {
            // Released before the error is returned, so the caller may take
            // the lock again at once, on this backend or any other.
            let released = match self.release().await {
                Ok(()) => "the lock was released instead".to_owned(),
                Err(e) => format!("releasing the lock instead failed too: {e}"),
            };
            return Err(Error::Config(format!(
                "retain_for needs a hold between {:?} (this backend's minimum TTL) and \
                 {MAX_TTL:?}, got {hold:?}; {released}",
                min.max(Duration::from_nanos(1))
            )));
        }
        self.stop_renewing();
        let state = Arc::clone(&self.handle.state);
        // A renewal still on its way (the heartbeat's or a manual one) would
        // set the TTL back after the hold is set; let it land first (it is
        // bounded by the backend's operation timeout, and the wait by the TTL).
        state.quiesce_renewals(state.ttl).await;
        let sent_at = Instant::now();
        let outcome = match (&state.backend, state.check_valid(sent_at)) {
            (None, _) => state.finish(sent_at).map_err(|r| state.lost_error(r)),
            (Some(backend), Err(reason)) => {
                release_lost_key(&**backend, &state, reason == LossReason::Stolen).await;
                Err(state.lost_error(reason))
            }
            (Some(backend), Ok(())) => {
                match (**backend).renew(&state.name, &state.owner, hold).await {
                    Ok(LeaseStatus::Held) => {
                        let keep = hold.saturating_sub(drift_for(hold));
                        let until = deadline_after(sent_at, keep).unwrap_or(sent_at);
                        if state.retain_until(until) {
                            state.background.end_retained(Retained {
                                until,
                                state: Arc::clone(&state),
                            });
                            Ok(())
                        } else {
                            // A loss arrived while the hold was being set.
                            let reason = state.loss_reason().unwrap_or(LossReason::Expired);
                            Err(state.lost_error(reason))
                        }
                    }
                    Ok(status) => {
                        let lost = self.handle.lose_on(status);
                        release_lost_key(&**backend, &state, status == LeaseStatus::Stolen).await;
                        Err(lost)
                    }
                    Err(e) => {
                        // The hold was not set, so nothing would end the
                        // lock: a session keeps it for its life, and etcd's
                        // shared lease for as long as any lock of its TTL.
                        let _ = state.finish(Instant::now());
                        if let Err(again) = (**backend).release(&state.name, &state.owner).await {
                            warn!(lock = %state.name, error = %again, "a retained hold could not be set, and releasing the lock instead failed too");
                        }
                        Err(Error::Backend(e))
                    }
                }
            }
        };
        state.end_hold(Instant::now());
        self.finished = true;
        outcome
    }

    /// Stops renewal and releases the lock now. Every handle of the lease
    /// reports it ended ([`LossReason::Released`]) before the backend is asked.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if the lease had already been lost (the work done
    /// under it may have overlapped another holder); [`Error::Backend`] if the
    /// backend could not be reached (the lease then ends at its TTL).
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the guard is dropped with it and the release
    /// finishes in the background.
    pub async fn release(mut self) -> Result<()> {
        self.stop_renewing();
        // Borrowed, not cloned: a reference count less per release.
        let state = &self.handle.state;
        let now = Instant::now();
        // `finish` also stops the held-time metrics: at this ending, or at
        // the earlier one that ended the lease first.
        let outcome = match (&state.backend, state.finish(now)) {
            (None, done) => done.map_err(|r| state.lost_error(r)),
            (Some(backend), Err(reason)) => {
                release_lost_key(&**backend, state, reason == LossReason::Stolen).await;
                Err(state.lost_error(reason))
            }
            (Some(backend), Ok(())) => match (**backend).release(&state.name, &state.owner).await {
                Ok(ReleaseOutcome::Released) => Ok(()),
                Ok(ReleaseOutcome::NotHeld) => {
                    // The server had forgotten the lease while it was valid
                    // here: a loss, learned only now.
                    warn!(lock = %state.name, "the lock was already gone on the server at release");
                    state.metrics().lost(LossReason::Expired);
                    Err(state.lost_error(LossReason::Expired))
                }
                Err(e) => Err(Error::Backend(e)),
            },
        };
        self.finished = true;
        debug!(lock = %state.name, ok = outcome.is_ok(), "lock released");
        outcome
    }
}

/// Frees the key of a lease that ended as lost, unless it was `stolen` (the
/// key is someone else's then). Best effort and owner-checked: the key may
/// outlive the local deadline, or what the backend answered (a reply from a
/// replica behind, a record lost in a failover), and a guard dropped after a
/// check that answered the same frees it too.
async fn release_lost_key(backend: &dyn LockBackend, state: &LeaseState, stolen: bool) {
    if !stolen {
        let _ = backend.release(&state.name, &state.owner).await;
    }
}

impl Drop for LockGuard {
    #[inline]
    fn drop(&mut self) {
        if !self.finished {
            self.end_on_drop();
            return;
        }
        // Released (a retained hold keeps a reference in its task): if this
        // guard holds the last reference, a later acquire on this thread
        // builds its lease in this one's allocation.
        super::spares::keep(&mut self.handle.state);
    }
}

impl LockGuard {
    /// What dropping a guard that was neither released nor retained does.
    #[inline(never)]
    fn end_on_drop(&self) {
        let state = &self.handle.state;
        // Every handle learns now that the lease is over; a deadline that had
        // already passed is counted as the loss it was. The held-time
        // metrics stop with the ending, as in `release`.
        let _ = state.finish(Instant::now());
        if let Some(hb) = &self.heartbeat {
            hb.forget_and_release(Arc::clone(state));
        }
    }
}
