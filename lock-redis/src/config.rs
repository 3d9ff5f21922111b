//! [`RedisBuilder`]: where the server is, how to log in, how long to wait.

use std::fmt;
use std::time::Duration;

use lock_core::redact::redact_url;
use lock_core::BackendError;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::ack::{self, ReplicaAck};
use crate::cluster::{self, ClusterSpec};
use crate::connection::Source;
use crate::error::config;
use crate::sentinel::{self, Resolver, SentinelSpec};
use crate::RedisBackend;

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

    /// Reads the server, database and credentials from a URL:
    /// `redis://[user[:password]@]host[:port][/db]`, or `rediss://` for TLS,
    /// or `redis+sentinel://[user[:password]@]host1[:port1][,host2[:port2]...]/<master-name>[/db]`
    /// for the primary that these sentinels (port 26379 unless given) know
    /// as `<master-name>`. The credentials log in to the primary; the
    /// sentinels are asked without them. Any of them may end in
    /// `?replica_ack=N&replica_ack_timeout=200ms` (timeout in `ms` or `s`,
    /// 500ms unless given): see [`RedisBuilder::with_replica_ack`]. Or
    /// `redis+cluster://[user[:password]@]host1[:port1][,host2[:port2]...]`
    /// for a Redis Cluster reached through these seed nodes (port 6379
    /// unless given; the client learns the other nodes from them), which
    /// takes no replica acknowledgement.
    ///
    /// # Errors
    ///
    /// A [`BackendErrorKind::Config`](lock_core::BackendErrorKind::Config)
    /// error naming the problem when the URL does not parse, uses another
    /// scheme, carries a fragment (such as `#insecure`: certificate
    /// verification cannot be turned off), or has a user name or password
    /// with an unencoded `/`, `?`, `#` or `@` before an `@` (percent-encode
    /// them), or asks for replica acknowledgement out of range. The message
    /// shows the URL with its credentials masked.
    pub fn from_url(url: &str) -> Result<Self, BackendError> {
        let shown = redact_url(url);
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            config(format!(
                "malformed Redis URL {shown}: expected redis://host:port or rediss://host:port"
            ))
        })?;
        let (tls, via_sentinel) = match scheme {
            "redis" => (false, false),
            "rediss" => (true, false),
            "redis+sentinel" => (false, true),
            "redis+cluster" => (false, false),
            other => {
                return Err(config(format!(
                    "unsupported URL scheme{} in {shown}: use redis://, rediss:// (TLS), redis+sentinel:// or redis+cluster://",
                    quoted_scheme(other)
                )))
            }
        };
        // A URL's authority ends at the first `/`, `?` or `#`: an `@` after
        // one means a password holding that character unencoded, which the
        // URL parser would split into host, path or query.
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if rest[authority_end..].contains('@') {
            return Err(config(format!(
                "malformed Redis URL {shown}: the user name or password holds a '/', '?', '#' or '@'; percent-encode them as %2F, %3F, %23 and %40"
            )));
        }
        if url.contains('#') {
            return Err(config(format!(
                "URL fragments are not supported in {shown}: certificate verification is always on; pass a CA with with_ca_certificate_pem"
            )));
        }
        let (url, replica_ack) = ack::take_url_params(url, &shown)?;
        let replica_ack = replica_ack.map(|a| (a.replicas(), a.timeout()));
        let rest = url.split_once("://").map_or("", |(_, r)| r);
        if scheme == "redis+cluster" {
            if replica_ack.is_some() {
                return Err(cluster_refuses_ack(&shown));
            }
            let parsed = crate::nodes::parse_cluster(rest, &shown)?;
            return Ok(Self {
                username: parsed.username,
                password: parsed.password,
                cluster: Some(ClusterSpec {
                    nodes: parsed.nodes,
                }),
                ..Self::new()
            });
        }
        if via_sentinel {
            let parsed = sentinel::parse(rest, &shown)?;
            return Ok(Self {
                replica_ack,
                db: parsed.db,
                username: parsed.username,
                password: parsed.password,
                sentinel: Some(parsed.spec),
                ..Self::new()
            });
        }
        let info: ConnectionInfo = url
            .as_str()
            .into_connection_info()
            .map_err(|e| {
                // The client's reason may quote a query value; after a secret
                // parameter, that value may be a piece of the secret.
                let query = rest.split_once('?').map_or("", |(_, q)| q);
                if redact_url(query) == query {
                    config(format!("malformed Redis URL {shown}: {e}"))
                } else {
                    config(format!(
                        "malformed Redis URL {shown}: check the host, port, database and query parameters"
                    ))
                }
            })?;
        let (host, port) = match info.addr() {
            ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
            _ => {
                return Err(config(format!(
                    "unsupported Redis address in {shown}: only TCP is supported"
                )))
            }
        };
        let settings = info.redis_settings();
        Ok(Self {
            host,
            port,
            tls,
            db: settings.db(),
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            replica_ack,
            ..Self::new()
        })
    }

    /// Reads the URL from the `REDIS_URL` environment variable.
    ///
    /// # Errors
    ///
    /// A `Config` error when the variable is unset or its URL is invalid.
    pub fn from_env() -> Result<Self, BackendError> {
        match std::env::var(ENV_VAR) {
            Ok(url) => Self::from_url(&url),
            Err(_) => Err(config(format!(
                "{ENV_VAR} is not set (expected a redis://, rediss://, redis+sentinel:// or redis+cluster:// URL)"
            ))),
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

/// ` "scheme"` when `scheme` is one (RFC 3986); nothing otherwise, as text
/// before a `://` inside a password is no scheme and may be secret.
fn quoted_scheme(scheme: &str) -> String {
    let mut chars = scheme.chars();
    let is_scheme = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if is_scheme {
        format!(" {scheme:?}")
    } else {
        String::new()
    }
}

/// Replica acknowledgement asked of a Redis Cluster: a `WAIT` reaches only
/// the replicas of the primary it is sent to, and each slot has its own.
fn cluster_refuses_ack(shown: &str) -> BackendError {
    config(format!(
        "replica acknowledgement is not supported with redis+cluster:// ({shown}): each slot's primary has its own replicas; drop replica_ack, or use redis+sentinel:// for acknowledged locks"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lock_core::BackendErrorKind;

    #[test]
    fn urls_parse_into_parts() -> Result<(), BackendError> {
        let c = RedisBuilder::from_url("rediss://u:p%40ss@example.com:6380/2")?;
        assert_eq!(c.target(), "rediss://example.com:6380/2");
        assert_eq!(c.username.as_deref(), Some("u"));
        assert_eq!(c.password.as_deref(), Some("p@ss"));
        let d = RedisBuilder::from_url("redis://127.0.0.1")?;
        assert_eq!(d.target(), "redis://127.0.0.1:6379/0");
        let s = RedisBuilder::from_url("redis+sentinel://u:s3cret@h1:1,h2:2/mymaster/3")?;
        assert_eq!(s.target(), "redis+sentinel://h1:1,h2:2/mymaster/3");
        assert_eq!(s.password.as_deref(), Some("s3cret"));
        assert!(!format!("{s:?}").contains("s3cret"));
        let c = RedisBuilder::from_url("redis+cluster://u:s3cret@h1:7000,h2:7001")?;
        assert_eq!(c.target(), "redis+cluster://h1:7000,h2:7001");
        assert!(c.is_cluster());
        assert_eq!(c.password.as_deref(), Some("s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"));
        let built = c.build()?;
        assert!(!format!("{built:?}").contains("s3cret"));
        Ok(())
    }

    #[test]
    fn bad_input_is_a_config_error_naming_the_problem() {
        let cases = [
            ("127.0.0.1:6379", "malformed"),
            ("http://127.0.0.1:6379", "unsupported URL scheme"),
            ("redis://:pw@[::1/", "malformed"),
            ("redis://127.0.0.1:6379/notadb", "malformed"),
            ("rediss://127.0.0.1:6379/#insecure", "fragments"),
            ("redis+sentinel://:pw@h1:1,h2:2", "master-name"),
            ("redis+sentinel://:pw@h1:x/m", "sentinel must be"),
            ("redis+cluster://:pw@h1:x,h2:1", "each node must be"),
            ("redis+cluster://:pw@h1:1/3", "only database 0"),
        ];
        for (url, needle) in cases {
            let err = RedisBuilder::from_url(url).expect_err(url);
            assert_eq!(err.kind(), BackendErrorKind::Config, "{url}");
            assert!(err.to_string().contains(needle), "{url}: {err}");
            assert!(!err.to_string().contains(":pw@"), "{err}");
        }
        let plain_with_ca = RedisBuilder::new()
            .with_ca_certificate_pem(b"x".to_vec())
            .build();
        assert!(matches!(plain_with_ca, Err(e) if e.to_string().contains("rediss://")));
        let bad_prefix = RedisBuilder::new().with_key_prefix("a*").build();
        assert!(matches!(bad_prefix, Err(e) if e.kind() == BackendErrorKind::Config));
        let zero = RedisBuilder::new()
            .with_operation_timeout(Duration::ZERO)
            .build();
        assert!(matches!(zero, Err(e) if e.kind() == BackendErrorKind::Config));
    }

    #[test]
    fn errors_never_show_the_password() {
        for url in [
            "redis://u:ab/s3cret@h:x",
            "redis://u:ab?s3cret@h:6379",
            "rediss://u:ab#s3cret@h:6379",
            "redis://u:s3cret@h:x",
            "http://u:s3cret@h:6379",
            "redis://h:x/0?password=s3cret",
            "redis://h:6379/0?password=x&protocol=s3cret",
            "host=h password=s3cret",
            "host=h password=s3cret://x",
            "redis+sentinel://u:s3cret@h1:1",
            "redis+sentinel://u:s3cret@h1:x/m",
            "redis+sentinel://u:ab/s3cret@h1:1/m",
            "redis+cluster://u:s3cret@h1:x",
            "redis+cluster://u:s3cret@h1:1/2",
            "redis+cluster://u:ab/s3cret@h1:1",
        ] {
            let err = RedisBuilder::from_url(url).expect_err(url);
            assert_eq!(err.kind(), BackendErrorKind::Config, "{url}");
            let shown = format!("{err} {err:?}");
            assert!(!shown.contains("s3cret"), "{url}: {shown}");
        }
        let err = RedisBuilder::from_url("redis://u:ab/s3cret@h:6379").expect_err("ambiguous");
        assert!(err.message().contains("percent-encode"), "{err}");
    }

    #[test]
    fn secrets_stay_out_of_debug() -> Result<(), BackendError> {
        let c = RedisBuilder::from_url("redis://user:hunter2@h:1")?.with_password("hunter3");
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter"), "{shown}");
        assert!(shown.contains("<redacted>"));
        Ok(())
    }
}
