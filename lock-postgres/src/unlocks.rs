//! Unlocks, as a [`Batch`]: unlocks on one session that queue in its lane
//! ([`lock_core::lane`]) go together, as one statement over arrays of keys
//! (`unnest`); a lone unlock is sent as the single-key statement. Each
//! key's release announcement, when asked for, is in the same statement.

use std::sync::Arc;
use std::time::Duration;

use lock_core::lane::{self, Batch, Lane};
use lock_core::BackendError;
use tokio::time::timeout;
use tokio_postgres::types::Type;

use crate::attempts::{IN_FLIGHT, MAX_BATCH};
use crate::error::{protocol, timed_out};
use crate::notify::{payload, wait_marker, CHANNEL};
use crate::session::LockSession;
use crate::AdvisoryKey;

pub(crate) const UNLOCK: &str = "SELECT pg_backend_pid(), \
     CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END";

/// The unlock and, only when it freed the lock and someone waits for it (a
/// listener holds its wait marker, so the marker cannot be taken
/// exclusively), the release announcement, in one round trip (the
/// notification leaves when the statement commits, and the marker taken
/// when nobody waits is let go then too).
pub(crate) const UNLOCK_NOTIFY: &str = "SELECT s.pid, s.freed, \
     CASE WHEN s.freed AND NOT pg_try_advisory_xact_lock($6) THEN pg_notify($4, $5)::text END \
     FROM (SELECT pg_backend_pid() AS pid, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock($1, $2) END AS freed) s";

/// [`UNLOCK_NOTIFY`] over arrays of keys, each announced only if asked
/// (`n`), one row per key with its position.
pub(crate) const UNLOCK_MANY: &str = "SELECT s.pid, s.i, s.freed, \
     CASE WHEN s.freed AND s.n AND NOT pg_try_advisory_xact_lock(s.m) THEN pg_notify($4, s.p)::text END \
     FROM (SELECT pg_backend_pid() AS pid, k.i, k.n, k.m, k.p, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_advisory_unlock(k.a, k.b) END AS freed \
       FROM unnest($1::int4[], $2::int4[], $5::bool[], $6::int8[], $7::text[]) \
         WITH ORDINALITY AS k(a, b, n, m, p, i)) s";

/// One unlock: the key, and whether to announce its release.
type Unlock = (AdvisoryKey, bool);

/// Unlocks on one session.
#[derive(Debug)]
pub(crate) struct Unlocks;

impl Batch for Unlocks {
    type Host = LockSession;
    type Item = Unlock;
    type Answer = bool;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(session: &LockSession) -> &Lane<Self> {
        &session.lanes().unlocks
    }

    async fn run(session: &LockSession, items: Vec<Unlock>) -> Vec<Result<bool, BackendError>> {
        lane::each(session.unlock_batch(&items).await, items.len())
    }
}

/// Unlocks `key` on `session` in the next statement of unlocks, waiting at
/// most `limit`; with `announce`, the same statement tells waiters (best
/// effort: a waiter that misses it finds the lock free at its next poll).
/// Returns whether the session held it.
///
/// Not cancel safe: the statement goes on without a caller that gives up
/// (or times out), so whether it ran is then unknown; a later unlock of the
/// same key on the session runs after it.
pub(crate) async fn unlock(
    session: &Arc<LockSession>,
    key: AdvisoryKey,
    announce: bool,
    limit: Duration,
) -> Result<bool, BackendError> {
    match timeout(limit, lane::call::<Unlocks>(session, (key, announce))).await {
        Ok(freed) => freed,
        Err(_) => Err(timed_out("releasing an advisory lock", limit)),
    }
}

impl LockSession {
    /// Runs one statement for `unlocks`: whether each key was freed, in
    /// order. Waits at most twice the statement timeout, the longest any
    /// caller waits for an unlock.
    ///
    /// Once the holder tables are known to exist, the same statement deletes
    /// the holder rows of the keys; if they vanished since, it runs again
    /// without (the missing table fails the statement before it runs).
    async fn unlock_batch(&self, unlocks: &[Unlock]) -> Result<Vec<bool>, BackendError> {
        let holders = self.lanes().holders.as_ref();
        if holders.ready() {
            match self.unlock_statement(unlocks, true).await {
                Err(e) if holders.missing(&e) => {}
                other => return other,
            }
        }
        self.unlock_statement(unlocks, false).await
    }

    /// [`LockSession::unlock_batch`]'s statement, with or without the
    /// holder rows' deletion.
    async fn unlock_statement(
        &self,
        unlocks: &[Unlock],
        delete_rows: bool,
    ) -> Result<Vec<bool>, BackendError> {
        let sql = self.lanes().holders.as_ref();
        let pid = self.pid();
        let what = "releasing an advisory lock";
        let limit = self.statement_timeout().saturating_mul(2);
        if let [(key, announce)] = unlocks {
            let text = payload(*key);
            let marker = wait_marker(*key);
            let rows = if *announce {
                self.query_prepared_within(
                    what,
                    if delete_rows {
                        &sql.unlock_notify
                    } else {
                        UNLOCK_NOTIFY
                    },
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                        (&CHANNEL, Type::TEXT),
                        (&text.as_str(), Type::TEXT),
                        (&marker, Type::INT8),
                    ],
                    limit,
                )
                .await?
            } else {
                self.query_prepared_within(
                    what,
                    if delete_rows { &sql.unlock } else { UNLOCK },
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                    ],
                    limit,
                )
                .await?
            };
            let row = rows
                .first()
                .ok_or_else(|| protocol("pg_advisory_unlock returned no row"))?;
            self.check_pid(row)?;
            let freed = row
                .try_get::<_, Option<bool>>(1)
                .map_err(|e| protocol(e.to_string()))?;
            return Ok(vec![freed.unwrap_or(false)]);
        }
        let key1: Vec<i32> = unlocks.iter().map(|(k, _)| k.key1).collect();
        let key2: Vec<i32> = unlocks.iter().map(|(k, _)| k.key2).collect();
        let announce: Vec<bool> = unlocks.iter().map(|(_, a)| *a).collect();
        let markers: Vec<i64> = unlocks.iter().map(|(k, _)| wait_marker(*k)).collect();
        let texts: Vec<String> = unlocks.iter().map(|(k, _)| payload(*k)).collect();
        let rows = self
            .query_prepared_within(
                what,
                if delete_rows {
                    &sql.unlock_many
                } else {
                    UNLOCK_MANY
                },
                &[
                    (&key1, Type::INT4_ARRAY),
                    (&key2, Type::INT4_ARRAY),
                    (&pid, Type::INT4),
                    (&CHANNEL, Type::TEXT),
                    (&announce, Type::BOOL_ARRAY),
                    (&markers, Type::INT8_ARRAY),
                    (&texts, Type::TEXT_ARRAY),
                ],
                limit,
            )
            .await?;
        let mut freed: Vec<Option<bool>> = vec![None; unlocks.len()];
        for row in &rows {
            self.check_pid(row)?;
            let position: Option<i64> = row.try_get(1).map_err(|e| protocol(e.to_string()))?;
            let slot = position
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| i.checked_sub(1))
                .and_then(|i| freed.get_mut(i))
                .ok_or_else(|| {
                    protocol(format!("pg_advisory_unlock answered position {position:?}"))
                })?;
            let got: Option<bool> = row.try_get(2).map_err(|e| protocol(e.to_string()))?;
            *slot = Some(got.unwrap_or(false));
        }
        freed
            .into_iter()
            .map(|f| f.ok_or_else(|| protocol("pg_advisory_unlock left a key unanswered")))
            .collect()
    }
}
