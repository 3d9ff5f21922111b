//! Lock attempts coalesced per lock session: attempts that arrive while
//! one statement of attempts is in flight on a session go together, as one
//! statement over arrays of keys (`unnest`), as soon as it answers.
//!
//! Why: the end of every statement walks all the locks its session holds
//! (see `sessions`), so a thousand attempts sent one statement each pay
//! that walk a thousand times; as one statement they pay it once. A lone
//! attempt waits for nothing and is sent as the single-key statement, so
//! one caller sees no difference. There is no linger timer: the batch size
//! follows the load.
//!
//! An attempt that is queued but not yet sent could be overtaken by a
//! release of the same key (a caller that gave up, whose `Locker` releases
//! the token it tried): the release's unlock would run first, find nothing,
//! and the attempt would then take a lock nobody releases. So each attempt
//! carries a [`Settled`] signal that its holding keeps, and a release waits
//! for it before it unlocks.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lock_core::{BackendError, BackendErrorKind};
use tokio::sync::{oneshot, watch};
use tokio_postgres::types::Type;
use tokio_postgres::Row;

use crate::error::protocol;
use crate::session::LockSession;
use crate::AdvisoryKey;

/// The most keys one statement carries; a longer queue goes in several.
const MAX_BATCH: usize = 1000;

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

/// Turns true once an attempt's statement has answered or failed (or will
/// never be sent): from then on an unlock of its key runs after it.
pub(crate) type Settled = watch::Receiver<bool>;

/// Waits until the attempt behind `settled` can no longer take its lock
/// after an unlock sent now. Bounded by the attempt's statement timeout.
pub(crate) async fn settled(mut settled: Settled) {
    // An error means the sender is gone, which only happens once the
    // attempt was answered, failed or dropped unsent.
    let _ = settled.wait_for(|done| *done).await;
}

type Reply = oneshot::Sender<Result<LockAnswer, BackendError>>;

/// One queued attempt: its key, where its answer goes, and its signal.
struct Queued {
    key: AdvisoryKey,
    reply: Reply,
    settled: watch::Sender<bool>,
}

/// The attempts of one kind (fenced or not) on one session.
#[derive(Default)]
pub(crate) struct Lane {
    state: Mutex<LaneState>,
}

#[derive(Default)]
struct LaneState {
    queued: Vec<Queued>,
    flushing: bool,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("Lane")
            .field("queued", &state.queued.len())
            .field("flushing", &state.flushing)
            .finish()
    }
}

impl Lane {
    fn state(&self) -> MutexGuard<'_, LaneState> {
        // Each critical section leaves the state whole: poison carries no half-state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The lanes of one session: plain attempts, and attempts that draw a
/// fencing token from `sequence`.
#[derive(Debug)]
pub(crate) struct Lanes {
    plain: Lane,
    fenced: Lane,
    /// The fencing sequence, schema-qualified and quoted.
    sequence: String,
}

impl Lanes {
    pub(crate) fn new(sequence: String) -> Self {
        Self {
            plain: Lane::default(),
            fenced: Lane::default(),
            sequence,
        }
    }
}

impl LockSession {
    /// A new attempt's signal for its holding, and the sender to pass to
    /// [`LockSession::try_lock`].
    pub(crate) fn attempt_signal() -> (watch::Sender<bool>, Settled) {
        watch::channel(false)
    }

    /// Tries to take `key` on this session (with `fenced`, drawing a fencing
    /// token when taken), in the next statement of attempts. `settled` turns
    /// true once that statement answered or failed.
    ///
    /// Not cancel safe: the statement goes on without a caller that gives
    /// up, and may take the lock; the caller's holding (with the signal)
    /// lets a later release unlock it.
    pub(crate) async fn try_lock(
        self: &Arc<Self>,
        key: AdvisoryKey,
        fenced: bool,
        settled: watch::Sender<bool>,
    ) -> Result<LockAnswer, BackendError> {
        let (reply, answer) = oneshot::channel();
        let lane = self.lane(fenced);
        let start = {
            let mut state = lane.state();
            state.queued.push(Queued {
                key,
                reply,
                settled,
            });
            !std::mem::replace(&mut state.flushing, true)
        };
        if start {
            let flusher = Flusher {
                session: Arc::clone(self),
                fenced,
                done: false,
            };
            // Its own task: a caller that gives up does not stop the others'.
            tokio::spawn(flusher.run());
        }
        answer.await.unwrap_or_else(|_| {
            Err(BackendError::new(
                BackendErrorKind::Other,
                "the lock attempt's statement ended without an answer; try again",
            ))
        })
    }

    fn lane(&self, fenced: bool) -> &Lane {
        if fenced {
            &self.lanes().fenced
        } else {
            &self.lanes().plain
        }
    }

    /// Runs one statement for `keys`: one answer per key, in order.
    async fn try_lock_batch(
        &self,
        keys: &[AdvisoryKey],
        fenced: bool,
    ) -> Result<Vec<LockAnswer>, BackendError> {
        let pid = self.pid();
        let sequence = self.lanes().sequence.as_str();
        let what = "pg_try_advisory_lock";
        if let [key] = keys {
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

/// Sends a lane's queued attempts, statement after statement, until none is
/// left; dropped midway (the runtime going away), it frees the lane and the
/// attempts it drops get an error (and are settled: never sent).
struct Flusher {
    session: Arc<LockSession>,
    fenced: bool,
    /// Set once it found the queue empty and freed the lane itself.
    done: bool,
}

impl Flusher {
    async fn run(mut self) {
        // Ends when the queue is empty; every round answers at least one
        // queued attempt, and attempts only queue while their callers wait.
        loop {
            let batch: Vec<Queued> = {
                let mut state = self.session.lane(self.fenced).state();
                if state.queued.is_empty() {
                    state.flushing = false;
                    self.done = true;
                    return;
                }
                let take = state.queued.len().min(MAX_BATCH);
                state.queued.drain(..take).collect()
            };
            let keys: Vec<AdvisoryKey> = batch.iter().map(|q| q.key).collect();
            let answers = self.session.try_lock_batch(&keys, self.fenced).await;
            for (i, q) in batch.into_iter().enumerate() {
                let answer = match &answers {
                    Ok(all) => all
                        .get(i)
                        .copied()
                        .ok_or_else(|| protocol("pg_try_advisory_lock left a key unanswered")),
                    Err(e) => Err(e.copied()),
                };
                // Settled first: a caller that gave up may be releasing.
                let _ = q.settled.send(true);
                // A caller that gave up no longer listens; its holding stays
                // for the release its `Locker` sends.
                let _ = q.reply.send(answer);
            }
        }
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Dropped before the queue emptied: free the lane so the next attempt
        // starts afresh; the queued attempts were never sent, and dropping
        // their senders settles them and fails their callers.
        let mut state = self.session.lane(self.fenced).state();
        state.flushing = false;
        state.queued.clear();
    }
}
