//! [`RedisBuilder`]: where the server is, how to log in, how long to wait.

use std::fmt;
use std::time::Duration;

use lock_core::BackendError;
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::ack::ReplicaAck;
use crate::cluster::{self, ClusterSpec};
use crate::connection::Source;
use crate::error::config;
use crate::sentinel::{Resolver, SentinelSpec};
use crate::RedisBackend;
use url::cluster_refuses_ack;

mod url;

/// The environment variable [`RedisBuilder::from_env`] reads.
pub const ENV_VAR: &str = "REDIS_URL";

/// The URL schemes [`RedisBuilder::from_url`] accepts: plaintext, TLS, a
/// primary found through Sentinel (plaintext), and a Redis Cluster
/// (plaintext).
pub const URL_SCHEMES: &[&str] = &["redis", "rediss", "redis+sentinel", "redis+cluster"];

const DEFAULT_PREFIX: &str = "lock:";
const MAX_PREFIX_LEN: usize = 100;

/// Builds a [`RedisBackend`]: server URL, credentials, TLS trust, key
/// prefix and timeouts; then [`connect`](Self::connect) (checks the server
/// answers) or [`build`](Self::build) (connects on first use).
///
/// The password never appears in `Debug` output or in error messages.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lock_redis::RedisBuilder;
///
/// let config = RedisBuilder::from_url("redis://locksvc:secret@127.0.0.1:6379/0")?
///     .with_key_prefix("billing:lock:")
///     .with_operation_timeout(Duration::from_millis(500));
/// assert!(!format!("{config:?}").contains("secret"));
/// # Ok::<(), lock_core::BackendError>(())
/// ```
#[derive(Clone)]
pub struct RedisBuilder {
    host: String,
    port: u16,
    tls: bool,
    db: i64,
    username: Option<String>,
    password: Option<String>,
    key_prefix: String,
    connect_timeout: Duration,
    operation_timeout: Duration,
    ca_certificate_pem: Option<Vec<u8>>,
    sentinel: Option<SentinelSpec>,
    cluster: Option<ClusterSpec>,
    /// Replicas and timeout as given; checked by `build`.
    replica_ack: Option<(u8, Duration)>,
    fencing: bool,
}

impl Default for RedisBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("server", &self.target())
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("custom_ca", &self.ca_certificate_pem.is_some())
            .field("replica_ack", &self.replica_ack)
            .field("fencing", &self.fencing)
            .finish()
    }
}

impl RedisBuilder {
    /// `redis://127.0.0.1:6379/0`, key prefix `lock:`, connect timeout 2 s,
    /// operation timeout 1 s.
    pub fn new() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 6379,
            tls: false,
            db: 0,
            username: None,
            password: None,
            key_prefix: DEFAULT_PREFIX.into(),
            connect_timeout: Duration::from_secs(2),
            operation_timeout: Duration::from_secs(1),
            ca_certificate_pem: None,
            sentinel: None,
            cluster: None,
            replica_ack: None,
            fencing: true,
        }
    }

    /// Logs in as this ACL user.
    pub fn with_username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// Logs in with this password (never shown in `Debug`).
    pub fn with_password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Prefixes every key and channel (default `lock:`). An ACL user can be
    /// limited to it (`~<prefix>*` and `&<prefix>*`).
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Bounds how long opening a connection may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Bounds every operation, including any reconnect it waits for. Keep it
    /// well below the renewal interval (`ttl / 3`), so a stalled server costs
    /// a retry, not the lease.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Trusts this CA certificate (PEM) for `rediss://` instead of the
    /// system's roots, as for a self-signed server certificate.
    pub fn with_ca_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_certificate_pem = Some(pem.into());
        self
    }

    /// Makes every acquire and renewal wait (`WAIT`) until `replicas`
    /// replicas acknowledged it, for at most `timeout`; off by default. An
    /// acquire too few acknowledge is released again and fails as
    /// `Unavailable`; such a renewal fails, so the lease's local deadline
    /// does not move. With `replicas` = every replica of the deployment,
    /// fencing tokens survive a failover: see
    /// [`RedisBackend::tokens_survive_failover`] and the crate docs'
    /// "Replica acknowledgement". Every call's time limit grows by
    /// `timeout`, since a call may queue behind another's `WAIT` on the
    /// shared connection.
    ///
    /// [`build`](Self::build) refuses 0 replicas, a zero timeout and one
    /// above 10 s.
    pub fn with_replica_ack(mut self, replicas: u8, timeout: Duration) -> Self {
        self.replica_ack = Some((replicas, timeout));
        self
    }

    /// Turns fencing tokens on (the default) or off.
    ///
    /// Off, an acquire is one `SET key token NX PX ttl GET` instead of a
    /// script that also increments the fencing counter: about half the
    /// server time per acquire, for users who guard nothing with a token.
    /// Leases then carry no [`fencing_token`](lock_core::backend::Lease::fencing_token),
    /// [`Capabilities::fencing`](lock_core::Capabilities::fencing) is false,
    /// and mutual exclusion, renewal, loss detection and release are as with
    /// tokens. Servers older than Redis 7.0 (which refuse `NX` with `GET`)
    /// get a small script instead.
    pub fn with_fencing_tokens(mut self, on: bool) -> Self {
        self.fencing = on;
        self
    }

    /// Whether acquires draw fencing tokens.
    pub fn fencing_tokens(&self) -> bool {
        self.fencing
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The operation timeout.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Whether the URL names a Redis Cluster (`redis+cluster://`).
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// The server as `redis://host:port/db` (or `rediss://`, or
    /// `redis+sentinel://sentinels/<master-name>/db`, or
    /// `redis+cluster://seed-nodes`), without credentials.
    pub fn target(&self) -> String {
        if let Some(spec) = &self.cluster {
            return format!("redis+cluster://{}", crate::nodes::shown(&spec.nodes));
        }
        if let Some(spec) = &self.sentinel {
            return format!("redis+sentinel://{}/{}", spec.shown(), self.db);
        }
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("{scheme}://{host}:{}/{}", self.port, self.db)
    }

    /// Builds the backend without touching the network; it connects on first
    /// use and reconnects after failures.
    ///
    /// # Errors
    ///
    /// A `Config` error for an empty or oversized key prefix, a zero timeout,
    /// a CA certificate with a plaintext URL, an unreadable CA certificate,
    /// or a replica acknowledgement out of range.
    pub fn build(self) -> Result<RedisBackend, BackendError> {
        self.validate()?;
        let replica_ack = self
            .replica_ack
            .map(|(n, t)| ReplicaAck::new(n, t))
            .transpose()?;
        if replica_ack.is_some() && self.cluster.is_some() {
            return Err(cluster_refuses_ack(&self.target()));
        }
        let source = match &self.sentinel {
            Some(spec) => Source::Sentinel(std::sync::Arc::new(Resolver::new(
                spec.clone(),
                self.settings(),
                self.connect_timeout,
                self.target(),
            ))),
            None => match &self.cluster {
                Some(spec) => Source::Cluster(Box::new(cluster::client(
                    spec,
                    self.username.as_deref(),
                    self.password.as_deref(),
                    self.connect_timeout,
                    self.operation_timeout,
                    &self.target(),
                )?)),
                None => Source::Direct(Box::new(self.client()?)),
            },
        };
        Ok(RedisBackend::from_parts(self, source, replica_ack))
    }

    /// Builds the backend and checks that the server answers (and accepts the
    /// credentials) within the connect timeout.
    ///
    /// # Errors
    ///
    /// As [`RedisBuilder::build`]; then `Unavailable`/`Timeout` when the server
    /// cannot be reached, `Auth` for refused credentials, `Config` for a TLS
    /// mismatch.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the half-built backend.
    pub async fn connect(self) -> Result<RedisBackend, BackendError> {
        let backend = self.build()?;
        backend.ping().await?;
        Ok(backend)
    }

    fn validate(&self) -> Result<(), BackendError> {
        if self.key_prefix.is_empty() || self.key_prefix.len() > MAX_PREFIX_LEN {
            return Err(config(format!(
                "the key prefix must be 1 to {MAX_PREFIX_LEN} bytes, got {}",
                self.key_prefix.len()
            )));
        }
        if let Some(c) = self.key_prefix.chars().find(|c| {
            c.is_whitespace() || c.is_control() || matches!(c, '*' | '?' | '[' | ']' | '{' | '}')
        }) {
            return Err(config(format!(
                "the key prefix {:?} contains {c:?}; glob characters, braces, spaces and control characters are not allowed",
                self.key_prefix
            )));
        }
        if self.connect_timeout.is_zero() || self.operation_timeout.is_zero() {
            return Err(config(
                "the connect and operation timeouts must be greater than zero",
            ));
        }
        if let Some(pem) = &self.ca_certificate_pem {
            if !self.tls {
                return Err(config(format!(
                    "a CA certificate was given but {} is plaintext: use a rediss:// URL",
                    self.target()
                )));
            }
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| config(format!("the CA certificate PEM does not parse: {e}")))?;
            if certs.is_empty() {
                return Err(config(
                    "the CA certificate PEM holds no certificate (expected -----BEGIN CERTIFICATE-----)",
                ));
            }
        }
        Ok(())
    }

    fn settings(&self) -> RedisConnectionInfo {
        let mut settings = RedisConnectionInfo::default().set_db(self.db);
        if let Some(user) = &self.username {
            settings = settings.set_username(user);
        }
        if let Some(pw) = &self.password {
            settings = settings.set_password(pw);
        }
        settings
    }

    fn client(&self) -> Result<redis::Client, BackendError> {
        let addr = if self.tls {
            // rustls needs one process-wide crypto provider; when several are
            // compiled in (other dependencies may enable aws-lc-rs) it cannot
            // pick, so choose ring unless the application already installed one.
            let _ = rustls::crypto::ring::default_provider().install_default();
            ConnectionAddr::TcpTls {
                host: self.host.clone(),
                port: self.port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(self.host.clone(), self.port)
        };
        let settings = self.settings();
        let info = addr
            .into_connection_info()
            .map_err(|e| config(format!("invalid address {}: {e}", self.target())))?
            .set_redis_settings(settings);
        let built = match &self.ca_certificate_pem {
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            None => redis::Client::open(info),
        };
        built.map_err(|e| {
            config(format!(
                "cannot configure a client for {}: {e}",
                self.target()
            ))
        })
    }
}
