//! Releasing: the unlock, with the release announcement in the same
//! statement.

use lock_core::{BackendError, LockName, OwnerToken, ReleaseOutcome};
use tokio_postgres::types::Type;
use tracing::warn;

use crate::error::protocol;
use crate::notify::{payload, CHANNEL};
use crate::session::LockSession;
use crate::{AdvisoryKey, PostgresBackend};

const UNLOCK: &str = "SELECT pg_backend_pid(), \
     CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END";

/// The unlock and, only when it freed the lock, the release announcement, in
/// one round trip (the notification leaves when the statement commits).
const UNLOCK_NOTIFY: &str = "SELECT s.pid, s.freed, \
     CASE WHEN s.freed THEN pg_notify($4, $5)::text END \
     FROM (SELECT pg_backend_pid() AS pid, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END AS freed) s";

impl PostgresBackend {
    /// Unlocks `key` on `session`; with `announce`, the same statement tells
    /// waiters (best effort: a waiter that misses it finds the lock free at
    /// its next poll).
    pub(crate) async fn unlock(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
        announce: bool,
    ) -> Result<bool, BackendError> {
        let pid = session.pid();
        let text = payload(key);
        let rows = if announce {
            session
                .query_prepared(
                    "releasing an advisory lock",
                    UNLOCK_NOTIFY,
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                        (&CHANNEL, Type::TEXT),
                        (&text.as_str(), Type::TEXT),
                    ],
                )
                .await?
        } else {
            session
                .query_prepared(
                    "releasing an advisory lock",
                    UNLOCK,
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                    ],
                )
                .await?
        };
        let row = rows
            .first()
            .ok_or_else(|| protocol("pg_advisory_unlock returned no row"))?;
        session.check_pid(row)?;
        row.try_get::<_, Option<bool>>(1)
            .map_err(|e| protocol(e.to_string()))
            .map(|v| v.unwrap_or(false))
    }

    /// One release ([`LockBackend::release`](lock_core::LockBackend::release)).
    pub(crate) async fn release_lock(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let key = self.inner.config.key_for(name);
        let Some(holding) = self.take_holding(key, owner) else {
            warn!(lock = %name, "release of a lock this backend does not hold for this owner; nothing unlocked");
            return Ok(ReleaseOutcome::NotHeld);
        };
        if !holding.session.is_alive() {
            // The lock ended with its session.
            return Ok(ReleaseOutcome::NotHeld);
        }
        let announce = self.inner.config.release_notify;
        match self.unlock(&holding.session, key, announce).await {
            Ok(true) => Ok(ReleaseOutcome::Released),
            Ok(false) => {
                warn!(lock = %name, "pg_advisory_unlock found nothing to unlock on this session");
                Ok(ReleaseOutcome::NotHeld)
            }
            Err(e) => {
                // Whether the unlock ran is unknown, so this session's lock
                // count is too; ending the session frees everything it holds
                // instead of leaving a lock behind (its other leases are then
                // reported lost at their next renewal).
                warn!(lock = %name, error = %e, "release failed; ending the lock session");
                holding.session.terminate();
                Err(e)
            }
        }
    }
}
