//! Lock attempts, as a [`Batch`]: attempts on one session that queue in its
//! lane ([`lock_core::lane`]) go together, as one statement over arrays of keys
//! (`unnest`); a lone attempt is sent as the single-key statement.
//!
//! An attempt that is queued but not yet sent could be overtaken by a
//! release of the same key (a caller that gave up, whose `Locker` releases
//! the token it tried): the release's unlock would run first, find nothing,
//! and the attempt would then take a lock nobody releases. So each attempt
//! carries an [`Unsettled`] whose [`Settled`](lock_core::lane::Settled)
//! its holding keeps, and a release waits for it before it unlocks.

use std::sync::Arc;
use std::time::Duration;

use lock_core::lane::{self, Batch, Lane, Unsettled};
use lock_core::BackendError;
use tokio_postgres::types::Type;
use tokio_postgres::Row;

use crate::error::{protocol, timed_out};
use crate::renew::Alive;
use crate::session::LockSession;
use crate::unlocks::Unlocks;
use crate::AdvisoryKey;

const TRY_LOCK: &str = "SELECT pg_backend_pid(), \
     CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock($1, $2) END";

/// The lock attempt and, only when it succeeded, the fencing token, in one
/// round trip. The subquery holds a volatile call, so the planner keeps it
/// apart and `pg_try_advisory_lock` runs once per execution.
const TRY_LOCK_FENCED: &str = "SELECT s.pid, s.got, \
     CASE WHEN s.got THEN nextval($4::text::regclass) END \
     FROM (SELECT pg_backend_pid() AS pid, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock($1, $2) END AS got) s";

/// [`TRY_LOCK`] over arrays of keys, one row per key with its position.
const TRY_LOCK_MANY: &str = "SELECT pg_backend_pid(), k.i, \
     CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock(k.a, k.b) END \
     FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i)";

/// [`TRY_LOCK_FENCED`] over arrays of keys: a token for each key taken.
const TRY_LOCK_MANY_FENCED: &str = "SELECT s.pid, s.i, s.got, \
     CASE WHEN s.got THEN nextval($4::text::regclass) END \
     FROM (SELECT pg_backend_pid() AS pid, k.i, \
       CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock(k.a, k.b) END AS got \
       FROM unnest($1::int4[], $2::int4[]) WITH ORDINALITY AS k(a, b, i)) s";

/// What the server answered for one key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LockAnswer {
    /// The server process that ran the statement.
    pub(crate) pid: i32,
    /// Whether the lock was taken; `None` when the statement ran on another
    /// server process than the session's (its guard then took nothing).
    pub(crate) got: Option<bool>,
    /// The fencing token drawn for a taken lock, when asked for.
    pub(crate) token: Option<i64>,
}

/// The lanes of one session ([`lock_core::lane`]): plain attempts, attempts
/// that draw a fencing token from `sequence`, liveness proofs and unlocks.
///
/// Why lanes: the end of every statement walks all the locks its session
/// holds (see `sessions`), so a thousand calls sent one statement each pay
/// that walk a thousand times, where one statement over arrays pays it once.
#[derive(Debug)]
pub(crate) struct Lanes {
    plain: Lane<Plain>,
    fenced: Lane<Fenced>,
    pub(crate) alive: Lane<Alive>,
    pub(crate) unlocks: Lane<Unlocks>,
    /// The fencing sequence, schema-qualified and quoted.
    sequence: String,
}

impl Lanes {
    pub(crate) fn new(sequence: String) -> Self {
        Self {
            plain: Lane::default(),
            fenced: Lane::default(),
            alive: Lane::default(),
            unlocks: Lane::default(),
            sequence,
        }
    }
}

/// One attempt: its key, and what settles it when dropped, once its
/// statement answered or failed.
type Attempt = (AdvisoryKey, Unsettled);

/// The most statements of one kind in flight on one session: a few keep a
/// lightly loaded session pipelined, so a lone call waits for nothing.
pub(crate) const IN_FLIGHT: usize = 4;

/// The most calls one statement carries.
pub(crate) const MAX_BATCH: usize = 1000;

/// Plain attempts.
#[derive(Debug)]
pub(crate) struct Plain;

/// Attempts that draw a fencing token when they take the lock.
#[derive(Debug)]
pub(crate) struct Fenced;

impl Batch for Plain {
    type Host = LockSession;
    type Item = Attempt;
    type Answer = LockAnswer;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(session: &LockSession) -> &Lane<Self> {
        &session.lanes().plain
    }

    fn queued_limit(session: &LockSession) -> Option<Duration> {
        Some(session.statement_timeout())
    }

    fn timed_out(_: &LockSession, limit: Duration) -> BackendError {
        timed_out("pg_try_advisory_lock", limit)
    }

    async fn run(
        session: &LockSession,
        items: Vec<Attempt>,
    ) -> Vec<Result<LockAnswer, BackendError>> {
        lane::each(session.try_lock_batch(&items, false).await, items.len())
    }
}

impl Batch for Fenced {
    type Host = LockSession;
    type Item = Attempt;
    type Answer = LockAnswer;
    const IN_FLIGHT: usize = IN_FLIGHT;
    const MAX_BATCH: usize = MAX_BATCH;

    fn lane(session: &LockSession) -> &Lane<Self> {
        &session.lanes().fenced
    }

    fn queued_limit(session: &LockSession) -> Option<Duration> {
        Some(session.statement_timeout())
    }

    fn timed_out(_: &LockSession, limit: Duration) -> BackendError {
        timed_out("pg_try_advisory_lock", limit)
    }

    async fn run(
        session: &LockSession,
        items: Vec<Attempt>,
    ) -> Vec<Result<LockAnswer, BackendError>> {
        lane::each(session.try_lock_batch(&items, true).await, items.len())
    }
}

impl LockSession {
    /// Tries to take `key` on this session (with `fenced`, drawing a fencing
    /// token when taken), in the next statement of attempts. `unsettled` is
    /// dropped once that statement answered or failed.
    ///
    /// Not cancel safe: the statement goes on without a caller that gives
    /// up, and may take the lock; the caller's holding (with the signal)
    /// lets a later release unlock it, after the statement.
    pub(crate) async fn try_lock(
        self: &Arc<Self>,
        key: AdvisoryKey,
        fenced: bool,
        unsettled: Unsettled,
    ) -> Result<LockAnswer, BackendError> {
        if fenced {
            lane::call::<Fenced>(self, (key, unsettled)).await
        } else {
            lane::call::<Plain>(self, (key, unsettled)).await
        }
    }

    /// Runs one statement for `attempts`: one answer per key, in order.
    async fn try_lock_batch(
        &self,
        attempts: &[Attempt],
        fenced: bool,
    ) -> Result<Vec<LockAnswer>, BackendError> {
        let keys: Vec<AdvisoryKey> = attempts.iter().map(|(key, _)| *key).collect();
        let pid = self.pid();
        let sequence = self.lanes().sequence.as_str();
        let what = "pg_try_advisory_lock";
        if let [key] = keys.as_slice() {
            let rows = if fenced {
                self.query_prepared(
                    what,
                    TRY_LOCK_FENCED,
                    &[
                        (&key.key1, Type::INT4),
                        (&key.key2, Type::INT4),
                        (&pid, Type::INT4),
                        (&sequence, Type::TEXT),
                    ],
                )
                .await?
            } else {
                self.query_prepared(
                    what,
                    TRY_LOCK,
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
                .ok_or_else(|| protocol("pg_try_advisory_lock returned no row"))?;
            let token = if fenced { read(row, 2)? } else { None };
            return Ok(vec![LockAnswer {
                pid: read::<i32>(row, 0)?.unwrap_or_default(),
                got: read(row, 1)?,
                token,
            }]);
        }
        let (key1, key2): (Vec<i32>, Vec<i32>) = keys.iter().map(|k| (k.key1, k.key2)).unzip();
        let rows = if fenced {
            self.query_prepared(
                what,
                TRY_LOCK_MANY_FENCED,
                &[
                    (&key1, Type::INT4_ARRAY),
                    (&key2, Type::INT4_ARRAY),
                    (&pid, Type::INT4),
                    (&sequence, Type::TEXT),
                ],
            )
            .await?
        } else {
            self.query_prepared(
                what,
                TRY_LOCK_MANY,
                &[
                    (&key1, Type::INT4_ARRAY),
                    (&key2, Type::INT4_ARRAY),
                    (&pid, Type::INT4),
                ],
            )
            .await?
        };
        let mut answers: Vec<Option<LockAnswer>> = vec![None; keys.len()];
        for row in &rows {
            let position: Option<i64> = read(row, 1)?;
            let slot = position
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| i.checked_sub(1))
                .and_then(|i| answers.get_mut(i))
                .ok_or_else(|| {
                    protocol(format!(
                        "pg_try_advisory_lock answered position {position:?}"
                    ))
                })?;
            *slot = Some(LockAnswer {
                pid: read::<i32>(row, 0)?.unwrap_or_default(),
                got: read(row, 2)?,
                token: if fenced { read(row, 3)? } else { None },
            });
        }
        answers
            .into_iter()
            .map(|a| a.ok_or_else(|| protocol("pg_try_advisory_lock left a key unanswered")))
            .collect()
    }
}

/// Reads column `i` of `row`.
fn read<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<Option<T>, BackendError> {
    row.try_get::<_, Option<T>>(i)
        .map_err(|e| protocol(e.to_string()))
}
