//! [`RedisBuilder::from_url`] and [`RedisBuilder::from_env`]: the URL forms.

use lock_core::redact::redact_url;
use lock_core::BackendError;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use super::{ClusterSpec, RedisBuilder, ENV_VAR};
use crate::ack;
use crate::error::config;
use crate::sentinel;

impl RedisBuilder {
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
            let spec = parsed.spec();
            return Ok(Self {
                replica_ack,
                db: parsed.db,
                username: parsed.username,
                password: parsed.password,
                sentinel: Some(spec),
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
pub(super) fn cluster_refuses_ack(shown: &str) -> BackendError {
    config(format!(
        "replica acknowledgement is not supported with redis+cluster:// ({shown}): each slot's primary has its own replicas; drop replica_ack, or use redis+sentinel:// for acknowledged locks"
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
