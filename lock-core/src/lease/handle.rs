//! [`LeaseHandle`]: the view of a lease that guarded work receives.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::LeaseState;
use crate::{Error, LeaseStatus, LockName, LossReason, Result};

/// A view of a held lease for the guarded work: check it, wait for its end,
/// read its fencing token. Cheap to clone; it cannot release the lock.
///
/// Every clone sees the same lease: once it ends (released, guard dropped,
/// retained hold over, `max_hold` reached, or lost), every clone fails
/// [`LeaseHandle::assert_held`] at once, [`LeaseHandle::lost`] completes and
/// the cancellation token fires.
#[derive(Clone)]
pub struct LeaseHandle {
    pub(crate) state: Arc<LeaseState>,
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseHandle")
            .field("name", &self.state.name)
            .field("fencing_token", &self.state.fencing)
            .field("ended", &self.state.loss_reason())
            .finish()
    }
}

impl LeaseHandle {
    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.state.name
    }

    /// The fencing token of this acquisition, if the backend issues them. Pass
    /// it with every write to the protected resource, which should reject a
    /// token lower than the highest it has seen.
    pub fn fencing_token(&self) -> Option<u64> {
        self.state.fencing
    }

    /// Returns `Ok` while the lease is valid, `Err(LockLost)` once it ended
    /// (lost, released, or past its `max_hold`) or once its local validity
    /// deadline passed, whether or not the heartbeat has run. Call it before
    /// every unsafe write.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] with the reason; [`LossReason::Released`] when the
    /// holder released the lock (not a loss, but no longer safe to write).
    pub fn assert_held(&self) -> Result<()> {
        self.state
            .check_valid(Instant::now())
            .map_err(|reason| self.state.lost_error(reason))
    }

    /// Whether [`LeaseHandle::assert_held`] would succeed now.
    pub fn is_held(&self) -> bool {
        self.assert_held().is_ok()
    }

    /// Why the lease ended, if it has ([`LossReason::Released`] for a normal end).
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.state.loss_reason()
    }

    /// Completes when the lease ends, with the reason: a loss, or
    /// [`LossReason::Released`] when the holder released it. Use it in
    /// `tokio::select!` to stop work at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it has no effect on the lease.
    pub async fn lost(&self) -> LossReason {
        let ended = self.state.cancel_token();
        ended.cancelled().await;
        self.state.loss_reason().unwrap_or(LossReason::Expired)
    }

    /// A token cancelled when the lease ends, for handing to sub-tasks.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.state.cancel_token().child_token()
    }

    /// How long until the lease ends locally without another renewal: the
    /// earlier of its validity deadline and its `max_hold` (`None` for an
    /// unlocked run without `max_hold`, which has no deadline; zero once it
    /// ended). What a supervisor must stop its work before.
    pub fn remaining_validity(&self) -> Option<Duration> {
        let now = Instant::now();
        if self.state.check_valid(now).is_err() {
            return Some(Duration::ZERO);
        }
        [self.state.valid_until(), self.state.hold_deadline]
            .into_iter()
            .flatten()
            .min()
            .map(|d| d.saturating_duration_since(now))
    }

    /// Whether this lease was taken without a backend (unlocked mode).
    pub fn is_unlocked(&self) -> bool {
        self.state.backend.is_none()
    }

    /// Asks the backend whether the lease is still ours, without extending it,
    /// and marks it lost if not.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if it is gone or foreign, or it ended locally;
    /// [`Error::Backend`] if the backend could not answer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn verify(&self) -> Result<()> {
        self.assert_held()?;
        let Some(backend) = &self.state.backend else {
            return Ok(());
        };
        match (**backend)
            .check(&self.state.name, &self.state.owner)
            .await?
        {
            LeaseStatus::Held => self.assert_held(),
            status => Err(self.lose_on(status)),
        }
    }

    /// Renews the lease now, on top of the heartbeat (or instead of it when
    /// auto-renewal is off).
    ///
    /// A lease kept by [`LockGuard::retain_for`](crate::LockGuard::retain_for)
    /// is not renewed: its hold's end is already set on the server, and a
    /// renewal with the lease's TTL would cut it short while every handle
    /// still said held. This returns `Ok` while the hold lasts, without asking
    /// the backend. A renewal sent before `retain_for` began is waited for by
    /// it, so its reply cannot land after the hold was set.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if the lease is gone, foreign or ended;
    /// [`Error::Backend`] if the backend failed (the lease stays valid until
    /// its deadline).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped renewal leaves the deadline where it was.
    pub async fn renew(&self) -> Result<()> {
        self.assert_held()?;
        let Some(backend) = &self.state.backend else {
            return Ok(());
        };
        let Some(_in_flight) = InFlight::begin(&self.state) else {
            // Renewals are stopped: the lease is retained (or a hold is
            // being set), or it has just ended.
            return self.assert_held();
        };
        let sent_at = Instant::now();
        match (**backend)
            .renew(&self.state.name, &self.state.owner, self.state.ttl)
            .await
        {
            Ok(LeaseStatus::Held) => {
                self.state.extend(sent_at);
                self.assert_held()
            }
            Ok(status) => Err(self.lose_on(status)),
            Err(e) => {
                self.state.set_renew_failing();
                Err(Error::Backend(e))
            }
        }
    }

    pub(crate) fn lose_on(&self, status: LeaseStatus) -> Error {
        let reason = match status {
            LeaseStatus::Stolen => LossReason::Stolen,
            LeaseStatus::Forced => LossReason::Forced,
            _ => LossReason::Expired,
        };
        self.state.mark_lost(reason);
        self.state
            .lost_error(self.state.loss_reason().unwrap_or(reason))
    }
}

/// A manual renewal on its way: a retained hold being set waits for it
/// (`LeaseState::quiesce_renewals`). Ends when its reply was applied, or
/// when its caller stopped waiting.
struct InFlight<'a>(&'a LeaseState);

impl<'a> InFlight<'a> {
    fn begin(state: &'a LeaseState) -> Option<Self> {
        state.begin_renewal().then_some(Self(state))
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.end_renewal();
    }
}
