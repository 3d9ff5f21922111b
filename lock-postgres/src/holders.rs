//! Who holds a lock: the holder table written with each acquire, and the
//! statements that read it (`describe`, `list`) and mark a lease for a
//! forced release.
//!
//! Advisory keys are hashes, so `pg_locks` alone cannot say which lock a
//! row is, nor who took it. Each acquire through this crate writes one row
//! (namespace, name, key, the holding session's `pg_backend_pid()`, fencing
//! token, holder identity, server time) in the lock statement itself, once
//! the table is known to exist; each release deletes it in the unlock
//! statement; each renewal records the session's proof of life in one row
//! per session of the companion table. Nothing in these tables is trusted
//! on its own: every read joins them with the advisory locks `pg_locks`
//! shows granted, so a row left by a session that ended (a crash) never
//! makes a free lock look held, and a lock held by a program that writes no
//! row shows as held by an unknown holder.
//!
//! Both tables are `UNLOGGED`: they describe session state, which is not
//! replicated and does not survive a crash either, and their writes then
//! add no WAL flush to the acquire.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use lock_core::{
    inspect::{validate_prefix, ForceOutcome, Holder, HolderPage},
    BackendError, BackendErrorKind, Identity, LockName,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;
use tracing::{debug, warn};

use crate::config::HOLDER_SUFFIX;
use crate::error::protocol;
use crate::session::{LockSession, Params};
use crate::{AdvisoryKey, PostgresBackend, PostgresConfig};

/// Whether the holder table is known to exist here.
const UNKNOWN: u8 = 0;
const READY: u8 = 1;
const UNAVAILABLE: u8 = 2;
/// Turned off by configuration: never written here.
const OFF: u8 = 3;

/// How long after a failed attempt to create or write the holder table
/// (no right to) acquires go without holder rows before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// The holder table's statements for one backend, and whether the table is
/// known to exist. Shared by the backend and its sessions.
#[derive(Debug)]
pub(crate) struct HolderSql {
    state: AtomicU8,
    /// The backend's namespace, stored with each row.
    pub(crate) namespace: String,
    /// When writing holder rows last failed for want of a right.
    failed_at: Mutex<Option<Instant>>,
    /// The two fragments of a "relation does not exist" error for these tables.
    missing: [String; 2],
    pub(crate) ddl: String,
    pub(crate) try_lock: String,
    pub(crate) try_lock_fenced: String,
    pub(crate) try_lock_many: String,
    pub(crate) try_lock_many_fenced: String,
    pub(crate) alive: String,
    pub(crate) unlock: String,
    pub(crate) unlock_notify: String,
    pub(crate) unlock_many: String,
    record: String,
    prune: String,
    describe: String,
    list: String,
    force: String,
    terminate: String,
}

/// The columns an upsert of a holder row sets.
const UPSERT: &str = "ON CONFLICT (namespace, name) DO UPDATE SET key1 = EXCLUDED.key1, \
     key2 = EXCLUDED.key2, pid = EXCLUDED.pid, token = EXCLUDED.token, \
     identity = EXCLUDED.identity, acquired_at = EXCLUDED.acquired_at, forced = false";

/// The granted two-`int4` advisory locks of this database.
const GRANTED: &str = "l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";

impl HolderSql {
    pub(crate) fn new(cfg: &PostgresConfig) -> Self {
        let h = cfg.qualified(&cfg.holder_table);
        let s = cfg.qualified(&format!("{}{HOLDER_SUFFIX}", cfg.holder_table));
        let missing = [
            format!("relation \"{}.{}\"", cfg.schema, cfg.holder_table),
            format!(
                "relation \"{}.{}{HOLDER_SUFFIX}\"",
                cfg.schema, cfg.holder_table
            ),
        ];
        let ddl = format!(
            "CREATE UNLOGGED TABLE IF NOT EXISTS {h} (namespace text NOT NULL, \
             name text COLLATE \"C\" NOT NULL, key1 int4 NOT NULL, key2 int4 NOT NULL, \
             pid int4 NOT NULL, token bigint, identity text, acquired_at timestamptz NOT NULL, \
             forced boolean NOT NULL DEFAULT false, PRIMARY KEY (namespace, name)); \
             CREATE INDEX IF NOT EXISTS \"{t}_pid_key\" ON {h} (pid, key1, key2); \
             CREATE INDEX IF NOT EXISTS \"{t}_forced\" ON {h} (pid) WHERE forced; \
             CREATE UNLOGGED TABLE IF NOT EXISTS {s} (pid int4 PRIMARY KEY, \
             renewed_at timestamptz NOT NULL)",
            t = cfg.holder_table
        );
        let token = |fenced: bool, param: &str| {
            if fenced {
                format!("CASE WHEN s.got THEN nextval({param}::text::regclass) END")
            } else {
                "NULL::int8".to_owned()
            }
        };
        // $1, $2 key; $3 session pid; $4 namespace; $5 name; $6 identity; $7 sequence.
        let single = |fenced: bool| {
            format!(
                "WITH s AS (SELECT pg_backend_pid() AS pid, \
                   CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock($1, $2) END AS got), \
                 t AS (SELECT s.pid, s.got, {tok} AS token FROM s), \
                 w AS (INSERT INTO {h} AS h (namespace, name, key1, key2, pid, token, identity, \
                   acquired_at, forced) SELECT $4, $5, $1, $2, t.pid, t.token, $6, now(), false \
                   FROM t WHERE t.got {UPSERT}) \
                 SELECT t.pid, t.got, t.token FROM t",
                tok = token(fenced, "$7")
            )
        };
        // $1, $2 keys; $3 session pid; $4 namespace; $5 names; $6 identities; $7 sequence.
        let many = |fenced: bool| {
            format!(
                "WITH s AS (SELECT pg_backend_pid() AS pid, k.i, k.a, k.b, k.n, k.d, \
                   CASE WHEN pg_backend_pid() = $3 THEN pg_try_advisory_lock(k.a, k.b) END AS got \
                   FROM unnest($1::int4[], $2::int4[], $5::text[], $6::text[]) \
                     WITH ORDINALITY AS k(a, b, n, d, i)), \
                 t AS (SELECT s.pid, s.i, s.a, s.b, s.n, s.d, s.got, {tok} AS token FROM s), \
                 w AS (INSERT INTO {h} AS h (namespace, name, key1, key2, pid, token, identity, \
                   acquired_at, forced) SELECT $4, t.n, t.a, t.b, t.pid, t.token, t.d, now(), false \
                   FROM t WHERE t.got AND t.n IS NOT NULL {UPSERT}) \
                 SELECT t.pid, t.i, t.got, t.token FROM t",
                tok = token(fenced, "$7")
            )
        };
        // $1 session pid.
        let alive = format!(
            "WITH r AS (INSERT INTO {s} AS r (pid, renewed_at) \
               SELECT pg_backend_pid(), now() WHERE pg_backend_pid() = $1 \
               ON CONFLICT (pid) DO UPDATE SET renewed_at = EXCLUDED.renewed_at) \
             SELECT pg_backend_pid(), f.k1, f.k2 FROM (SELECT array_agg(h.key1) AS k1, \
               array_agg(h.key2) AS k2 FROM {h} h WHERE h.pid = $1 AND h.forced) f"
        );
        let delete_one = format!(
            "WITH d AS (DELETE FROM {h} h WHERE h.pid = $3 AND h.key1 = $1 AND h.key2 = $2) "
        );
        let unlock = format!("{delete_one}{}", crate::unlocks::UNLOCK);
        let unlock_notify = format!("{delete_one}{}", crate::unlocks::UNLOCK_NOTIFY);
        let unlock_many = format!(
            "WITH d AS (DELETE FROM {h} h USING unnest($1::int4[], $2::int4[]) AS k(a, b) \
               WHERE h.pid = $3 AND h.key1 = k.a AND h.key2 = k.b) {}",
            crate::unlocks::UNLOCK_MANY
        );
        // $1 namespace; $2 name; $3, $4 key; $5 token; $6 identity; $7 session pid.
        let record = format!(
            "INSERT INTO {h} AS h (namespace, name, key1, key2, pid, token, identity, \
               acquired_at, forced) SELECT $1, $2, $3, $4, pg_backend_pid(), $5, $6, now(), false \
               WHERE pg_backend_pid() = $7 {UPSERT}"
        );
        let prune = format!(
            "DELETE FROM {h} h WHERE NOT EXISTS \
               (SELECT 1 FROM pg_stat_activity a WHERE a.pid = h.pid); \
             DELETE FROM {s} r WHERE NOT EXISTS \
               (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid)"
        );
        // $1 classid; $2 objid; $3 namespace; $4 name; $5, $6 key.
        let describe = format!(
            "SELECT l.pid, h.identity, h.token, h.acquired_at, \
               GREATEST(h.acquired_at, r.renewed_at) \
             FROM pg_locks l \
             LEFT JOIN {h} h ON h.namespace = $3 AND h.name = $4 AND h.key1 = $5 \
               AND h.key2 = $6 AND h.pid = l.pid \
             LEFT JOIN {s} r ON r.pid = h.pid \
             WHERE {GRANTED} AND l.classid::int8 = $1 AND l.objid::int8 = $2 \
             ORDER BY h.pid IS NULL LIMIT 1"
        );
        // $1 namespace; $2 prefix; $3 after (or NULL); $4 below (or NULL); $5 limit.
        let list = format!(
            "SELECT h.name, h.identity, h.token, h.acquired_at, \
               GREATEST(h.acquired_at, r.renewed_at) \
             FROM {h} h \
             JOIN pg_locks l ON {GRANTED} AND l.pid = h.pid \
               AND l.classid::int8 = (h.key1::int8 & 4294967295) \
               AND l.objid::int8 = (h.key2::int8 & 4294967295) \
             LEFT JOIN {s} r ON r.pid = h.pid \
             WHERE h.namespace = $1 AND h.name >= $2 AND ($3::text IS NULL OR h.name > $3) \
               AND ($4::text IS NULL OR h.name < $4) AND starts_with(h.name, $2) \
             ORDER BY h.name LIMIT $5"
        );
        // $1 classid; $2 objid; $3 namespace; $4 name; $5 token; $6, $7 key.
        let force = format!(
            "WITH g AS (SELECT l.pid FROM pg_locks l WHERE {GRANTED} \
               AND l.classid::int8 = $1 AND l.objid::int8 = $2), \
             c AS (SELECT h.token FROM {h} h WHERE h.namespace = $3 AND h.name = $4 \
               AND h.key1 = $6 AND h.key2 = $7 AND h.pid IN (SELECT pid FROM g)), \
             u AS (UPDATE {h} h SET forced = true WHERE h.namespace = $3 AND h.name = $4 \
               AND h.key1 = $6 AND h.key2 = $7 AND h.token = $5 \
               AND h.pid IN (SELECT pid FROM g) RETURNING h.pid) \
             SELECT (SELECT count(*) FROM g), (SELECT c.token FROM c LIMIT 1), \
               (SELECT count(*) FROM u)"
        );
        // $1 classid; $2 objid; $3 namespace; $4 name; $5 token; $6, $7 key;
        // $8 whether the session may hold other advisory locks.
        let terminate = format!(
            "WITH g AS (SELECT l.pid FROM pg_locks l WHERE {GRANTED} \
               AND l.classid::int8 = $1 AND l.objid::int8 = $2), \
             c AS (SELECT h.pid, h.token FROM {h} h WHERE h.namespace = $3 AND h.name = $4 \
               AND h.key1 = $6 AND h.key2 = $7 AND h.pid IN (SELECT pid FROM g) LIMIT 1), \
             o AS (SELECT count(*) AS n FROM pg_locks l, c WHERE l.locktype = 'advisory' \
               AND l.granted AND l.pid = c.pid \
               AND NOT (l.classid::int8 = $1 AND l.objid::int8 = $2 AND l.objsubid = 2)) \
             SELECT (SELECT count(*) FROM g), c.token, o.n, \
               CASE WHEN c.token = $5 AND (o.n = 0 OR $8) THEN pg_terminate_backend(c.pid) END \
             FROM (SELECT 1) one LEFT JOIN c ON true LEFT JOIN o ON true"
        );
        Self {
            state: AtomicU8::new(if cfg.holder_records { UNKNOWN } else { OFF }),
            namespace: cfg.namespace.clone(),
            failed_at: Mutex::new(None),
            missing,
            ddl,
            try_lock: single(false),
            try_lock_fenced: single(true),
            try_lock_many: many(false),
            try_lock_many_fenced: many(true),
            alive,
            unlock,
            unlock_notify,
            unlock_many,
            record,
            prune,
            describe,
            list,
            force,
            terminate,
        }
    }

    /// Whether the table is known to exist: the hot statements then write
    /// and read it.
    pub(crate) fn ready(&self) -> bool {
        self.state.load(Ordering::Relaxed) == READY
    }

    /// Whether an acquire should try to write its holder row in a statement
    /// of its own (creating the table if missing).
    fn worth_trying(&self, again: bool) -> bool {
        match self.state.load(Ordering::Relaxed) {
            READY => again,
            OFF => false,
            UNAVAILABLE => {
                let mut at = self
                    .failed_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match *at {
                    Some(t) if t.elapsed() < RETRY_AFTER => false,
                    _ => {
                        *at = Some(Instant::now());
                        true
                    }
                }
            }
            _ => true,
        }
    }

    /// `e` says one of the holder tables does not exist: it was dropped
    /// since it was seen. The hot statements stop using it; the next
    /// acquire creates it again.
    pub(crate) fn missing(&self, e: &BackendError) -> bool {
        let gone =
            e.message().contains("42P01") && self.missing.iter().any(|m| e.message().contains(m));
        if gone {
            // Only a table once seen ready starts over; off stays off.
            let _ =
                self.state
                    .compare_exchange(READY, UNKNOWN, Ordering::Relaxed, Ordering::Relaxed);
        }
        gone
    }
}

/// What a lock attempt stores about its holder, when the table is ready.
#[derive(Debug, Clone)]
pub(crate) struct HolderInfo {
    pub(crate) name: String,
    pub(crate) identity: Option<String>,
}

/// What a statement on a lock's holder row ([`PostgresBackend::on_holder`])
/// found.
enum OnHolder {
    /// The statement's rows.
    Rows(Vec<Row>),
    /// No holder row was ever written: the outcome for a holder that, if
    /// any, is unknown.
    Unrecorded(ForceOutcome),
}

/// Reads column `i` of `row`.
fn col<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
) -> Result<Option<T>, BackendError> {
    row.try_get::<_, Option<T>>(i)
        .map_err(|e| protocol(e.to_string()))
}

/// A holder from a row of `identity, token, acquired_at, renewed_at` at
/// columns 1 to 4.
fn holder_of(name: LockName, row: &Row) -> Result<Holder, BackendError> {
    let identity: Option<String> = col(row, 1)?;
    let token: Option<i64> = col(row, 2)?;
    let acquired: Option<SystemTime> = col(row, 3)?;
    let renewed: Option<SystemTime> = col(row, 4)?;
    Ok(Holder::unknown(name)
        // A row written by hand with a bad identity names no one.
        .with_identity(identity.and_then(|i| Identity::new(i).ok()))
        .with_fencing_token(token.and_then(|t| u64::try_from(t).ok()))
        .with_times(acquired, renewed.or(acquired)))
}

/// The first name after every name that starts with `prefix` (all name
/// characters are ASCII below `~`), or `None` for the empty prefix.
fn prefix_end(prefix: &str) -> Option<String> {
    let mut bytes = prefix.as_bytes().to_vec();
    let last = bytes.pop()?;
    bytes.push(last.saturating_add(1));
    String::from_utf8(bytes).ok()
}

impl PostgresBackend {
    pub(crate) fn holder_sql(&self) -> &HolderSql {
        &self.inner.holders
    }

    /// The DDL of the holder tables, run once by the first acquire that
    /// finds them missing.
    pub fn holder_table_ddl(&self) -> String {
        self.inner.holders.ddl.clone()
    }

    /// Writes the holder row of a lock just taken on `session`, in a
    /// statement of its own, creating the tables if they are missing. Used
    /// until the tables are known to exist (from then on the lock statement
    /// writes it), and `again` when the lock statement wrote it without the
    /// token, drawn after. Never fails the acquire: a lease without a row
    /// shows as held by an unknown holder.
    pub(crate) async fn record_holder(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
        info: &HolderInfo,
        token: Option<u64>,
        again: bool,
    ) {
        let sql = self.holder_sql();
        if !sql.worth_trying(again) {
            return;
        }
        let first = self.write_holder(session, key, info, token).await;
        let outcome = match first {
            Err(e) if sql.missing(&e) => match self.create_holder_tables(session).await {
                Ok(()) => self.write_holder(session, key, info, token).await,
                Err(e) => Err(e),
            },
            other => other,
        };
        match outcome {
            Ok(()) => {
                // Not off: `worth_trying` let this write through.
                if sql.state.swap(READY, Ordering::Relaxed) != READY {
                    // Rows of sessions that ended without releasing.
                    if let Err(e) = session.batch("pruning stale holder rows", &sql.prune).await {
                        debug!(error = %e, "could not prune stale holder rows");
                    }
                }
            }
            Err(e) if matches!(e.kind(), BackendErrorKind::Auth | BackendErrorKind::Config) => {
                sql.state.store(UNAVAILABLE, Ordering::Relaxed);
                *sql.failed_at.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Instant::now());
                warn!(error = %e, ddl = %sql.ddl, "cannot write the holder table: locks are taken without holder data (inspection shows an unknown holder, forced release cannot name their token); create it once as a role with CREATE on the schema and grant SELECT, INSERT, UPDATE, DELETE on both tables");
            }
            Err(e) => {
                debug!(error = %e, "could not write a holder row; the lock is held without one")
            }
        }
    }

    async fn write_holder(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
        info: &HolderInfo,
        token: Option<u64>,
    ) -> Result<(), BackendError> {
        let ns = self.inner.config.namespace.as_str();
        let token = token.and_then(|t| i64::try_from(t).ok());
        let pid = session.pid();
        session
            .query(
                "recording the lock's holder",
                &self.holder_sql().record,
                &[
                    (&ns, Type::TEXT),
                    (&info.name.as_str(), Type::TEXT),
                    (&key.key1, Type::INT4),
                    (&key.key2, Type::INT4),
                    (&token, Type::INT8),
                    (&info.identity.as_deref(), Type::TEXT),
                    (&pid, Type::INT4),
                ],
            )
            .await
            .map(drop)
    }

    async fn create_holder_tables(&self, session: &LockSession) -> Result<(), BackendError> {
        match session
            .batch("creating the holder tables", &self.holder_sql().ddl)
            .await
        {
            // A concurrent creator won the race; the tables are there.
            Err(e) if !e.message().contains("23505") && !e.message().contains("42P07") => Err(e),
            _ => Ok(()),
        }
    }

    /// [`LockBackend::describe`](lock_core::LockBackend::describe).
    pub(crate) async fn describe_lock(
        &self,
        name: &LockName,
    ) -> Result<Option<Holder>, BackendError> {
        let cfg = &self.inner.config;
        let key = cfg.key_for(name);
        let session = self.session().await?;
        let ns = cfg.namespace.as_str();
        let rows = session
            .query(
                "describing a lock",
                &self.holder_sql().describe,
                &[
                    (&key.classid(), Type::INT8),
                    (&key.objid(), Type::INT8),
                    (&ns, Type::TEXT),
                    (&name.as_str(), Type::TEXT),
                    (&key.key1, Type::INT4),
                    (&key.key2, Type::INT4),
                ],
            )
            .await;
        match rows {
            Ok(rows) => rows
                .first()
                .map(|row| holder_of(name.clone(), row))
                .transpose(),
            // Nothing was ever recorded here: pg_locks alone answers.
            Err(e) if self.holder_sql().missing(&e) => Ok(self
                .granted_pid(&session, key)
                .await?
                .map(|_| Holder::unknown(name.clone()))),
            Err(e) => Err(e),
        }
    }

    /// The pid of the session that holds `key`, from `pg_locks` alone.
    async fn granted_pid(
        &self,
        session: &LockSession,
        key: AdvisoryKey,
    ) -> Result<Option<i32>, BackendError> {
        let sql = format!(
            "SELECT l.pid FROM pg_locks l WHERE {GRANTED} \
             AND l.classid::int8 = $1 AND l.objid::int8 = $2 LIMIT 1"
        );
        let rows = session
            .query(
                "reading pg_locks",
                &sql,
                &[(&key.classid(), Type::INT8), (&key.objid(), Type::INT8)],
            )
            .await?;
        rows.first()
            .map(|r| col::<i32>(r, 0))
            .transpose()
            .map(Option::flatten)
    }

    /// [`LockBackend::list`](lock_core::LockBackend::list).
    pub(crate) async fn list_locks(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        let bad = |e: lock_core::Error| BackendError::new(BackendErrorKind::Config, e.to_string());
        validate_prefix(prefix).map_err(bad)?;
        if let Some(c) = cursor {
            // A cursor is the last name of the previous page.
            LockName::new(c).map_err(|e| {
                BackendError::new(
                    BackendErrorKind::Config,
                    format!("not a cursor this backend returned: {e}"),
                )
            })?;
        }
        let limit = limit.clamp(1, lock_core::inspect::MAX_LIST_PAGE);
        let limit_i64 = i64::try_from(limit).unwrap_or(i64::MAX);
        let session = self.session().await?;
        let ns = self.inner.config.namespace.as_str();
        let end = prefix_end(prefix);
        let rows = session
            .query(
                "listing held locks",
                &self.holder_sql().list,
                &[
                    (&ns, Type::TEXT),
                    (&prefix, Type::TEXT),
                    (&cursor, Type::TEXT),
                    (&end.as_deref(), Type::TEXT),
                    (&limit_i64, Type::INT8),
                ],
            )
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            // No lock was ever recorded: none can be named.
            Err(e) if self.holder_sql().missing(&e) => return Ok(HolderPage::default()),
            Err(e) => return Err(e),
        };
        let mut holders = Vec::with_capacity(rows.len());
        for row in &rows {
            let text: Option<String> = col(row, 0)?;
            let text = text.ok_or_else(|| protocol("a holder row without a name"))?;
            // A row written by hand with a name no lock can have is skipped.
            let Ok(name) = LockName::new(&text) else {
                continue;
            };
            holders.push(holder_of(name, row)?);
        }
        let next = if rows.len() == limit {
            rows.last()
                .map(|r| col::<String>(r, 0))
                .transpose()?
                .flatten()
        } else {
            None
        };
        Ok(HolderPage::new(holders, next))
    }

    /// Runs `sql` (as `what`), a statement on the holder row of `name`
    /// whose parameters are the lock's key (`classid`, `objid`), namespace,
    /// name, `token`, the key's halves and then `extra`: its rows, or when
    /// no holder row was ever written (the holder table is missing), the
    /// outcome for a holder that, if any, is unknown, from `pg_locks` alone.
    async fn on_holder(
        &self,
        what: &str,
        sql: &str,
        name: &LockName,
        token: i64,
        extra: &Params<'_>,
    ) -> Result<OnHolder, BackendError> {
        let cfg = &self.inner.config;
        let key = cfg.key_for(name);
        let session = self.session().await?;
        let (classid, objid) = (key.classid(), key.objid());
        let (ns, name) = (cfg.namespace.as_str(), name.as_str());
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
            (&classid, Type::INT8),
            (&objid, Type::INT8),
            (&ns, Type::TEXT),
            (&name, Type::TEXT),
            (&token, Type::INT8),
            (&key.key1, Type::INT4),
            (&key.key2, Type::INT4),
        ];
        params.extend_from_slice(extra);
        match session.query(what, sql, &params).await {
            Ok(rows) => Ok(OnHolder::Rows(rows)),
            Err(e) if self.holder_sql().missing(&e) => Ok(OnHolder::Unrecorded(
                match self.granted_pid(&session, key).await? {
                    Some(_) => ForceOutcome::TokenMismatch { held: None },
                    None => ForceOutcome::NotHeld,
                },
            )),
            Err(e) => Err(e),
        }
    }

    /// [`LockBackend::force_release`](lock_core::LockBackend::force_release):
    /// marks the holder row, which the holder's next renewal reads.
    pub(crate) async fn force_release_lock(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        let token = i64::try_from(expected_token).map_err(|_| {
            BackendError::new(
                BackendErrorKind::Config,
                format!(
                    "fencing token {expected_token} is out of range: Postgres tokens are at most {}",
                    i64::MAX
                ),
            )
        })?;
        let rows = match self
            .on_holder(
                "marking a lock for a forced release",
                &self.holder_sql().force,
                name,
                token,
                &[],
            )
            .await?
        {
            OnHolder::Rows(rows) => rows,
            OnHolder::Unrecorded(outcome) => return Ok(outcome),
        };
        let row = rows
            .first()
            .ok_or_else(|| protocol("the forced release returned no row"))?;
        let granted: i64 = col(row, 0)?.unwrap_or(0);
        let held: Option<i64> = col(row, 1)?;
        let marked: i64 = col(row, 2)?.unwrap_or(0);
        Ok(if granted == 0 {
            ForceOutcome::NotHeld
        } else if marked > 0 {
            ForceOutcome::Released
        } else {
            ForceOutcome::TokenMismatch {
                held: held.and_then(|t| u64::try_from(t).ok()),
            }
        })
    }
}

impl PostgresBackend {
    /// Ends the server session holding `name` (`pg_terminate_backend`) if
    /// the lease holding it carries `expected_token`: for a holder that
    /// cannot renew (a stopped process), whose lock a
    /// [`force_release`](lock_core::LockBackend::force_release) mark alone
    /// does not free. Ending a session frees every advisory lock on it, so
    /// it is refused while that session holds any other advisory lock,
    /// unless `end_other_leases` says to end them all too. The holder sees
    /// its session end, as `expired`, when it runs again.
    ///
    /// Needs `SELECT` on the holder table and the right to signal the
    /// holder's server process (superuser, membership in its role, or
    /// `pg_signal_backend`).
    ///
    /// # Errors
    ///
    /// `Config` for a token out of range or when the session holds other
    /// advisory locks (naming how many) and `end_other_leases` is false;
    /// `Auth` without the rights above; the backend's errors otherwise.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in effect: dropped midway, the session may have been
    /// ended; describe the lock to find out.
    pub async fn terminate_holder(
        &self,
        name: &LockName,
        expected_token: u64,
        end_other_leases: bool,
    ) -> Result<ForceOutcome, BackendError> {
        let token = i64::try_from(expected_token).map_err(|_| {
            BackendError::new(
                BackendErrorKind::Config,
                format!("fencing token {expected_token} is out of range"),
            )
        })?;
        let rows = match self
            .on_holder(
                "ending the holder's session",
                &self.holder_sql().terminate,
                name,
                token,
                &[(&end_other_leases, Type::BOOL)],
            )
            .await?
        {
            OnHolder::Rows(rows) => rows,
            OnHolder::Unrecorded(outcome) => return Ok(outcome),
        };
        let row = rows
            .first()
            .ok_or_else(|| protocol("ending the holder's session returned no row"))?;
        let granted: i64 = col(row, 0)?.unwrap_or(0);
        let held: Option<i64> = col(row, 1)?;
        let others: i64 = col(row, 2)?.unwrap_or(0);
        let ended: Option<bool> = col(row, 3)?;
        if granted == 0 {
            return Ok(ForceOutcome::NotHeld);
        }
        if held != Some(token) {
            return Ok(ForceOutcome::TokenMismatch {
                held: held.and_then(|t| u64::try_from(t).ok()),
            });
        }
        match ended {
            Some(true) => Ok(ForceOutcome::Released),
            Some(false) => Err(BackendError::new(
                BackendErrorKind::Other,
                "pg_terminate_backend did not signal the holder's session (it ended meanwhile?); describe the lock",
            )),
            None => Err(BackendError::new(
                BackendErrorKind::Config,
                format!(
                    "the holder's session holds {others} other advisory lock(s); ending it would \
                     end them all. Pass end_other_leases to end them too"
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_bound_every_name_with_the_prefix() {
        assert_eq!(prefix_end(""), None);
        assert_eq!(prefix_end("jobs/").as_deref(), Some("jobs0"));
        assert_eq!(prefix_end("a").as_deref(), Some("b"));
        assert_eq!(prefix_end("a-z").as_deref(), Some("a-{"));
    }

    #[test]
    fn only_the_holder_tables_count_as_missing() {
        let cfg = PostgresConfig::builder().config().expect("defaults");
        let sql = HolderSql::new(&cfg);
        let mine = BackendError::new(
            BackendErrorKind::Config,
            "x: relation \"public.lock_holders\" does not exist (42P01)",
        );
        let seq = BackendError::new(
            BackendErrorKind::Config,
            "x: relation \"public.lock_fencing\" does not exist (42P01)",
        );
        let companion = BackendError::new(
            BackendErrorKind::Config,
            "x: relation \"public.lock_holders_sessions\" does not exist (42P01)",
        );
        assert!(sql.missing(&mine));
        assert!(sql.missing(&companion));
        assert!(!sql.missing(&seq));
    }
}
