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
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

use crate::error::{protocol, timed_out};
use crate::holders::{HolderInfo, HolderSql};
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
    /// Whether the statement wrote the lock's holder row (when taken).
    pub(crate) recorded: bool,
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
    /// The holder table's statements, shared by the backend's sessions.
    pub(crate) holders: Arc<HolderSql>,
}

impl Lanes {
    pub(crate) fn new(sequence: String, holders: Arc<HolderSql>) -> Self {
        Self {
            plain: Lane::default(),
            fenced: Lane::default(),
            alive: Lane::default(),
            unlocks: Lane::default(),
            sequence,
            holders,
        }
    }
}

/// One attempt: its key, what settles it when dropped, once its statement
/// answered or failed, and the holder row to write if it takes the lock.
type Attempt = (AdvisoryKey, Unsettled, Option<HolderInfo>);

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

/// Implements [`Batch`] for one kind of attempt: `$kind`'s calls queue in
/// the session's lane `$lane`, and its statement draws fencing tokens when
/// `$fenced`. Plain and fenced attempts differ only there, and each needs
/// a lane of its own, so each is a type of its own.
macro_rules! attempt_batch {
    ($kind:ty, $lane:ident, $fenced:expr) => {
        impl Batch for $kind {
            type Host = LockSession;
            type Item = Attempt;
            type Answer = LockAnswer;
            const IN_FLIGHT: usize = IN_FLIGHT;
            const MAX_BATCH: usize = MAX_BATCH;

            fn lane(session: &LockSession) -> &Lane<Self> {
                &session.lanes().$lane
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
                lane::each(session.try_lock_batch(&items, $fenced).await, items.len())
            }
        }
    };
}

attempt_batch!(Plain, plain, false);
attempt_batch!(Fenced, fenced, true);

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
        holder: Option<HolderInfo>,
    ) -> Result<LockAnswer, BackendError> {
        if fenced {
            lane::call::<Fenced>(self, (key, unsettled, holder)).await
        } else {
            lane::call::<Plain>(self, (key, unsettled, holder)).await
        }
    }

    /// Runs one statement for `attempts`: one answer per key, in order.
    ///
    /// When the holder tables are known to exist and an attempt carries a
    /// holder row, the statement writes the rows of the locks it takes; if
    /// the tables vanished since, it runs again without (a missing table
    /// fails the statement before any lock is taken).
    async fn try_lock_batch(
        &self,
        attempts: &[Attempt],
        fenced: bool,
    ) -> Result<Vec<LockAnswer>, BackendError> {
        let holders = self.lanes().holders.as_ref();
        if holders.ready() && attempts.iter().any(|(_, _, h)| h.is_some()) {
            match self.try_lock_recording(attempts, fenced).await {
                Err(e) if holders.missing(&e) => {}
                other => return other,
            }
        }
        self.try_lock_statement(attempts, fenced).await
    }

    /// The lock statement that also writes the holder rows.
    async fn try_lock_recording(
        &self,
        attempts: &[Attempt],
        fenced: bool,
    ) -> Result<Vec<LockAnswer>, BackendError> {
        let sql = self.lanes().holders.as_ref();
        let pid = self.pid();
        let sequence = self.lanes().sequence.as_str();
        let ns = sql.namespace.as_str();
        let what = "pg_try_advisory_lock";
        if let [(key, _, holder)] = attempts {
            let name = holder.as_ref().map(|h| h.name.as_str());
            let identity = holder.as_ref().and_then(|h| h.identity.as_deref());
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
                (&key.key1, Type::INT4),
                (&key.key2, Type::INT4),
                (&pid, Type::INT4),
                (&ns, Type::TEXT),
                (&name, Type::TEXT),
                (&identity, Type::TEXT),
            ];
            if fenced {
                params.push((&sequence, Type::TEXT));
            }
            let text = if fenced {
                &sql.try_lock_fenced
            } else {
                &sql.try_lock
            };
            let rows = self.query_prepared(what, text, &params).await?;
            let row = rows
                .first()
                .ok_or_else(|| protocol("pg_try_advisory_lock returned no row"))?;
            return Ok(vec![LockAnswer {
                pid: read::<i32>(row, 0)?.unwrap_or_default(),
                got: read(row, 1)?,
                token: read(row, 2)?,
                recorded: holder.is_some(),
            }]);
        }
        let (key1, key2): (Vec<i32>, Vec<i32>) =
            attempts.iter().map(|(k, _, _)| (k.key1, k.key2)).unzip();
        let names: Vec<Option<&str>> = attempts
            .iter()
            .map(|(_, _, h)| h.as_ref().map(|h| h.name.as_str()))
            .collect();
        let identities: Vec<Option<&str>> = attempts
            .iter()
            .map(|(_, _, h)| h.as_ref().and_then(|h| h.identity.as_deref()))
            .collect();
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
            (&key1, Type::INT4_ARRAY),
            (&key2, Type::INT4_ARRAY),
            (&pid, Type::INT4),
            (&ns, Type::TEXT),
            (&names, Type::TEXT_ARRAY),
            (&identities, Type::TEXT_ARRAY),
        ];
        if fenced {
            params.push((&sequence, Type::TEXT));
        }
        let text = if fenced {
            &sql.try_lock_many_fenced
        } else {
            &sql.try_lock_many
        };
        let rows = self.query_prepared(what, text, &params).await?;
        let recorded: Vec<bool> = names.iter().map(Option::is_some).collect();
        answers_of(&rows, attempts.len(), true, &recorded)
    }

    /// The plain lock statement.
    async fn try_lock_statement(
        &self,
        attempts: &[Attempt],
        fenced: bool,
    ) -> Result<Vec<LockAnswer>, BackendError> {
        let keys: Vec<AdvisoryKey> = attempts.iter().map(|(key, _, _)| *key).collect();
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
                recorded: false,
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
        answers_of(&rows, keys.len(), fenced, &vec![false; keys.len()])
    }
}

/// The answers of a statement over arrays of keys: rows of `pid, position,
/// got, token`, one per key.
fn answers_of(
    rows: &[Row],
    count: usize,
    fenced: bool,
    recorded: &[bool],
) -> Result<Vec<LockAnswer>, BackendError> {
    let mut answers: Vec<Option<LockAnswer>> = vec![None; count];
    for row in rows {
        let position: Option<i64> = read(row, 1)?;
        let index = position
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| i.checked_sub(1));
        let slot = index.and_then(|i| answers.get_mut(i)).ok_or_else(|| {
            protocol(format!(
                "pg_try_advisory_lock answered position {position:?}"
            ))
        })?;
        *slot = Some(LockAnswer {
            pid: read::<i32>(row, 0)?.unwrap_or_default(),
            got: read(row, 2)?,
            token: if fenced { read(row, 3)? } else { None },
            recorded: index
                .and_then(|i| recorded.get(i))
                .copied()
                .unwrap_or(false),
        });
    }
    answers
        .into_iter()
        .map(|a| a.ok_or_else(|| protocol("pg_try_advisory_lock left a key unanswered")))
        .collect()
}

/// Reads column `i` of `row`.
fn read<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<Option<T>, BackendError> {
    row.try_get::<_, Option<T>>(i)
        .map_err(|e| protocol(e.to_string()))
}
