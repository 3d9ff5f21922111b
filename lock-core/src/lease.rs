//! A held lease: its shared state, the handle jobs receive, and the guard.

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::heartbeat::HeartbeatHandle;
use crate::local::LocalClaim;
use crate::{
    Error, LeaseStatus, LockBackend, LockMetrics, LockName, LossReason, OwnerToken, ReleaseOutcome,
    Result,
};

/// State of one lease shared by its guard, its handles and the heartbeat.
pub(crate) struct LeaseState {
    pub(crate) id: u64,
    pub(crate) name: LockName,
    pub(crate) owner: OwnerToken,
    pub(crate) fencing: Option<u64>,
    pub(crate) label: String,
    pub(crate) ttl: Duration,
    pub(crate) drift: Duration,
    pub(crate) interval: Duration,
    pub(crate) auto_renew: bool,
    pub(crate) hold_deadline: Option<Instant>,
    pub(crate) acquired_at: Instant,
    /// `None` for a lease taken without a backend (unlocked mode): it never expires.
    pub(crate) backend: Option<Arc<dyn LockBackend>>,
    valid_until: Mutex<Option<Instant>>,
    renew_in_flight: AtomicBool,
    renew_failing: AtomicBool,
    lost: OnceLock<LossReason>,
    cancel: CancellationToken,
    ended: AtomicBool,
    metrics: LockMetrics,
}

/// Everything needed to build a [`LeaseState`].
pub(crate) struct LeaseParts {
    pub(crate) id: u64,
    pub(crate) name: LockName,
    pub(crate) owner: OwnerToken,
    pub(crate) fencing: Option<u64>,
    pub(crate) label: String,
    pub(crate) options: crate::LockOptions,
    pub(crate) sent_at: Instant,
    pub(crate) backend: Option<Arc<dyn LockBackend>>,
    pub(crate) metrics: LockMetrics,
}

impl LeaseState {
    pub(crate) fn new(p: LeaseParts) -> Self {
        let ttl = p.options.ttl();
        let drift = p.options.drift();
        let valid_until = p.backend.as_ref().map(|_| p.sent_at + ttl - drift);
        p.metrics.held_start(&p.label);
        Self {
            id: p.id,
            name: p.name,
            owner: p.owner,
            fencing: p.fencing,
            label: p.label,
            ttl,
            drift,
            interval: p.options.renew_interval(),
            auto_renew: p.options.auto_renew(),
            hold_deadline: p.options.max_hold().map(|h| p.sent_at + h),
            acquired_at: p.sent_at,
            backend: p.backend,
            valid_until: Mutex::new(valid_until),
            renew_in_flight: AtomicBool::new(false),
            renew_failing: AtomicBool::new(false),
            lost: OnceLock::new(),
            cancel: CancellationToken::new(),
            ended: AtomicBool::new(false),
            metrics: p.metrics,
        }
    }

    /// The first instant the heartbeat must look at this lease: its first
    /// renewal, its local deadline or its `max_hold`, whichever comes first.
    pub(crate) fn first_attention(&self) -> Instant {
        let renew = self.auto_renew.then_some(self.acquired_at + self.interval);
        [renew, self.valid_until(), self.hold_deadline]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(self.acquired_at + self.interval)
    }

    pub(crate) fn metrics(&self) -> &LockMetrics {
        &self.metrics
    }

    pub(crate) fn valid_until(&self) -> Option<Instant> {
        *self
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the validity deadline to `sent_at + ttl - drift` after a
    /// successful renewal whose request left at `sent_at`. Counting from the
    /// send, not the reply, is what keeps the local deadline ahead of the
    /// server's expiry however slow the reply was.
    pub(crate) fn extend(&self, sent_at: Instant) {
        if self.lost.get().is_some() {
            return;
        }
        let mut until = self
            .valid_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let candidate = sent_at + self.ttl - self.drift;
        if let Some(current) = *until {
            if candidate > current {
                *until = Some(candidate);
            }
        }
        self.renew_failing.store(false, Ordering::Release);
    }

    pub(crate) fn set_renew_in_flight(&self, yes: bool) {
        self.renew_in_flight.store(yes, Ordering::Release);
    }

    pub(crate) fn set_renew_failing(&self) {
        self.renew_failing.store(true, Ordering::Release);
    }

    pub(crate) fn loss_reason(&self) -> Option<LossReason> {
        self.lost.get().copied()
    }

    /// Records the loss once: counts it, ends the hold and fires the
    /// cancellation token. Returns whether this call was the one that lost it.
    pub(crate) fn mark_lost(&self, reason: LossReason) -> bool {
        if self.lost.set(reason).is_err() {
            return false;
        }
        warn!(lock = %self.name, %reason, "lock lost; cancelling the guarded work");
        self.metrics.lost(&self.label, reason);
        self.end_hold();
        self.cancel.cancel();
        true
    }

    /// Ok while the lease is valid; otherwise marks it lost (if the deadline
    /// just passed) and returns why it is not.
    pub(crate) fn check_valid(&self, now: Instant) -> std::result::Result<(), LossReason> {
        if let Some(reason) = self.loss_reason() {
            return Err(reason);
        }
        match self.valid_until() {
            Some(deadline) if now >= deadline => {
                let reason = if self.renew_failing.load(Ordering::Acquire)
                    || self.renew_in_flight.load(Ordering::Acquire)
                {
                    LossReason::BackendError
                } else {
                    LossReason::Expired
                };
                self.mark_lost(reason);
                Err(self.loss_reason().unwrap_or(reason))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn end_hold(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            let held = self.acquired_at.elapsed().as_secs_f64();
            self.metrics.held_end(&self.label, held);
        }
    }

    fn lost_error(&self, reason: LossReason) -> Error {
        Error::LockLost {
            name: self.name.clone(),
            reason,
        }
    }
}

/// A view of a held lease for the guarded work: check it, wait for its loss,
/// read its fencing token. Cheap to clone; it cannot release the lock.
#[derive(Clone)]
pub struct LeaseHandle {
    pub(crate) state: Arc<LeaseState>,
}

impl fmt::Debug for LeaseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseHandle")
            .field("name", &self.state.name)
            .field("fencing_token", &self.state.fencing)
            .field("lost", &self.state.loss_reason())
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

    /// Returns `Ok` while the lease is valid, `Err(LockLost)` once it was lost
    /// or once its local validity deadline passed, whether or not the
    /// heartbeat has run. Call it before every unsafe write.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] with the reason.
    pub fn assert_held(&self) -> Result<()> {
        self.state
            .check_valid(Instant::now())
            .map_err(|reason| self.state.lost_error(reason))
    }

    /// Whether [`LeaseHandle::assert_held`] would succeed now.
    pub fn is_held(&self) -> bool {
        self.assert_held().is_ok()
    }

    /// Why the lease was lost, if it was.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.state.loss_reason()
    }

    /// Completes when the lease is lost, with the reason. Use it in
    /// `tokio::select!` to stop work at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping it has no effect on the lease.
    pub async fn lost(&self) -> LossReason {
        self.state.cancel.cancelled().await;
        self.state.loss_reason().unwrap_or(LossReason::Expired)
    }

    /// A token cancelled when the lease is lost, for handing to sub-tasks.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.state.cancel.child_token()
    }

    /// How long the lease stays valid locally without another renewal
    /// (`None` for an unlocked run, which has no deadline).
    pub fn remaining_validity(&self) -> Option<Duration> {
        if self.state.loss_reason().is_some() {
            return Some(Duration::ZERO);
        }
        self.state
            .valid_until()
            .map(|d| d.saturating_duration_since(Instant::now()))
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
    /// [`Error::LockLost`] if it is gone or foreign, or its local deadline
    /// passed; [`Error::Backend`] if the backend could not answer.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn verify(&self) -> Result<()> {
        self.assert_held()?;
        let Some(backend) = &self.state.backend else {
            return Ok(());
        };
        match backend.check(&self.state.name, &self.state.owner).await? {
            LeaseStatus::Held => self.assert_held(),
            status => Err(self.lose_on(status)),
        }
    }

    /// Renews the lease now, on top of the heartbeat (or instead of it when
    /// auto-renewal is off).
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if the lease is gone or foreign; [`Error::Backend`]
    /// if the backend failed (the lease stays valid until its deadline).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped renewal leaves the deadline where it was.
    pub async fn renew(&self) -> Result<()> {
        self.assert_held()?;
        let Some(backend) = &self.state.backend else {
            return Ok(());
        };
        let sent_at = Instant::now();
        match backend
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

    fn lose_on(&self, status: LeaseStatus) -> Error {
        let reason = match status {
            LeaseStatus::Stolen => LossReason::Stolen,
            _ => LossReason::Expired,
        };
        self.state.mark_lost(reason);
        self.state
            .lost_error(self.state.loss_reason().unwrap_or(reason))
    }
}

/// Ownership of a held lock. Dropping it stops renewal and releases the lock
/// in the background; [`LockGuard::release`] releases and reports the result.
///
/// It dereferences to [`LeaseHandle`] for `assert_held`, `lost`, and the
/// fencing token.
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

    /// Stops renewal and keeps the lock for `hold` more, then lets it end,
    /// instead of releasing it now.
    ///
    /// A per-run lock released the moment a short job finishes lets a replica
    /// whose clock is behind take the same run again; keeping the lock as a
    /// completion mark until clock skew can no longer matter prevents that.
    /// TTL backends set the lease to expire after `hold`; session backends
    /// release after `hold` from a background task (or when the session ends).
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`]; also [`Error::Config`] for a zero `hold`.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the guard is dropped and the lock released.
    pub async fn retain_for(mut self, hold: Duration) -> Result<()> {
        if hold.is_zero() {
            return Err(Error::Config("retain_for needs a non-zero duration".into()));
        }
        if let Some(hb) = &self.heartbeat {
            hb.forget(self.handle.state.id);
        }
        let state = Arc::clone(&self.handle.state);
        let outcome = match (&state.backend, state.check_valid(Instant::now())) {
            (None, _) => Ok(()),
            (Some(_), Err(reason)) => Err(state.lost_error(reason)),
            (Some(backend), Ok(())) => {
                let session = backend.capabilities().expiry == crate::Expiry::Session;
                match backend.renew(&state.name, &state.owner, hold).await {
                    Ok(LeaseStatus::Held) if session => {
                        let (backend, st) = (Arc::clone(backend), Arc::clone(&state));
                        tokio::spawn(async move {
                            tokio::time::sleep(hold).await;
                            let _ = backend.release(&st.name, &st.owner).await;
                        });
                        Ok(())
                    }
                    Ok(LeaseStatus::Held) => Ok(()),
                    Ok(status) => Err(self.handle.lose_on(status)),
                    Err(e) => Err(Error::Backend(e)),
                }
            }
        };
        state.end_hold();
        self.finished = true;
        outcome
    }

    /// Stops renewal and releases the lock now.
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
        if let Some(hb) = &self.heartbeat {
            hb.forget(self.handle.state.id);
        }
        let state = Arc::clone(&self.handle.state);
        let outcome = match (&state.backend, state.check_valid(Instant::now())) {
            (None, _) => Ok(()),
            (Some(backend), Err(reason)) => {
                if reason != LossReason::Stolen {
                    // Best effort: the key may outlive our local deadline.
                    let _ = backend.release(&state.name, &state.owner).await;
                }
                Err(state.lost_error(reason))
            }
            (Some(backend), Ok(())) => match backend.release(&state.name, &state.owner).await {
                Ok(ReleaseOutcome::Released) => Ok(()),
                Ok(ReleaseOutcome::NotHeld) => {
                    state.mark_lost(LossReason::Expired);
                    Err(state.lost_error(state.loss_reason().unwrap_or(LossReason::Expired)))
                }
                Err(e) => Err(Error::Backend(e)),
            },
        };
        state.end_hold();
        self.finished = true;
        debug!(lock = %state.name, ok = outcome.is_ok(), "lock released");
        outcome
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let state = &self.handle.state;
        state.end_hold();
        if let Some(hb) = &self.heartbeat {
            hb.forget_and_release(Arc::clone(state));
        }
    }
}
