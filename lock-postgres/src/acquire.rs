//! Acquiring: the lock attempt, with the fencing token in the same round
//! trip once the sequence is known to exist; the statements themselves, and
//! how concurrent attempts share one, are in `attempts`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{
    backend::{AcquireAttempt, Lease},
    lane::{self, Unsettled},
    BackendError, BackendErrorKind, Identity, LockName, OwnerToken,
};
use tracing::warn;

use crate::attempts::LockAnswer;
use crate::backend::Holding;
use crate::error::{config, protocol};
use crate::holders::HolderInfo;
use crate::release::wait_for;
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresBackend};

impl PostgresBackend {
    /// One acquire attempt ([`LockBackend::try_acquire`](lock_core::LockBackend::try_acquire)).
    pub(crate) async fn acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        who: Option<&Identity>,
    ) -> Result<AcquireAttempt, BackendError> {
        let cfg = &self.inner.config;
        if ttl > cfg.max_ttl {
            return Err(config(format!(
                "TTL {ttl:?} is above this backend's max_ttl of {:?}: the server could free the \
                 lock of a vanished holder before the holder's TTL ran out; raise max_ttl",
                cfg.max_ttl
            )));
        }
        let key = cfg.key_for(name);
        let info = HolderInfo {
            name: name.as_str().to_owned(),
            identity: who.map(|i| i.as_str().to_owned()),
        };
        let session = self.session_for(key).await?;
        let (unsettled, settled) = lane::settle();
        {
            let mut held = self.held();
            if let Some(h) = held.get(&key) {
                // Advisory locks are re-entrant per session: the server would
                // grant this, so the exclusion between owners sharing the
                // session is enforced here.
                if h.session.is_alive() {
                    return Ok(AcquireAttempt::HeldElsewhere);
                }
            }
            // Recorded before the statement leaves, so a release for this
            // owner after a dropped or failed attempt unlocks what the
            // statement may have taken.
            held.insert(
                key,
                Holding {
                    owner: *owner,
                    session: Arc::clone(&session),
                    releasing: false,
                    gone: None,
                    attempt: settled,
                },
            );
        }
        if cfg.fencing && self.inner.fence_ready.load(Ordering::Relaxed) {
            match self
                .try_lock_fenced(&session, key, owner, unsettled, &info)
                .await
            {
                Err(e) if e.message().contains("42P01") => {
                    // The sequence was dropped since: the lock may have been
                    // taken before nextval failed (session locks ignore the
                    // statement's failure). Give it back and take the path
                    // that creates the sequence.
                    self.inner.fence_ready.store(false, Ordering::Relaxed);
                    let limit = cfg.statement_timeout;
                    if let Err(unlock) = self.unlock(&session, key, false, limit).await {
                        warn!(error = %unlock, "could not unlock after a missing fencing sequence");
                        self.give_back(key, owner).await;
                        return Err(unlock);
                    }
                }
                other => return self.still_alive(&session, other),
            }
            let unsettled = self.next_attempt(key, owner);
            return self
                .try_lock_then_fence(&session, key, owner, unsettled, &info)
                .await;
        }
        self.try_lock_then_fence(&session, key, owner, unsettled, &info)
            .await
    }

    /// The holder row for the lock statement to write: only once the
    /// holder tables are known to exist (before, `record_holder` writes it
    /// in a statement of its own and creates them).
    fn attach(&self, info: &HolderInfo) -> Option<HolderInfo> {
        self.holder_sql().ready().then(|| info.clone())
    }

    /// A new signal for a second attempt of `owner` on `key`, kept in its
    /// holding in place of the first's (which has settled).
    fn next_attempt(&self, key: AdvisoryKey, owner: &OwnerToken) -> Unsettled {
        let (unsettled, settled) = lane::settle();
        if let Some(h) = self.held().get_mut(&key).filter(|h| h.owner == *owner) {
            h.attempt = settled;
        }
        unsettled
    }

    /// The plain lock attempt, then (with fencing on) the fencing token in a
    /// round trip of its own, which creates the sequence if it is missing.
    async fn try_lock_then_fence(
        &self,
        session: &Arc<LockSession>,
        key: AdvisoryKey,
        owner: &OwnerToken,
        unsettled: Unsettled,
        info: &HolderInfo,
    ) -> Result<AcquireAttempt, BackendError> {
        let cfg = &self.inner.config;
        let answer = session
            .try_lock(key, false, unsettled, self.attach(info))
            .await?;
        if !self.granted(session, answer, key, owner)? {
            return Ok(AcquireAttempt::HeldElsewhere);
        }
        if !cfg.fencing {
            if !answer.recorded {
                self.record_holder(session, key, info, None, false).await;
            }
            return self.still_alive(session, Ok(AcquireAttempt::Acquired(Lease::new(None))));
        }
        match self.fencing_token(session).await {
            Ok(token) => {
                self.inner.fence_ready.store(true, Ordering::Relaxed);
                // The row the lock statement wrote (if any) has no token.
                self.record_holder(session, key, info, Some(token), true)
                    .await;
                let lease = Lease::new(Some(token));
                self.still_alive(session, Ok(AcquireAttempt::Acquired(lease)))
            }
            Err(e) => {
                self.give_back(key, owner).await;
                Err(e)
            }
        }
    }

    /// A grant is only worth returning if its session did not end since:
    /// a lease the session's end was already reported for would go
    /// unreported, and say "held" until its first renewal.
    fn still_alive(
        &self,
        session: &LockSession,
        attempt: Result<AcquireAttempt, BackendError>,
    ) -> Result<AcquireAttempt, BackendError> {
        match attempt {
            Ok(AcquireAttempt::Acquired(_)) if !session.is_alive() => Err(BackendError::new(
                BackendErrorKind::Unavailable,
                "the lock session ended as the lock was granted; the lock went with it",
            )),
            other => other,
        }
    }

    /// Reads a lock attempt's row: whether the lock was granted. When it was
    /// not (or the session is not the one the statement was meant for, whose
    /// guard then kept the lock from being taken), the holding recorded for
    /// `owner` is dropped.
    fn granted(
        &self,
        session: &LockSession,
        answer: LockAnswer,
        key: AdvisoryKey,
        owner: &OwnerToken,
    ) -> Result<bool, BackendError> {
        if let Err(e) = session.check_backend_pid(answer.pid) {
            self.take_holding(key, owner);
            return Err(e);
        }
        if answer.got != Some(true) {
            self.take_holding(key, owner);
        }
        Ok(answer.got == Some(true))
    }

    /// Gives back a lock taken without its fencing token (the lease is
    /// unusable), as a release does: waits at most the statement timeout,
    /// and the unlock settles in the background if slower.
    async fn give_back(&self, key: AdvisoryKey, owner: &OwnerToken) {
        if let Ok(releasing) = self.begin_release(key, owner) {
            let unlock = self.start_unlock(releasing, key, *owner, false);
            if let Err(e) = wait_for(unlock, self.inner.config.statement_timeout).await {
                warn!(error = %e, "giving back a lock taken without its fencing token did not complete in time");
            }
        }
    }

    /// One round trip: the lock attempt and, if it succeeded, the fencing
    /// token. The caller has recorded the holding for `owner`.
    async fn try_lock_fenced(
        &self,
        session: &Arc<LockSession>,
        key: AdvisoryKey,
        owner: &OwnerToken,
        unsettled: Unsettled,
        info: &HolderInfo,
    ) -> Result<AcquireAttempt, BackendError> {
        let answer = session
            .try_lock(key, true, unsettled, self.attach(info))
            .await?;
        if !self.granted(session, answer, key, owner)? {
            return Ok(AcquireAttempt::HeldElsewhere);
        }
        let token = answer.token;
        let token = token
            .and_then(|t| u64::try_from(t).ok())
            .ok_or_else(|| protocol(format!("the fencing sequence returned {token:?}")));
        match token {
            Ok(t) => {
                if !answer.recorded {
                    self.record_holder(session, key, info, Some(t), false).await;
                }
                Ok(AcquireAttempt::Acquired(Lease::new(Some(t))))
            }
            Err(e) => {
                self.give_back(key, owner).await;
                Err(e)
            }
        }
    }
}
