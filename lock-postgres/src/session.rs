//! The dedicated lock session: one connection, kept open, that holds locks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lock_core::{BackendError, LossReason};
use native_tls::{Certificate, TlsConnector};
use postgres_native_tls::MakeTlsConnector;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, Client, Connection, NoTls, Row, Statement};
use tracing::{debug, warn};

use crate::attempts::Lanes;
use crate::config::{PostgresConfig, RootCert, SslMode};
use crate::error::{config, convert, pooler, protocol, read_only_session, timed_out};
use crate::holders::HolderSql;
use crate::lifeline::{Lifeline, OnEnd, SessionId};
use crate::notify::Waiters;

/// One server session: a connection whose server process (`pid`) holds this
/// backend's advisory locks. Never shared with a pool.
pub(crate) struct LockSession {
    client: Client,
    pid: i32,
    statement_timeout: Duration,
    lifeline: Arc<Lifeline>,
    driver: JoinHandle<()>,
    /// The hot statements (lock, unlock), prepared once per session: their
    /// executions then skip parsing and planning on the server.
    prepared: Mutex<HashMap<Box<str>, Statement>>,
    /// Lock attempts waiting for the statement in flight to answer.
    lanes: Lanes,
}

impl std::fmt::Debug for LockSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockSession")
            .field("id", &self.id())
            .field("pid", &self.pid)
            .field("alive", &self.is_alive())
            .finish()
    }
}

/// The parameters of one statement, with their types spelled out so the
/// statement needs no separate prepare round trip (and no named prepared
/// statement that a pooler could lose).
pub(crate) type Params<'a> = [(&'a (dyn ToSql + Sync), Type)];

impl LockSession {
    /// Connects, sets the session up and learns its server pid, all within
    /// the connect timeout. `on_end` is told once when the session ends.
    pub(crate) async fn connect(
        cfg: &PostgresConfig,
        on_end: OnEnd,
        holders: Arc<HolderSql>,
    ) -> Result<Self, BackendError> {
        match timeout(
            cfg.connect_timeout,
            Self::open(cfg, Lifeline::new(on_end), holders),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(timed_out(
                "connecting the Postgres lock session",
                cfg.connect_timeout,
            )),
        }
    }

    async fn open(
        cfg: &PostgresConfig,
        lifeline: Arc<Lifeline>,
        holders: Arc<HolderSql>,
    ) -> Result<Self, BackendError> {
        let watch = Watch::Session(Arc::clone(&lifeline));
        let (client, driver) =
            open_client(cfg, "connecting the Postgres lock session", watch).await?;
        // Server-side dead-client detection, derived from the longest TTL
        // (see the crate docs), and a server-side bound on every statement.
        let setup = format!(
            "SET statement_timeout = {}; SET tcp_keepalives_idle = {}; \
             SET tcp_keepalives_interval = 1; SET tcp_keepalives_count = 3; \
             SET tcp_user_timeout = {}",
            // 0 would switch the server-side bound off.
            cfg.statement_timeout.as_millis().max(1),
            cfg.keepalive_idle_secs(),
            cfg.user_timeout_ms(),
        );
        let mut session = Self {
            client,
            pid: 0,
            // The set-up statements are part of connecting: a freshly started
            // server process answers its first statements more slowly (it
            // loads its caches), and on a loaded server that alone can exceed
            // a short statement timeout. `connect` bounds the whole set-up by
            // the connect timeout; the statement timeout applies from the
            // first call on.
            statement_timeout: cfg.connect_timeout.max(cfg.statement_timeout),
            lifeline,
            driver,
            prepared: Mutex::new(HashMap::new()),
            lanes: Lanes::new(cfg.qualified(&cfg.fence_sequence), holders),
        };
        session.batch("setting up the lock session", &setup).await?;
        // Advisory locks are session state of the server the session is on,
        // never replicated: taken on a standby (or any read-only session)
        // they would exclude nothing on the primary.
        let rows = session
            .query(
                "reading pg_backend_pid() and whether the session is read-only",
                "SELECT pg_backend_pid(), pg_is_in_recovery(), \
                 current_setting('transaction_read_only') = 'on'",
                &[],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| protocol("pg_backend_pid() returned no row"))?;
        session.pid = row
            .try_get::<_, i32>(0)
            .map_err(|e| protocol(format!("reading pg_backend_pid(): {e}")))?;
        let standby = row
            .try_get::<_, bool>(1)
            .map_err(|e| protocol(format!("reading pg_is_in_recovery(): {e}")))?;
        let read_only = row
            .try_get::<_, bool>(2)
            .map_err(|e| protocol(format!("reading transaction_read_only: {e}")))?;
        if standby || read_only {
            return Err(read_only_session(standby));
        }
        session.statement_timeout = cfg.statement_timeout;
        debug!(pid = session.pid, "Postgres lock session connected");
        Ok(session)
    }

    /// The server process id that holds this session's locks.
    pub(crate) fn pid(&self) -> i32 {
        self.pid
    }

    /// The bound on each statement, client and server side.
    pub(crate) fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// The lanes calls queue in ([`lock_core::lane`]).
    pub(crate) fn lanes(&self) -> &Lanes {
        &self.lanes
    }

    /// The session's id within this process.
    pub(crate) fn id(&self) -> SessionId {
        self.lifeline.id()
    }

    /// False once the connection broke, the server ended the session, or it
    /// was terminated here; its locks are gone then. It turns false only
    /// through the lifeline, after every lease on the session was told: the
    /// driver ends the lifeline as soon as the connection closes, and a
    /// statement that fails on the closed connection meanwhile does too.
    pub(crate) fn is_alive(&self) -> bool {
        !self.lifeline.has_ended()
    }

    /// Ends the session on purpose, when its lock state became unknown:
    /// first the backend marks every lease on it lost (`reason`), then the
    /// socket closes and the server frees every lock the session holds. In
    /// that order, no other client can be granted one of those locks while
    /// a lease here still says "held".
    pub(crate) fn terminate(&self, reason: LossReason) {
        self.lifeline.end(reason);
        self.driver.abort();
    }

    /// Runs one statement, bounded by the statement timeout.
    pub(crate) async fn query(
        &self,
        what: &str,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, BackendError> {
        match timeout(self.statement_timeout, self.client.query_typed(sql, params)).await {
            Err(_) => Err(timed_out(what, self.statement_timeout)),
            Ok(Err(e)) => {
                self.note_failure(&e);
                Err(convert(what, e))
            }
            Ok(Ok(rows)) => Ok(rows),
        }
    }

    /// Runs one of the hot statements as a prepared statement of this
    /// session (prepared on first use), bounded by the statement timeout.
    ///
    /// A session whose prepared statement vanished (`26000`) was moved to
    /// another server process under us: a transaction-mode pooler, refused
    /// like a changed `pg_backend_pid()`.
    pub(crate) async fn query_prepared(
        &self,
        what: &str,
        sql: &str,
        params: &Params<'_>,
    ) -> Result<Vec<Row>, BackendError> {
        self.query_prepared_within(what, sql, params, self.statement_timeout)
            .await
    }

    /// As [`LockSession::query_prepared`], waiting at most `limit`.
    pub(crate) async fn query_prepared_within(
        &self,
        what: &str,
        sql: &str,
        params: &Params<'_>,
        limit: Duration,
    ) -> Result<Vec<Row>, BackendError> {
        let cached = self
            .prepared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(sql)
            .cloned();
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        let run = async {
            let statement = match cached {
                Some(s) => s,
                None => {
                    let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
                    let s = self.client.prepare_typed(sql, &types).await?;
                    self.prepared
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(Box::from(sql), s.clone());
                    s
                }
            };
            self.client.query(&statement, &values).await
        };
        match timeout(limit, run).await {
            Err(_) => Err(timed_out(what, limit)),
            Ok(Err(e)) if e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME) => {
                // Refused for good: nothing here can be renewed on it.
                self.lifeline.end(LossReason::BackendError);
                Err(config(format!(
                    "{what}: a statement prepared on this session is gone: a transaction-mode \
                     pooler (such as PgBouncer with pool_mode=transaction) sits in front of the \
                     server; session advisory locks need a direct connection or a session-mode pool"
                ))
                .with_source(e))
            }
            Ok(Err(e)) => {
                self.note_failure(&e);
                Err(convert(what, e))
            }
            Ok(Ok(rows)) => Ok(rows),
        }
    }

    /// Runs statements without parameters, bounded by the statement timeout.
    pub(crate) async fn batch(&self, what: &str, sql: &str) -> Result<(), BackendError> {
        match timeout(self.statement_timeout, self.client.batch_execute(sql)).await {
            Err(_) => Err(timed_out(what, self.statement_timeout)),
            Ok(Err(e)) => {
                self.note_failure(&e);
                Err(convert(what, e))
            }
            Ok(Ok(())) => Ok(()),
        }
    }

    /// Checks that a row was produced by this session's server process.
    ///
    /// # Errors
    ///
    /// A `Config` error naming the pooler when it was not; the session is
    /// then refused for good.
    pub(crate) fn check_pid(&self, row: &Row) -> Result<(), BackendError> {
        let pid: i32 = row
            .try_get(0)
            .map_err(|e| protocol(format!("reading pg_backend_pid(): {e}")))?;
        self.check_backend_pid(pid)
    }

    /// As [`LockSession::check_pid`], for a `pg_backend_pid()` already read.
    pub(crate) fn check_backend_pid(&self, pid: i32) -> Result<(), BackendError> {
        if pid == self.pid {
            return Ok(());
        }
        warn!(
            expected = self.pid,
            actual = pid,
            "pg_backend_pid() changed: a transaction-mode pooler is in the way"
        );
        // Refused for good: nothing here can be renewed on it.
        self.lifeline.end(LossReason::BackendError);
        Err(pooler(self.pid, pid))
    }

    fn note_failure(&self, e: &tokio_postgres::Error) {
        // Class 57 is "operator intervention": pg_terminate_backend (57P01),
        // idle_session_timeout (57P05), shutdown. The session is over even if
        // the socket has not closed yet.
        let ended = e.code().is_some_and(|c| c.code().starts_with("57P"));
        if ended || e.is_closed() {
            // The server freed every lock of the session: the leases on it
            // vanished, as a renewal would find (`expired`).
            self.lifeline.end(LossReason::Expired);
        }
    }
}

impl Drop for LockSession {
    fn drop(&mut self) {
        // Dropping the client ends the connection; aborting the driver makes
        // sure the socket closes now rather than when the task is next polled.
        self.driver.abort();
    }
}

/// Who the task driving a connection tells what it sees.
#[derive(Debug)]
pub(crate) enum Watch {
    /// A lock session: its lifeline learns when the connection ends.
    Session(Arc<Lifeline>),
    /// The release listener: its waiters get the notifications, and are all
    /// woken when the connection ends.
    Listener(Arc<Waiters>),
}

/// Connects a client with the configured TLS, and spawns the task that
/// drives its connection, reporting to `watch`.
pub(crate) async fn open_client(
    cfg: &PostgresConfig,
    what: &str,
    watch: Watch,
) -> Result<(Client, JoinHandle<()>), BackendError> {
    let mut pg = cfg.pg.clone();
    pg.connect_timeout(cfg.connect_timeout);
    if cfg.ssl_mode == SslMode::Disable {
        let (client, conn) = pg.connect(NoTls).await.map_err(|e| convert(what, e))?;
        Ok((client, tokio::spawn(drive(conn, watch))))
    } else {
        pg.ssl_mode(match cfg.ssl_mode {
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        let tls = tls_connector(cfg)?;
        let (client, conn) = pg.connect(tls).await.map_err(|e| convert(what, e))?;
        Ok((client, tokio::spawn(drive(conn, watch))))
    }
}

async fn drive<S, T>(mut conn: Connection<S, T>, watch: Watch)
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        match std::future::poll_fn(|cx| conn.poll_message(cx)).await {
            Some(Ok(AsyncMessage::Notification(n))) => {
                if let Watch::Listener(w) = &watch {
                    w.released(n.payload());
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                debug!(error = %e, "Postgres connection ended");
                break;
            }
            None => break,
        }
    }
    match &watch {
        // The server ended the session (a terminated backend, an idle
        // timeout, a shutdown) or the connection broke: either way its
        // locks are gone now, and every lease on it is told so at once,
        // not at its next renewal. A terminating server sends its error
        // before it frees the locks, so the leases hear of it first.
        Watch::Session(line) => line.end(LossReason::Expired),
        // Releases may be missed from now on: wake everyone to poll.
        Watch::Listener(w) => w.wake_all(),
    }
}

fn tls_connector(cfg: &PostgresConfig) -> Result<MakeTlsConnector, BackendError> {
    let mut builder = TlsConnector::builder();
    match (cfg.ssl_mode, cfg.root_cert.is_some()) {
        // libpq: `require` with a root certificate verifies the chain, as
        // `verify-ca` does; otherwise it only encrypts.
        (SslMode::Prefer, _) | (SslMode::Require, false) => {
            builder
                .danger_accept_invalid_certs(true)
                .danger_accept_invalid_hostnames(true);
        }
        (SslMode::VerifyCa, _) | (SslMode::Require, true) => {
            builder.danger_accept_invalid_hostnames(true);
        }
        (SslMode::VerifyFull | SslMode::Disable, _) => {}
    }
    if let Some(root) = &cfg.root_cert {
        // As libpq's `sslrootcert`: the given roots only. Without a host
        // name check (`verify-ca`, `require`), trusting every system root
        // would accept any publicly issued certificate.
        builder.disable_built_in_roots(true);
        let pem = match root {
            RootCert::Pem(pem) => pem.clone(),
            RootCert::File(path) => std::fs::read(path).map_err(|e| {
                config(format!(
                    "cannot read the root certificate {}: {e}",
                    path.display()
                ))
            })?,
        };
        let cert = Certificate::from_pem(&pem)
            .map_err(|e| config(format!("the root certificate is not valid PEM: {e}")))?;
        builder.add_root_certificate(cert);
    }
    let connector = builder
        .build()
        .map_err(|e| config(format!("cannot set up TLS: {e}")))?;
    Ok(MakeTlsConnector::new(connector))
}
