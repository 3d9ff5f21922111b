//! Configuration: endpoints, credentials, TLS, key prefix and timeouts.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lock_core::redact::redact_url;
use lock_core::{backend::LossFeed, BackendError, BackendErrorKind, Capabilities};

use crate::connection::{Connected, MinTtl};
use crate::deferred::Deferred;
use crate::EtcdBackend;

/// The environment variable [`EtcdBuilder::from_env`] reads: comma-separated
/// endpoints, or an `etcd://` URL.
pub const ENV_VAR: &str = "ETCD_ENDPOINTS";

/// The URL schemes [`EtcdBuilder::from_url`] accepts: plaintext and TLS.
pub const URL_SCHEMES: &[&str] = &["etcd", "etcds"];

/// The key prefix used unless [`EtcdBuilder::with_prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "/locks/";

/// The shortest TTL assumed for a cluster when it could not be asked: etcd's
/// minimum lease TTL is 1.5 × its election timeout (1 s by default), which
/// the server rounds up to whole seconds.
pub const DEFAULT_MIN_TTL: Duration = Duration::from_secs(2);

/// Builds an [`EtcdBackend`]: endpoints, credentials, TLS, key prefix, timeouts.
///
/// Endpoints are `host:port`, `http://host:port` or `https://host:port`; an
/// `etcd://host:port[,host:port…]` URL (or `etcds://` for TLS, with optional
/// `user:password@`) gives several at once. The password never appears in `Debug`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lock_etcd::EtcdBuilder;
///
/// let builder = EtcdBuilder::from_url("etcd://127.0.0.1:2379,127.0.0.1:22379")?
///     .with_credentials("locksvc", "secret")
///     .with_prefix("/locks/billing/")
///     .with_request_timeout(Duration::from_millis(500));
/// assert!(!format!("{builder:?}").contains("secret"));
/// # Ok::<(), lock_core::BackendError>(())
/// ```
#[derive(Clone)]
pub struct EtcdBuilder {
    pub(crate) endpoints: Vec<String>,
    tls_scheme: bool,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) ca_pem: Option<Vec<u8>>,
    ca_file: Option<PathBuf>,
    pub(crate) tls_domain: Option<String>,
    pub(crate) prefix: String,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) min_ttl: Option<Duration>,
}

impl fmt::Debug for EtcdBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBuilder")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.uses_tls())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca_file", &self.ca_file)
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("min_ttl", &self.min_ttl)
            .finish()
    }
}

impl Default for EtcdBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn config_error(message: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Config, message)
}

impl EtcdBuilder {
    /// A builder with no endpoints, prefix `/locks/`, a 2 s connect timeout
    /// and a 1 s request timeout.
    pub fn new() -> Self {
        Self {
            endpoints: Vec::new(),
            tls_scheme: false,
            username: None,
            password: None,
            ca_pem: None,
            ca_file: None,
            tls_domain: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(1),
            min_ttl: None,
        }
    }

    /// Parses `etcd://[user:password@]host:port[,host:port…]` (`etcds://` for TLS).
    ///
    /// # Errors
    ///
    /// A [`BackendErrorKind::Config`] error naming what is malformed.
    pub fn from_url(url: &str) -> Result<Self, BackendError> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("etcd://") {
            (false, rest)
        } else if let Some(rest) = url.strip_prefix("etcds://") {
            (true, rest)
        } else {
            return Err(config_error(format!(
                "etcd URL {} must start with etcd:// or etcds://",
                redact_url(url)
            )));
        };
        let mut builder = Self::new();
        builder.tls_scheme = tls;
        let hosts = match rest.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (user, password) = userinfo.split_once(':').ok_or_else(|| {
                    config_error("etcd URL credentials must be written user:password@")
                })?;
                if user.is_empty() {
                    return Err(config_error("etcd URL has an empty user name"));
                }
                builder = builder.with_credentials(user, password);
                hosts
            }
            None => rest,
        };
        let hosts = hosts.trim_end_matches('/');
        builder.endpoints = parse_list(hosts, url)?;
        Ok(builder)
    }

    /// Reads endpoints from `ETCD_ENDPOINTS` (comma-separated `host:port` or
    /// `http(s)://host:port`, or one `etcd://` URL).
    ///
    /// # Errors
    ///
    /// A [`BackendErrorKind::Config`] error when the variable is unset, empty or malformed.
    pub fn from_env() -> Result<Self, BackendError> {
        let value =
            std::env::var(ENV_VAR).map_err(|_| config_error(format!("{ENV_VAR} is not set")))?;
        if value.starts_with("etcd://") || value.starts_with("etcds://") {
            return Self::from_url(&value);
        }
        Self::new().with_endpoints(value.split(','))
    }

    /// Sets the endpoints (`host:port`, `http://host:port` or `https://host:port`).
    ///
    /// # Errors
    ///
    /// A [`BackendErrorKind::Config`] error naming the first malformed endpoint.
    pub fn with_endpoints<I, S>(mut self, endpoints: I) -> Result<Self, BackendError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let joined: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().to_owned())
            .collect();
        let joined = joined.join(",");
        self.endpoints = parse_list(&joined, &joined)?;
        Ok(self)
    }

    /// Authenticates as `user` (etcd RBAC). The password is never logged or shown in `Debug`.
    pub fn with_credentials(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.username = Some(user.into());
        self.password = Some(password.into());
        self
    }

    /// Trusts this PEM-encoded CA certificate, and turns TLS on.
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Trusts the PEM-encoded CA certificate in this file (read at connect), and turns TLS on.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Verifies the server certificate against this name instead of the endpoint's host.
    pub fn with_tls_domain(mut self, domain: impl Into<String>) -> Self {
        self.tls_domain = Some(domain.into());
        self
    }

    /// Puts every lock key under `prefix` (default `/locks/`). RBAC roles can
    /// then grant read-write on exactly this prefix.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bounds how long connecting (and authenticating) may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Bounds every backend call, start to end: a paused or partitioned
    /// server yields a timeout error after this long, never a hang.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The bound on every backend call (see [`EtcdBuilder::with_request_timeout`]).
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Declares the cluster's minimum lease TTL instead of measuring it at
    /// connect (see [`EtcdBackend::min_ttl`]). Rounded up to whole seconds.
    pub fn with_min_ttl(mut self, min_ttl: Duration) -> Self {
        self.min_ttl = Some(min_ttl);
        self
    }

    /// The capabilities of the backend [`EtcdBuilder::build`] makes from
    /// this builder, known without contacting the cluster (its minimum TTL
    /// is the declared one or 2 s; [`EtcdBuilder::connect`] measures it).
    pub(crate) fn lazy_capabilities(&self) -> Capabilities {
        crate::backend::capabilities_with(self.unmeasured_min_ttl())
    }

    /// The declared minimum TTL, in whole seconds.
    pub(crate) fn declared_min_ttl(&self) -> Option<Duration> {
        self.min_ttl
            .map(|t| crate::connection::secs(crate::lease::lease_seconds(t)))
    }

    /// The minimum TTL assumed without measuring: the declared one or the default.
    pub(crate) fn unmeasured_min_ttl(&self) -> Duration {
        self.declared_min_ttl().unwrap_or(DEFAULT_MIN_TTL)
    }

    /// Whether connections use TLS (an `https://` endpoint, `etcds://`, or a CA).
    pub fn uses_tls(&self) -> bool {
        self.tls_scheme
            || self.ca_pem.is_some()
            || self.ca_file.is_some()
            || self.endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// Checks the configuration and returns the endpoints as URLs with their scheme.
    pub(crate) fn validated(&mut self) -> Result<Vec<String>, BackendError> {
        if self.endpoints.is_empty() {
            return Err(config_error("no etcd endpoints configured"));
        }
        if self.prefix.is_empty() || !self.prefix.ends_with('/') {
            return Err(config_error(format!(
                "the key prefix {:?} must be non-empty and end with '/'",
                self.prefix
            )));
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(config_error(
                "connect and request timeouts must be non-zero",
            ));
        }
        if self.min_ttl.is_some_and(|t| t.is_zero()) {
            return Err(config_error("the minimum TTL must be non-zero"));
        }
        if let Some(path) = &self.ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                config_error(format!("cannot read the CA file {}: {e}", path.display()))
            })?;
            self.ca_pem = Some(pem);
        }
        let tls = self.uses_tls();
        if tls && self.ca_pem.is_none() {
            return Err(config_error(
                "TLS needs a CA certificate: set with_ca_file or with_ca_pem",
            ));
        }
        if tls && self.endpoints.iter().any(|e| e.starts_with("http://")) {
            return Err(config_error(
                "TLS is configured but an endpoint uses http://; use https:// or host:port",
            ));
        }
        let scheme = if tls { "https://" } else { "http://" };
        Ok(self
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("{scheme}{e}")
                }
            })
            .collect())
    }

    /// Connects, checks that the cluster answers, and measures its minimum
    /// lease TTL unless [`EtcdBuilder::with_min_ttl`] declared it.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Config`] for bad settings, [`BackendErrorKind::Auth`]
    /// for refused credentials, [`BackendErrorKind::Unavailable`] or
    /// [`BackendErrorKind::Timeout`] when no endpoint answers in time.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the half-made connection. The
    /// probe lease it may have granted expires on its own within one second
    /// or two.
    pub async fn connect(self) -> Result<EtcdBackend, BackendError> {
        Connected::connect(self, MinTtl::Measure, LossFeed::new())
            .await
            .map(EtcdBackend::ready)
    }

    /// Checks the settings and builds the backend without contacting the
    /// cluster: it connects (and authenticates) when a lock call first finds
    /// the cluster answering, at most one attempt at a time and one every
    /// half second, and every call fails closed as `unavailable` until then.
    /// Its minimum TTL is the declared one or 2 s, and stays so once it
    /// connects: a cluster whose own minimum is higher lengthens shorter
    /// leases on the server (so an abandoned lock frees later), and a
    /// warning says so when the backend connects.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Config`] for bad settings (no endpoints, a bad
    /// prefix, a zero timeout, an unreadable CA file, TLS with `http://`).
    pub fn build(self) -> Result<EtcdBackend, BackendError> {
        let endpoints = self.clone().validated()?;
        let shown = endpoints
            .iter()
            .map(|e| redact_url(e))
            .collect::<Vec<_>>()
            .join(",");
        let capabilities = self.lazy_capabilities();
        Ok(EtcdBackend::deferred(Deferred::new(
            self,
            capabilities,
            shown,
        )))
    }
}

/// Parses a comma-separated endpoint list taken from `input` (the URL or
/// list the caller gave), which errors show with its credentials masked.
/// They name the bad endpoint by position, not by its text: a password
/// holding an unencoded `,` or `@` would otherwise leave a piece of itself
/// in an "endpoint".
fn parse_list(list: &str, input: &str) -> Result<Vec<String>, BackendError> {
    let endpoints: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .enumerate()
        .map(|(i, e)| {
            parse_endpoint(e).map_err(|why| {
                config_error(format!(
                    "malformed etcd endpoint #{} in {}: {why}",
                    i + 1,
                    redact_url(input)
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    if endpoints.is_empty() {
        return Err(config_error(format!(
            "no etcd endpoint in {}",
            redact_url(input)
        )));
    }
    Ok(endpoints)
}

/// Checks one `[scheme://]host:port` endpoint and returns it unchanged, or
/// says what is wrong with it.
fn parse_endpoint(endpoint: &str) -> Result<String, &'static str> {
    let authority = match endpoint.split_once("://") {
        Some(("http" | "https", rest)) => rest,
        Some(_) => return Err("the scheme must be http:// or https://"),
        None => endpoint,
    };
    if authority.contains('@') {
        return Err("an endpoint cannot carry credentials; use with_credentials or an etcd://user:password@host:port URL");
    }
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    let (host, port) = authority.rsplit_once(':').ok_or("expected host:port")?;
    if host.is_empty() {
        return Err("empty host");
    }
    if host.contains(['/', ' ', '?', '#']) {
        return Err("the host contains a character that is not allowed");
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(endpoint.strip_suffix('/').unwrap_or(endpoint).to_owned()),
        _ => Err("the port is not a port number (1 to 65535)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls_and_lists() {
        let b = EtcdBuilder::from_url("etcd://a:1,b:2").expect("valid");
        assert_eq!(b.endpoints, ["a:1", "b:2"]);
        assert!(!b.uses_tls());
        let b = EtcdBuilder::from_url("etcds://u:p@[::1]:2379/").expect("valid");
        assert_eq!(b.endpoints, ["[::1]:2379"]);
        assert_eq!(b.username.as_deref(), Some("u"));
        assert!(b.uses_tls());
        let b = EtcdBuilder::new()
            .with_endpoints(["http://h:1", " h:2 "])
            .expect("valid");
        assert_eq!(b.endpoints, ["http://h:1", "h:2"]);
    }

    #[test]
    fn rejects_malformed_endpoints_by_name() {
        for bad in [
            "redis://h:1",
            "etcd://",
            "etcd://h",
            "etcd://h:port",
            "etcd://h:0",
            "etcd://:2379",
            "etcd://h:99999",
            "etcd://u@h:1",
            "etcd://ftp://h:1",
        ] {
            let err = EtcdBuilder::from_url(bad).expect_err(bad);
            assert_eq!(err.kind(), BackendErrorKind::Config, "{bad}");
        }
        let err = EtcdBuilder::from_url("etcd://h:port").expect_err("bad port");
        assert!(err.message().contains("h:port"), "{err}");
        assert!(err.message().contains("not a port number"), "{err}");
    }

    #[test]
    fn validation_names_the_problem() {
        let mut b = EtcdBuilder::new();
        assert!(b.validated().is_err());
        let mut b = EtcdBuilder::from_url("etcd://h:1")
            .expect("valid")
            .with_prefix("locks");
        assert!(b
            .validated()
            .expect_err("prefix")
            .message()
            .contains("prefix"));
        let mut b = EtcdBuilder::new()
            .with_endpoints(["http://h:1"])
            .expect("valid")
            .with_ca_pem("pem");
        assert!(b.validated().is_err(), "TLS with an http:// endpoint");
        let mut b = EtcdBuilder::from_url("etcds://h:1").expect("valid");
        assert!(
            b.validated()
                .expect_err("no CA")
                .message()
                .contains("CA certificate"),
            "TLS without a CA is refused before any connection"
        );
        let mut b = EtcdBuilder::from_url("etcds://h:1")
            .expect("valid")
            .with_ca_pem("pem");
        assert_eq!(b.validated().expect("valid"), ["https://h:1"]);
        let mut b = EtcdBuilder::from_url("etcd://h:1")
            .expect("valid")
            .with_ca_file("/nonexistent/ca.pem");
        assert!(b.validated().expect_err("ca").message().contains("CA file"));
    }

    #[test]
    fn reads_the_environment() {
        // The only test in this binary that touches ETCD_ENDPOINTS.
        std::env::set_var(ENV_VAR, "http://a:1, b:2");
        let listed = EtcdBuilder::from_env().map(|b| b.endpoints);
        std::env::set_var(ENV_VAR, "etcd://u:p@c:3");
        let url = EtcdBuilder::from_env().map(|b| (b.endpoints, b.username));
        std::env::set_var(ENV_VAR, "c:notaport");
        let bad = EtcdBuilder::from_env();
        std::env::remove_var(ENV_VAR);
        let unset = EtcdBuilder::from_env();
        assert_eq!(listed.expect("valid"), ["http://a:1", "b:2"]);
        assert_eq!(
            url.expect("valid"),
            (vec!["c:3".to_owned()], Some("u".to_owned()))
        );
        assert_eq!(bad.expect_err("bad port").kind(), BackendErrorKind::Config);
        let unset = unset.expect_err("unset");
        assert!(unset.message().contains(ENV_VAR), "{unset}");
    }

    #[test]
    fn errors_never_show_the_password() {
        for url in [
            "http://root:s3cret@h:2379",
            "etcd://root:s3cret@h:port",
            "etcd://root:s3cret@h:2379?token=s3cret",
            "host=h password=s3cret",
        ] {
            let err = EtcdBuilder::from_url(url).expect_err(url);
            assert!(!format!("{err} {err:?}").contains("s3cret"), "{url}: {err}");
        }
        for endpoint in [
            "http://root:s3cret@h:2379",
            "https://root:ab/s3cret@h:2379",
            "root:s3cret@h:2379",
            "http://h:2379?token=s3cret",
        ] {
            let err = EtcdBuilder::new()
                .with_endpoints([endpoint])
                .expect_err(endpoint);
            assert_eq!(err.kind(), BackendErrorKind::Config, "{endpoint}");
            assert!(
                !format!("{err} {err:?}").contains("s3cret"),
                "{endpoint}: {err}"
            );
        }
    }

    #[test]
    fn debug_hides_the_password() {
        let b = EtcdBuilder::from_url("etcd://user:hunter2@h:1").expect("valid");
        let shown = format!("{b:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("user"));
    }
}
