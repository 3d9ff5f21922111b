//! Releasing: the unlock, with the release announcement in the same
//! statement, run to a known outcome.
//!
//! A release whose unlock did not answer in time (a client-side statement
//! timeout on a slow server) or failed leaves the session's lock count
//! unknown. The session is kept: the key stays reserved for its owner (no
//! other owner of this backend takes it on this session) while the unlock
//! goes on in a task of its own, waited for twice the statement timeout,
//! then tried once more (a second unlock can only free this owner's lock,
//! since nothing else took the key meanwhile). Only if that fails too is the
//! session ended, and then every lease on it is marked lost first. A slow
//! release therefore costs the other locks of the process nothing, and a
//! failed one never leaves them saying "held" after the server freed them.

use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::ReleaseOutcome,
    detach::Detachable,
    lane::{self, Settled},
    BackendError, BackendErrorKind, LockName, LossReason, OwnerToken,
};
use tokio::time::timeout;
use tracing::{debug, warn};

use crate::error::timed_out;
use crate::session::LockSession;
use crate::unlocks;
use crate::{AdvisoryKey, PostgresBackend};

/// A release that started: the session the key is on, and the signal of
/// the attempt that took it.
pub(crate) struct Releasing {
    session: Arc<LockSession>,
    attempt: Settled,
}

/// Why a release could not start.
pub(crate) enum NotStarted {
    /// Nothing of this owner's is held here.
    NotHeld,
    /// It went with its session, which ended.
    SessionEnded,
    /// An earlier release of it is still finishing; this closes when it has.
    InFlight(Settled),
}

impl PostgresBackend {
    /// Unlocks `key` on `session`, waiting at most `limit` (see
    /// [`unlocks::unlock`]). The caller holds the key's reservation.
    pub(crate) async fn unlock(
        &self,
        session: &Arc<LockSession>,
        key: AdvisoryKey,
        announce: bool,
        limit: Duration,
    ) -> Result<bool, BackendError> {
        #[cfg(feature = "test-util")]
        if let Some(by) = self.inner.faults.unlock_delay(key) {
            tokio::time::sleep(by).await;
        }
        #[cfg(feature = "test-util")]
        if let Some(e) = self.inner.faults.unlock_error(key) {
            return Err(e);
        }
        unlocks::unlock(session, key, announce, limit).await
    }

    /// One release ([`LockBackend::release`](lock_core::LockBackend::release)).
    ///
    /// Returns within the statement timeout; a slower unlock finishes in
    /// the background (see the module docs). Cancel safe: once started, the
    /// unlock runs to its end whether or not this future is polled.
    pub(crate) async fn release_lock(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let key = self.inner.config.key_for(name);
        let releasing = match self.begin_release(key, owner) {
            Ok(s) => s,
            // Routine, not a fault: the release a `Locker` sends after an
            // attempt its caller gave up (which may never have left), or a
            // second release after the first one ended. A lock lost on the
            // server while held is reported by the caller that expected it.
            Err(NotStarted::NotHeld | NotStarted::SessionEnded) => {
                debug!(lock = %name, "release of a lock this backend does not hold for this owner; nothing unlocked");
                return Ok(ReleaseOutcome::NotHeld);
            }
            // A second release while the first one's unlock is on its way (a
            // `Locker` sends one when its caller gave up waiting for the
            // first): the first one's end is this one's answer.
            Err(NotStarted::InFlight(gone)) => {
                let limit = self.inner.config.statement_timeout;
                return match timeout(limit, gone.wait()).await {
                    Ok(()) => Ok(ReleaseOutcome::NotHeld),
                    Err(_) => Err(BackendError::new(
                        BackendErrorKind::Timeout,
                        format!(
                            "releasing {name}: an earlier release of it is still finishing after \
                             {limit:?}; it goes on in the background"
                        ),
                    )),
                };
            }
        };
        let unlock = self.start_unlock(releasing, key, *owner, self.inner.config.release_notify);
        #[cfg(feature = "test-util")]
        let wait = self
            .inner
            .faults
            .release_wait(key, self.inner.config.statement_timeout);
        #[cfg(not(feature = "test-util"))]
        let wait = self.inner.config.statement_timeout;
        match wait_for(unlock, wait).await {
            Ok(true) => Ok(ReleaseOutcome::Released),
            Ok(false) => {
                // After an attempt that was given up before it ran, routine;
                // a lock gone while its lease was valid is reported by the
                // `Locker` (as a loss), which knows which case this is.
                debug!(lock = %name, "pg_advisory_unlock found nothing to unlock on this session");
                Ok(ReleaseOutcome::NotHeld)
            }
            Err(e) => {
                warn!(lock = %name, error = %e, "release failed");
                Err(e)
            }
        }
    }

    /// Marks `owner`'s holding of `key` as being released and returns its
    /// session and its attempt's signal. A holding whose session ended is
    /// forgotten: its lock went with the session.
    pub(crate) fn begin_release(
        &self,
        key: AdvisoryKey,
        owner: &OwnerToken,
    ) -> Result<Releasing, NotStarted> {
        let mut held = self.held();
        match held.get_mut(&key) {
            Some(h) if h.owner == *owner => {
                if !h.session.is_alive() {
                    held.remove(&key);
                    Err(NotStarted::SessionEnded)
                } else if h.releasing {
                    let (_, gone) = h.gone.get_or_insert_with(lane::settle);
                    Err(NotStarted::InFlight(gone.clone()))
                } else {
                    h.releasing = true;
                    Ok(Releasing {
                        session: Arc::clone(&h.session),
                        attempt: h.attempt.clone(),
                    })
                }
            }
            _ => Err(NotStarted::NotHeld),
        }
    }

    /// Runs the unlock of `key`, reserved for `owner` by
    /// [`PostgresBackend::begin_release`], to a known outcome; the
    /// reservation ends with it. The unlock is sent only once the attempt
    /// that took the key has settled, so it runs after it. It makes progress
    /// only while [`wait_for`] polls it, and goes on in a task of its own
    /// from when the caller stops waiting.
    pub(crate) fn start_unlock(
        &self,
        releasing: Releasing,
        key: AdvisoryKey,
        owner: OwnerToken,
        announce: bool,
    ) -> Unlock {
        let backend = self.clone();
        let Releasing { session, attempt } = releasing;
        // Given up outside any runtime, the key would stay reserved until
        // its lock session ends (no other owner here takes it meanwhile).
        Detachable::new("an unlock", async move {
            attempt.wait().await;
            let outcome = backend.settle_unlock(&session, key, announce).await;
            backend.take_holding(key, &owner);
            outcome
        })
    }

    /// The unlock, then (if its outcome stays unknown on a live session) one
    /// more, then the end of the session. Bounded by three statement
    /// timeouts.
    async fn settle_unlock(
        &self,
        session: &Arc<LockSession>,
        key: AdvisoryKey,
        announce: bool,
    ) -> Result<bool, BackendError> {
        let limit = self.inner.config.statement_timeout;
        let first = match self.unlock(session, key, announce, limit * 2).await {
            Ok(freed) => return Ok(freed),
            // Its end was reported for every lease on it; the lock is gone.
            Err(e) if !session.is_alive() => return Err(e),
            Err(e) => e,
        };
        // Whether the first ran is unknown. It runs before this one on the
        // connection if it ran at all, and the key stayed reserved, so this
        // one can only free the same lock, once.
        match self.unlock(session, key, announce, limit).await {
            Ok(_) => Ok(true),
            Err(_) if !session.is_alive() => Err(first),
            Err(second) => {
                warn!(
                    pid = session.pid(),
                    error = %second,
                    "an unlock failed twice; ending the lock session, whose other leases are marked lost first"
                );
                session.terminate(LossReason::BackendError);
                Err(first)
            }
        }
    }
}

/// An unlock started by [`PostgresBackend::start_unlock`]: it runs in its
/// caller's task while [`wait_for`] waits for it, and in a task of its own
/// once the caller stops waiting (the wait's limit passed, or its future was
/// dropped). At concurrency 1, handing every unlock to a task and back cost
/// about as long as the unlock's round trip.
pub(crate) type Unlock = Detachable<Result<bool, BackendError>>;

/// Waits at most `limit` for `unlock`; it goes on in the background if
/// this gives up, or if this future is dropped.
pub(crate) async fn wait_for(mut unlock: Unlock, limit: Duration) -> Result<bool, BackendError> {
    // Not even one look: a zero wait means the caller does not wait.
    let waited = if limit.is_zero() {
        None
    } else {
        timeout(limit, &mut unlock).await.ok()
    };
    match waited {
        Some(outcome) => outcome,
        None => Err(timed_out(
            "releasing an advisory lock (the unlock goes on in the background, its key reserved \
             until it is known to have run)",
            limit,
        )),
    }
}
