//! A Postgres [`LockBackend`](lock_core::LockBackend): session-scoped
//! advisory locks.
//!
//! # The session model
//!
//! A Postgres advisory lock has no TTL on the server: it lives as long as the
//! database session that took it. A [`PostgresBackend`] owns dedicated lock
//! sessions (connections kept open, never handed to a pool; 1 by default,
//! [`PostgresBuilder::with_lock_sessions`] or the URL parameter
//! `lock_sessions`, 1 to 64) and takes each lock with
//! `pg_try_advisory_lock(key1 int4, key2 int4)` on the session the hash of
//! its key picks, so each session holds many locks. More than one session
//! limits what the end of one loses, and what one slow statement holds up,
//! to a share of the locks; one gathers the most concurrent calls into each
//! statement (below), which is fastest.
//! Sessions connect on first use. Clones of a backend share them.
//! Lock attempts, unlocks and liveness proofs that arrive while a few of
//! the same kind are in flight on their session wait for one of them to
//! answer and then go together, as one statement (over an array of keys):
//! a burst of a thousand (a thousand jobs firing at the same instant) pays
//! a session's per-statement cost a few times, not a thousand. A lone call
//! waits for nothing.
//! Because advisory locks are re-entrant within a session, the backend keeps
//! its own table of which owner token holds which key, and answers "held" to
//! a second acquire of a key its session already holds: two
//! [`Locker`](lock_core::Locker)s over one backend still exclude each other.
//!
//! # What "renew" means
//!
//! Nothing expires on the server, so a renewal proves that the session
//! holding the lease is alive and is still the same server process: one
//! `SELECT pg_backend_pid()` per session, however many leases it holds
//! (`renew_many`; the sessions answer concurrently). Once the holder tables
//! exist, the same statement stamps the session's proof time and reads the
//! marks of forced releases (see "Inspection and forced release"). A live session still
//! holds every lock it took: only the session itself can unlock them, which
//! this crate does only in a release. The TTL is the client's
//! failure-detection bound: a lease stays valid locally for one TTL after
//! the last proof was requested.
//!
//! # When the session ends
//!
//! When a lock session ends (`pg_terminate_backend`, `idle_session_timeout`, a
//! shutdown, a broken connection), the server frees every lock on it at
//! once; the other sessions' locks are untouched. The backend tells
//! lock-core at that moment, through its
//! [`LossFeed`](lock_core::backend::LossFeed): every lease on that session is marked
//! lost (`expired`) in every [`Locker`](lock_core::Locker), as soon as the
//! task driving the connection sees it close or a statement fails with a
//! connection or shutdown error. A terminating server sends its error
//! before it frees the locks, so the holders hear of it before anyone else
//! can be granted one of them. Later acquires connect a fresh session.
//!
//! # Releases that fail
//!
//! A session holds many locks of the backend, so ending it to clean up
//! after one failed unlock would take all the others on it with it. A release
//! whose unlock does not answer within the statement timeout (a slow but
//! healthy server) or fails returns that error, and the session is kept:
//! the key stays reserved for its owner while the unlock goes on in the
//! background (waited for twice the statement timeout, then tried once
//! more). Only if that fails too is the session ended, and then every lease
//! on it is first marked lost (`backend_error`), before the socket closes
//! and the server frees the locks.
//!
//! # TTL vs keepalive: why a vanished client stays safe
//!
//! If a client vanishes without closing its socket (crash of the host,
//! partition), the server keeps the session, and its locks, until TCP tells
//! it the peer is gone. That release must come only after the client's own
//! validity bound has run out, or a successor could enter while the old
//! holder still believes it holds the lock. The session therefore sets, from
//! the configured [`max_ttl`](PostgresBuilder::with_max_ttl) `M`:
//!
//! - `tcp_keepalives_idle = ceil(M)` seconds, `tcp_keepalives_interval = 1`,
//!   `tcp_keepalives_count = 3`;
//! - `tcp_user_timeout = (ceil(M) + 1)` seconds.
//!
//! With `tcp_user_timeout` set, Linux drops a silent peer no earlier than
//! that timeout after it last heard from it, whether keepalives or data went
//! unanswered. The last thing heard is a renewal, sent at or after the
//! instant from which the client counts its validity, so the server frees the
//! lock at least one second after the client's deadline (`≤ M`) passed, and
//! typically within about `M + 2` s. Acquires with a TTL above `M` are
//! refused with a `Config` error. (A client that exits or closes its socket
//! frees its locks at once.)
//!
//! # Standbys and failover
//!
//! Advisory locks are session state of the server the session is on. They
//! are **not** replicated: a lock held on a primary does not exist on its
//! standby, and a lock taken on a standby would exclude nothing on the
//! primary, so a lock session on a standby (or any read-only session) is
//! refused with a `Config` error. List every host with
//! `target_session_attrs=read-write`
//! (`postgres://h1:5432,h2:5432/db?target_session_attrs=read-write`): each
//! new session tries the hosts in order and keeps the first that accepts
//! writes, so sessions opened after a failover find the new primary.
//!
//! What replicates is ordinary data, with the primary's WAL:
//!
//! - the fencing sequence. `nextval` logs 32 values ahead, so after a
//!   promotion the sequence continues from the last logged value: tokens
//!   skip ahead, and never go back for values the standby received;
//! - the scheduler's tick table: the latest completed tick per job and the
//!   completion marks of single ticks. A finished tick whose mark reached
//!   the standby is not run again on the promoted server, and missed ticks
//!   are counted from the replicated latest tick;
//! - not the locks. A tick's lock kept as its completion mark (see the
//!   scheduler) vanishes with the session; the replicated mark still guards
//!   the tick.
//!
//! What a failover does to holders: when the old primary stops, it ends
//! every session (a fast shutdown sends each one its termination error, a
//! crash closes the connections), and every lease on the session is marked
//! lost (`expired`) at that moment, not at its next renewal; jobs abort.
//! Until the standby is promoted, acquires fail as `Unavailable` (every
//! host is down or read-only: fail closed, and the scheduler counts those
//! ticks `unavailable`); the first acquire after the promotion connects a
//! new session to it. Nothing is waited out: the locks are free on the
//! promoted server at once, so the holders must have let go before, which
//! the ending of their sessions ensures. The fault suite's
//! `postgres::chaos_failover` stops a primary (fast, then immediate) under
//! holders and per-tick schedulers and promotes its standby: holders
//! aborted within a few milliseconds of the stop, before any lock was
//! granted on the promoted server, and reacquired there through the
//! multi-host URL once `pg_ctl promote` finished (a few hundred
//! milliseconds); no token went back, no tick finished twice.
//!
//! Two limits, both of Postgres replication rather than of this crate:
//!
//! - With asynchronous replication (the default), a primary that *crashes*
//!   can take its last commits with it (a clean shutdown first sends all of
//!   its WAL to the standby). A lost tick mark lets a finished tick run
//!   again; a lost sequence record lets tokens drawn just before the crash
//!   be drawn again. Where that matters, use synchronous replication
//!   (`synchronous_standby_names`, with `synchronous_commit = on`): a commit
//!   (a token, a mark) then returns only once the standby has it.
//! - The old primary must be stopped (or cut off from every client) before
//!   the standby is promoted, as failover managers do. Two primaries that
//!   both accept sessions each grant every lock, and their sequences hand
//!   out the same tokens.
//!
//! # Poolers
//!
//! Transaction-mode poolers (PgBouncer with `pool_mode = transaction`, and
//! similar) break session locks: consecutive statements may run on different
//! server sessions, so a lock taken by one statement is held by a server
//! connection the client no longer controls, and can stay held forever.
//! Every lock statement (acquire, renew, release, fencing) also returns
//! `pg_backend_pid()`, and the lock and unlock statements act only when it
//! matches the session's pid. When it changes, the backend refuses with a
//! `Config` error naming the pooler. A pooler that happens to keep handing back the same server
//! connection cannot be detected; connect directly or through a
//! session-mode pool.
//!
//! # Fencing
//!
//! With fencing on (the default), each acquire draws `nextval` of a sequence
//! in the lock statement's round trip; with
//! [`PostgresBuilder::with_fencing_tokens`]`(false)` no acquire touches the
//! sequence and leases carry no token; the sequence is created on first use by exactly one
//! DDL statement, by default:
//!
//! ```sql
//! CREATE SEQUENCE IF NOT EXISTS "public"."lock_fencing"
//! ```
//!
//! A role without `CREATE` on the schema gets an `Auth` error naming the
//! statement; create the sequence once as its owner and grant `USAGE` on it,
//! or turn fencing off ([`PostgresBuilder::with_fencing_tokens`]) for read-only roles.
//!
//! # Inspection and forced release
//!
//! Advisory keys are hashes, so `pg_locks` alone can say neither which lock
//! a row is nor who took it. Each acquire therefore writes a *holder row*
//! (namespace, name, key, the holding session's `pg_backend_pid()`, fencing
//! token, the [`Locker`](lock_core::Locker)'s
//! [`Identity`](lock_core::Identity), server time) into
//! `"public"."lock_holders"` ([`PostgresBuilder::with_holder_table`]), and
//! each renewal stamps its session's row in `lock_holders_sessions` with the
//! server time of the proof. Once the tables are known to exist, both go in
//! the lock and renewal statements themselves (no extra round trip), and a
//! release deletes the row in its unlock statement. The first acquire of a
//! backend writes its row in a statement of its own and creates the tables
//! if they are missing ([`PostgresBackend::holder_table_ddl`]). Both tables
//! are `UNLOGGED`: they describe session state, which is not replicated
//! either, and their writes add no WAL flush to an acquire. A role that can
//! neither create nor write them still takes locks (a warning says so,
//! retried once a minute); its locks then show as held by an unknown
//! holder.
//!
//! The rows cost a write in each acquire and each release statement: on a
//! loaded two-core machine the bench's acquire+release at concurrency 1
//! went from a median of about 0.25 ms to about 0.45 ms (debug build,
//! private server), about 0.2 ms of it server time. A deployment that wants
//! that time back turns the rows off
//! ([`PostgresBuilder::with_holder_records`]); its locks are then still
//! described as held, by an unknown holder.
//!
//! - [`describe`](lock_core::LockBackend::describe) reads `pg_locks` for
//!   the name's key and joins the holder row *of the session holding it*:
//!   a lock is held exactly when `pg_locks` shows it granted, whatever the
//!   rows say. A row left by a session that ended without releasing (a
//!   crash) is ignored; a lock taken by another program
//!   (`psql -c "SELECT pg_advisory_lock(k1, k2)"`, an older version of this
//!   crate) shows as held by [`Holder::unknown`](lock_core::Holder::unknown),
//!   never as free. `expires_at` is always `None`: the lock lives as long
//!   as its session, and the TTL is only the holder's own failure-detection
//!   bound. `renewed_at` is the server time of the holding session's last
//!   proof of life (every renewal on that session proves all its leases).
//! - [`list`](lock_core::LockBackend::list) reads the holder rows under the
//!   prefix in name order (the cursor is the last name of the page) and
//!   keeps those whose session holds their key per `pg_locks`. Locks taken
//!   by programs that write no row cannot be listed: no name is known for
//!   their key. `describe` by name finds them.
//! - [`force_release`](lock_core::LockBackend::force_release): only the
//!   session holding an advisory lock can unlock it, and ending that
//!   session (`pg_terminate_backend`) would end every other lease on it.
//!   So a forced release is a mark: one statement sets `forced` on the
//!   holder row only if its token is the expected one *and* its session
//!   holds the key per `pg_locks` (else `TokenMismatch` with the holder's
//!   token, or `NotHeld`). The holder's next renewal, whose statement reads
//!   the marks of its session's keys, marks those leases lost
//!   ([`LossReason::Forced`](lock_core::LossReason::Forced)) in every
//!   `Locker` at once, then unlocks the keys on its own session as a release
//!   does (deleting the rows, waking waiters). Other leases on the session
//!   keep their locks. So the lock is free within one renewal interval
//!   (a third of the TTL) plus a round trip after the call returns
//!   `Released`; the suite measured about 0.5 s at a 500 ms interval. A
//!   waiter then gets it with a higher fencing token, as for any acquire.
//!   A holder that does not renew (a stopped process, `SIGSTOP`) keeps the
//!   lock until its session ends: its kernel still answers TCP, so the
//!   server's keepalives do not end the session either. For that case,
//!   [`PostgresBackend::terminate_holder`] ends the holder's session (same
//!   token check) only if it holds no other advisory lock, or when told to
//!   end them all; the holder then sees its session ended (`expired`) when
//!   it runs again.
//!
//! Every answer is a snapshot that may be stale when it returns: show it,
//! never decide to write on it.
//!
//! Privileges, for a role other than the tables' owner:
//!
//! | call | needs |
//! |---|---|
//! | acquire, renew, release (with holder data) | `INSERT`, `UPDATE`, `DELETE`, `SELECT` on both tables (or `CREATE` on the schema, once, to create them) |
//! | `describe`, `list` | `SELECT` on both tables; `pg_locks` is readable by every role. Before the tables exist, `describe` answers from `pg_locks` alone |
//! | `force_release` | `SELECT` and `UPDATE` on `lock_holders` |
//! | [`PostgresBackend::terminate_holder`] | `SELECT` on `lock_holders`, and the right to signal the holder's server process (superuser, membership in the holder's role, or `pg_signal_backend`) |
//!
//! No superuser right is needed for any of them but the last.
//!
//! # Release notification
//!
//! Waiting acquires `LISTEN lock_release` on one extra connection per
//! backend and, while they wait for a key, hold a shared `bigint` advisory
//! lock on its *wait marker* there (`pg_locks` shows it with
//! `objsubid = 1` and a salted `classid`). A release through this crate
//! announces itself with `NOTIFY lock_release, 'key1:key2'` only when it
//! cannot take that marker, that is, only when someone waits: `NOTIFY`
//! serialises every notifying commit on the server, so releases nobody
//! waits for do not pay for it. Locks that end otherwise (a session that
//! dies, an unlock from another program) are found by polling, as is a
//! release that raced a waiter's subscription. Turn it off with
//! [`PostgresBuilder::with_release_notify`].
//!
//! # Keys
//!
//! A name maps to a two-`int4` key by the stable hash documented on
//! [`AdvisoryKey`], inside a configurable namespace; explicit keys
//! ([`PostgresBuilder::with_explicit_key`]) interoperate with programs
//! that lock a fixed pair with `pg_try_advisory_lock(a, b)`.
//!
//! # Requirements
//!
//! PostgreSQL 12 or later (for `tcp_user_timeout`). Each held lock takes a
//! slot in the server's shared lock table (`max_locks_per_transaction ×
//! max_connections` slots in all).
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use lock_core::{LockName, LockOptions, Locker};
//! use lock_postgres::PostgresBuilder;
//!
//! let locker = Locker::new(PostgresBuilder::from_env()?.connect().await?)?;
//! let guard = locker
//!     .try_lock(&LockName::new("cron/leader")?, &LockOptions::new(Duration::from_secs(10)))
//!     .await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod acquire;
mod attempts;
mod backend;
mod config;
mod error;
mod fencing;
mod holders;
mod key;
mod lifeline;
mod notify;
mod release;
mod renew;
mod session;
mod sessions;
#[cfg(feature = "test-util")]
mod test_util;
mod tick_batch;
mod tick_checked;
#[cfg(test)]
mod tick_plans;
mod tick_runs;
mod tick_runs_batch;
mod ticks;
mod unlocks;

pub use backend::PostgresBackend;
pub use config::{PostgresBuilder, PostgresConfig, SslMode, ENV_VAR, URL_SCHEMES};
pub use key::AdvisoryKey;
