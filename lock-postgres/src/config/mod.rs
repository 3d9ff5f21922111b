//! Configuration: URL parsing, TLS, timeouts, the TTL bound, key mapping.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lock_core::{BackendError, LockName};

use crate::error::config;
use crate::sessions::{check_count, DEFAULT_LOCK_SESSIONS};
use crate::{AdvisoryKey, PostgresBackend};

mod url;

/// The environment variable [`PostgresBuilder::from_env`] reads.
pub const ENV_VAR: &str = "DATABASE_URL";

/// The URL schemes [`PostgresBuilder::from_url`] accepts.
pub const URL_SCHEMES: &[&str] = &["postgres", "postgresql"];

/// How the lock session uses TLS, with libpq's `sslmode` meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, without verifying the certificate.
    Prefer,
    /// TLS. Without a root certificate the server's certificate is not
    /// verified (encryption only); with one
    /// ([`PostgresBuilder::with_root_certificate_file`], `sslrootcert`) its
    /// chain must lead to that root, as under [`SslMode::VerifyCa`]: libpq's
    /// rule, so that a URL means the same to this crate as to `psql`.
    Require,
    /// TLS with a certificate signed by a trusted root; the host name is not checked.
    VerifyCa,
    /// TLS with a trusted certificate whose name matches the host.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "disable" => Self::Disable,
            "prefer" | "allow" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            _ => return None,
        })
    }
}

/// A validated configuration for [`PostgresBackend`](crate::PostgresBackend).
///
/// Build it with [`PostgresConfig::builder`], [`PostgresBuilder::from_url`]
/// or [`PostgresBuilder::from_env`]. Its `Debug` form never shows the password.
#[derive(Clone)]
pub struct PostgresConfig {
    pub(crate) pg: tokio_postgres::Config,
    pub(crate) ssl_mode: SslMode,
    pub(crate) root_cert: Option<RootCert>,
    pub(crate) namespace: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) max_ttl: Duration,
    pub(crate) fencing: bool,
    pub(crate) release_notify: bool,
    pub(crate) lock_sessions: usize,
    pub(crate) schema: String,
    pub(crate) fence_sequence: String,
    pub(crate) tick_table: String,
    pub(crate) holder_table: String,
    pub(crate) holder_records: bool,
    pub(crate) keys: HashMap<LockName, AdvisoryKey>,
}

#[derive(Clone, Debug)]
pub(crate) enum RootCert {
    File(PathBuf),
    Pem(Vec<u8>),
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("hosts", &self.pg.get_hosts())
            .field("ports", &self.pg.get_ports())
            .field("user", &self.pg.get_user())
            .field("dbname", &self.pg.get_dbname())
            .field("password", &self.pg.get_password().map(|_| "<redacted>"))
            .field("application_name", &self.pg.get_application_name())
            .field("ssl_mode", &self.ssl_mode)
            .field("namespace", &self.namespace)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("max_ttl", &self.max_ttl)
            .field("fencing", &self.fencing)
            .field("release_notify", &self.release_notify)
            .field("lock_sessions", &self.lock_sessions)
            .field("fence_sequence", &self.qualified(&self.fence_sequence))
            .field("holder_table", &self.qualified(&self.holder_table))
            .field("holder_records", &self.holder_records)
            .field("explicit_keys", &self.keys.len())
            .finish()
    }
}

impl PostgresConfig {
    /// Starts a builder for `localhost:5432` with every default.
    pub fn builder() -> PostgresBuilder {
        PostgresBuilder::new()
    }

    /// The advisory key `name` maps to: an explicit key if one was configured
    /// for it, otherwise [`AdvisoryKey::derive`] in this namespace.
    pub fn key_for(&self, name: &LockName) -> AdvisoryKey {
        self.keys
            .get(name)
            .copied()
            .unwrap_or_else(|| AdvisoryKey::derive(&self.namespace, name))
    }

    /// The longest TTL this configuration accepts (see the crate docs).
    pub fn max_ttl(&self) -> Duration {
        self.max_ttl
    }

    /// The bound on every statement.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// Whether acquisitions draw fencing tokens.
    pub fn fencing(&self) -> bool {
        self.fencing
    }

    /// How many lock sessions the backend spreads its locks over.
    pub fn lock_sessions(&self) -> usize {
        self.lock_sessions
    }

    /// The one DDL statement fencing runs on first use.
    pub fn fencing_ddl(&self) -> String {
        format!(
            "CREATE SEQUENCE IF NOT EXISTS {}",
            self.qualified(&self.fence_sequence)
        )
    }

    pub(crate) fn qualified(&self, object: &str) -> String {
        format!("\"{}\".\"{}\"", self.schema, object)
    }

    /// Whole seconds, rounded up, of the server-side keepalive idle time: the
    /// server starts probing a silent client only after the longest TTL.
    pub(crate) fn keepalive_idle_secs(&self) -> u64 {
        let ms = self.max_ttl.as_millis();
        u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX).max(1)
    }

    /// `tcp_user_timeout` for the server side, in milliseconds: one second
    /// beyond the idle time, so that neither unanswered keepalives nor
    /// unacknowledged data can make the server drop the session (and free its
    /// locks) before the client's validity bound has run out.
    pub(crate) fn user_timeout_ms(&self) -> u64 {
        self.keepalive_idle_secs()
            .saturating_add(1)
            .saturating_mul(1000)
    }
}

/// Builds a [`PostgresBackend`]: server URL, credentials, TLS, namespace,
/// timeouts and fencing; then [`connect`](Self::connect) (opens the lock
/// session now) or [`build`](Self::build) (opens it on first use).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lock_postgres::PostgresBuilder;
///
/// let builder = PostgresBuilder::from_url("postgres://locksvc:secret@127.0.0.1:5432/app")?
///     .with_namespace("billing")
///     .with_statement_timeout(Duration::from_millis(500));
/// assert!(!format!("{builder:?}").contains("secret"));
/// let backend = builder.build()?; // no connection yet
/// # drop(backend);
/// # Ok::<(), lock_core::BackendError>(())
/// ```
#[derive(Clone)]
pub struct PostgresBuilder {
    inner: PostgresConfig,
}

impl fmt::Debug for PostgresBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PostgresBuilder").field(&self.inner).finish()
    }
}

impl Default for PostgresBuilder {
    fn default() -> Self {
        Self::new()
    }
}

const IDENT_MAX: usize = 63;

/// The suffix of the holder table's companion (each session's last renewal).
pub(crate) const HOLDER_SUFFIX: &str = "_sessions";

fn valid_ident(what: &str, ident: &str) -> Result<(), BackendError> {
    let ok = !ident.is_empty()
        && ident.len() <= IDENT_MAX
        && ident
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && ident
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(config(format!(
            "{what} {ident:?} is not a plain identifier ([a-z_][a-z0-9_]*, at most {IDENT_MAX} bytes)"
        )))
    }
}

impl PostgresBuilder {
    /// A builder for `localhost:5432`, user `postgres`, with the defaults:
    /// namespace `lock`, connect timeout 5 s, statement timeout 2 s, max TTL
    /// 30 s, 1 lock session, fencing on with sequence `public.lock_fencing`,
    /// no TLS.
    pub fn new() -> Self {
        let mut pg = tokio_postgres::Config::new();
        pg.host("localhost")
            .port(5432)
            .user("postgres")
            .application_name("lock-postgres");
        Self {
            inner: PostgresConfig {
                pg,
                ssl_mode: SslMode::Disable,
                root_cert: None,
                namespace: "lock".to_owned(),
                connect_timeout: Duration::from_secs(5),
                statement_timeout: Duration::from_secs(2),
                max_ttl: Duration::from_secs(30),
                fencing: true,
                release_notify: true,
                lock_sessions: DEFAULT_LOCK_SESSIONS,
                schema: "public".to_owned(),
                fence_sequence: "lock_fencing".to_owned(),
                tick_table: "lock_ticks".to_owned(),
                holder_table: "lock_holders".to_owned(),
                holder_records: true,
                keys: HashMap::new(),
            },
        }
    }

    /// The password (never shown by `Debug`).
    pub fn with_password(mut self, password: impl AsRef<[u8]>) -> Self {
        self.inner.pg.password(password.as_ref());
        self
    }

    /// The namespace hashed in front of every name (default `lock`).
    /// Deployments with different namespaces never block each other.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.inner.namespace = namespace.into();
        self
    }

    /// Maps `name` to a fixed key instead of the hash, for interoperating
    /// with programs that already lock `pg_try_advisory_lock(key1, key2)`.
    pub fn with_explicit_key(mut self, name: LockName, key: AdvisoryKey) -> Self {
        self.inner.keys.insert(name, key);
        self
    }

    /// Bounds connecting (TCP, TLS, authentication and session setup).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.inner.connect_timeout = timeout;
        self
    }

    /// Bounds every statement, client side and as the session's `statement_timeout`.
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.inner.statement_timeout = timeout;
        self
    }

    /// The longest TTL acquisitions may ask for (default 30 s). The server's
    /// dead-client detection is derived from it; see the crate docs.
    pub fn with_max_ttl(mut self, max_ttl: Duration) -> Self {
        self.inner.max_ttl = max_ttl;
        self
    }

    /// Turns fencing tokens on (default) or off: with `false`, acquires draw
    /// no token and never touch the sequence (no `nextval`, no DDL), so an
    /// acquire is the lock statement alone; for roles that cannot use a
    /// sequence, or where nothing checks the tokens.
    pub fn with_fencing_tokens(mut self, on: bool) -> Self {
        self.inner.fencing = on;
        self
    }

    /// How many lock sessions (server connections) the backend spreads its
    /// locks over, each key on the one its hash picks (default 1; URL
    /// parameter `lock_sessions`). One gathers the most concurrent calls
    /// into each statement, which is fastest; several mean that the end of
    /// one session loses only the leases on it, and that a slow statement
    /// holds up only its own session's calls. Checked by
    /// [`PostgresBuilder::config`]: 1 to 64.
    pub fn with_lock_sessions(mut self, sessions: usize) -> Self {
        self.inner.lock_sessions = sessions;
        self
    }

    /// Announces releases with `NOTIFY` and lets waiters `LISTEN` on an extra
    /// connection (default on); off, waiters poll.
    pub fn with_release_notify(mut self, on: bool) -> Self {
        self.inner.release_notify = on;
        self
    }

    /// The schema of the fencing sequence and the tick table (default `public`).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.inner.schema = schema.into();
        self
    }

    /// The fencing sequence's name (default `lock_fencing`).
    pub fn with_fence_sequence(mut self, name: impl Into<String>) -> Self {
        self.inner.fence_sequence = name.into();
        self
    }

    /// The tick table's name (default `lock_ticks`).
    pub fn with_tick_table(mut self, name: impl Into<String>) -> Self {
        self.inner.tick_table = name.into();
        self
    }

    /// The holder table's name (default `lock_holders`; its companion
    /// `<name>_sessions` holds each lock session's last renewal). See the
    /// crate docs, "Inspection and forced release".
    pub fn with_holder_table(mut self, name: impl Into<String>) -> Self {
        self.inner.holder_table = name.into();
        self
    }

    /// Whether acquires write holder rows (default on): off, no acquire,
    /// renewal or release touches the holder tables, saving their writes
    /// (about 0.2 ms of server time per acquire and release, measured on a
    /// loaded two-core machine), and inspections show this backend's locks
    /// as held by an unknown holder, which a forced release cannot name.
    pub fn with_holder_records(mut self, on: bool) -> Self {
        self.inner.holder_records = on;
        self
    }

    /// The `application_name` lock sessions show in `pg_stat_activity`.
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.inner.pg.application_name(name.into());
        self
    }

    /// The TLS mode, as libpq's `sslmode`.
    pub fn with_ssl_mode(mut self, mode: SslMode) -> Self {
        self.inner.ssl_mode = mode;
        self
    }

    /// Trusts the PEM certificate(s) in `pem`, and only them, as roots (as
    /// libpq's `sslrootcert` does). With [`SslMode::Require`] this turns on
    /// verification of the chain (without the host name), as in libpq.
    pub fn with_root_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.inner.root_cert = Some(RootCert::Pem(pem.into()));
        self
    }

    /// Trusts the PEM certificate(s) in the file at `path`, and only them, as
    /// roots (libpq's `sslrootcert`). With [`SslMode::Require`] this turns on
    /// verification of the chain (without the host name), as in libpq.
    pub fn with_root_certificate_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.inner.root_cert = Some(RootCert::File(path.into()));
        self
    }

    /// Checks the settings and builds the backend without touching the
    /// network: the lock session opens on first use and reopens after a loss.
    ///
    /// # Errors
    ///
    /// As [`PostgresBuilder::config`].
    pub fn build(self) -> Result<PostgresBackend, BackendError> {
        Ok(PostgresBackend::new(self.config()?))
    }

    /// Checks the settings, builds the backend and opens its lock session
    /// now, so that a wrong URL, wrong credentials or an unreachable server
    /// show up here.
    ///
    /// # Errors
    ///
    /// As [`PostgresBuilder::config`]; then `Unavailable` or `Timeout` if the
    /// server cannot be reached within the connect timeout, `Auth` for
    /// refused credentials, `Config` for a missing database, a bad TLS setup
    /// or a transaction-mode pooler.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future leaves nothing behind.
    pub async fn connect(self) -> Result<PostgresBackend, BackendError> {
        PostgresBackend::connect(self.config()?).await
    }

    /// Checks and returns the configuration, for
    /// [`PostgresBackend::new`] or to read what it derives
    /// ([`PostgresConfig::key_for`], [`PostgresConfig::fencing_ddl`]).
    ///
    /// # Errors
    ///
    /// A `Config` error for a zero timeout or max TTL, a lock session count
    /// outside 1 to 64, a namespace with a NUL
    /// byte, a schema or object name that is not a plain identifier, or a
    /// root certificate with TLS disabled.
    pub fn config(self) -> Result<PostgresConfig, BackendError> {
        let c = self.inner;
        if c.connect_timeout.is_zero() || c.statement_timeout.is_zero() {
            return Err(config("connect and statement timeouts must be above zero"));
        }
        if c.max_ttl.is_zero() {
            return Err(config("max_ttl must be above zero"));
        }
        check_count(c.lock_sessions)?;
        if c.namespace.contains('\0') || c.namespace.len() > 200 {
            return Err(config(
                "the namespace must not contain NUL and is at most 200 bytes",
            ));
        }
        valid_ident("schema", &c.schema)?;
        valid_ident("fence sequence", &c.fence_sequence)?;
        valid_ident("tick table", &c.tick_table)?;
        valid_ident("holder table", &c.holder_table)?;
        if c.holder_table.len() > IDENT_MAX - HOLDER_SUFFIX.len() {
            return Err(config(format!(
                "the holder table's name is at most {} bytes (its companion table adds {HOLDER_SUFFIX:?})",
                IDENT_MAX - HOLDER_SUFFIX.len()
            )));
        }
        if c.root_cert.is_some() && c.ssl_mode == SslMode::Disable {
            return Err(config(
                "a root certificate was given but sslmode is disable; use verify-full",
            ));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_unsafe_identifiers_and_zero_bounds() {
        let b = PostgresConfig::builder;
        assert!(b().with_schema("public; drop table x").config().is_err());
        assert!(b().with_fence_sequence("Upper").config().is_err());
        assert!(b().with_max_ttl(Duration::ZERO).config().is_err());
        assert!(b().with_statement_timeout(Duration::ZERO).config().is_err());
        assert!(b().with_namespace("a\0b").config().is_err());
    }

    #[test]
    fn keepalive_is_derived_from_max_ttl() -> Result<(), BackendError> {
        let c = PostgresConfig::builder()
            .with_max_ttl(Duration::from_millis(1500))
            .config()?;
        assert_eq!(c.keepalive_idle_secs(), 2);
        assert_eq!(c.user_timeout_ms(), 3000);
        assert!(Duration::from_millis(c.user_timeout_ms()) > c.max_ttl());
        Ok(())
    }

    #[test]
    fn explicit_keys_override_the_hash() -> Result<(), BackendError> {
        let name = LockName::new("cron").map_err(|e| config(e.to_string()))?;
        let c = PostgresConfig::builder()
            .with_explicit_key(name.clone(), AdvisoryKey::new(42, 7))
            .config()?;
        assert_eq!(c.key_for(&name), AdvisoryKey::new(42, 7));
        Ok(())
    }
}
