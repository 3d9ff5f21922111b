//! [`PostgresBuilder::from_url`] and [`PostgresBuilder::from_env`]: the
//! URL form, libpq's parameters included.

use std::error::Error as _;
use std::path::PathBuf;
use std::str::FromStr;

use lock_core::redact::redact_url;
use lock_core::BackendError;

use super::{PostgresBuilder, RootCert, SslMode, ENV_VAR, URL_SCHEMES};
use crate::error::config;
use crate::sessions::parse_count;

impl PostgresBuilder {
    /// Parses a `postgres://` or `postgresql://` URL, including the libpq
    /// parameters `sslmode` (`disable`, `prefer`, `require`, `verify-ca`,
    /// `verify-full`), `sslrootcert` and `application_name`, and this
    /// crate's `lock_sessions` ([`PostgresBuilder::with_lock_sessions`]).
    ///
    /// The user name and password end at the first `@`, so they may hold
    /// `/ ? # :` unencoded but must percent-encode `@` as `%40`.
    ///
    /// # Errors
    ///
    /// A [`Config`](lock_core::BackendErrorKind::Config) error for another
    /// scheme, a libpq `key=value` string, a second `@`, or a malformed URL.
    /// The message shows the URL with its credentials masked.
    pub fn from_url(url: &str) -> Result<Self, BackendError> {
        let shown = redact_url(url);
        let Some((scheme, rest)) = url.split_once("://") else {
            let hint = if url.contains('=') {
                "key=value connection strings are not supported"
            } else {
                "not a URL"
            };
            return Err(config(format!(
                "{hint} ({shown}): use postgres://user:password@host:port/db"
            )));
        };
        if !URL_SCHEMES.contains(&scheme) {
            return Err(config(format!(
                "unsupported URL scheme in {shown}: expected postgres:// or postgresql://"
            )));
        }
        // tokio-postgres ends the credentials at the first `@`: after a
        // second one, part of the password would be read as the host.
        let after_credentials = rest.split_once('@').map_or(rest, |(_, after)| after);
        if after_credentials.contains('@') {
            return Err(config(format!(
                "malformed Postgres URL {shown}: it holds more than one '@'; percent-encode '@' in the user name, password or parameters as %40"
            )));
        }
        let (base, query) = after_credentials
            .split_once('?')
            .unwrap_or((after_credentials, ""));
        // The reasons below may quote a parameter; after a secret parameter,
        // that text may be a piece of the secret, so they are left out.
        let quotable = redact_url(query) == query;
        let mut builder = Self::new();
        let mut passed = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "sslmode" => {
                    builder.inner.ssl_mode = SslMode::parse(value).ok_or_else(|| {
                        let got = if quotable { format!(" {value:?}") } else { String::new() };
                        config(format!(
                            "unknown sslmode{got} in {shown}; use disable, prefer, require, verify-ca or verify-full"
                        ))
                    })?;
                }
                "sslrootcert" => {
                    builder.inner.root_cert = Some(RootCert::File(PathBuf::from(value)));
                }
                "lock_sessions" => builder.inner.lock_sessions = parse_count(value, quotable)?,
                _ => passed.push(pair),
            }
        }
        let credentials = &url[..url.len() - after_credentials.len()];
        let rest = if passed.is_empty() {
            format!("{credentials}{base}")
        } else {
            format!("{credentials}{base}?{}", passed.join("&"))
        };
        let mut pg = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            if quotable {
                // The cause names the option ("invalid value for option `port`").
                let cause = e.source().map(|c| format!(": {c}")).unwrap_or_default();
                config(format!("malformed Postgres URL {shown}: {e}{cause}"))
            } else {
                config(format!(
                    "malformed Postgres URL {shown}: check the host, port, database name and parameters"
                ))
            }
        })?;
        if pg.get_hosts().is_empty() {
            pg.host("localhost");
        }
        if pg.get_user().is_none() {
            pg.user("postgres");
        }
        if pg.get_application_name().is_none() {
            pg.application_name("lock-postgres");
        }
        builder.inner.pg = pg;
        Ok(builder)
    }

    /// [`PostgresBuilder::from_url`] with the URL in `DATABASE_URL`.
    ///
    /// # Errors
    ///
    /// A `Config` error if the variable is unset or not a valid URL.
    pub fn from_env() -> Result<Self, BackendError> {
        match std::env::var(ENV_VAR) {
            Ok(url) => Self::from_url(&url),
            Err(_) => Err(config(format!(
                "{ENV_VAR} is not set (expected postgres://user@host:port/db)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lock_core::BackendErrorKind;

    #[test]
    fn parses_both_schemes_and_libpq_parameters() -> Result<(), BackendError> {
        let c = PostgresBuilder::from_url(
            "postgres://app:s3cret@db.example:6543/locks?sslmode=verify-full&sslrootcert=/ca.pem&application_name=svc",
        )?
        .config()?;
        assert_eq!(c.ssl_mode, SslMode::VerifyFull);
        assert!(matches!(c.root_cert, Some(RootCert::File(_))));
        assert_eq!(c.pg.get_ports(), &[6543]);
        assert_eq!(c.pg.get_dbname(), Some("locks"));
        assert_eq!(c.pg.get_application_name(), Some("svc"));
        let debug = format!("{c:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("<redacted>"));
        let c = PostgresBuilder::from_url("postgresql://u@h/d")?.config()?;
        assert_eq!(c.ssl_mode, SslMode::Disable);
        Ok(())
    }

    #[test]
    fn rejects_bad_urls_without_echoing_them() {
        for url in [
            "mysql://u:pw@h/d",
            "postgres://u:pw@h:notaport/d",
            "postgres://u:pw@h/d?sslmode=sometimes",
            "postgres://u:pw@h/d?bogus_param=1",
            "postgres://u:p@w@h/d",
            "postgres://u@h:notaport/d?password=pw@x",
            "host=h password=pw",
            "not a url",
        ] {
            match PostgresBuilder::from_url(url).and_then(PostgresBuilder::config) {
                Err(e) => {
                    assert_eq!(e.kind(), BackendErrorKind::Config, "{url}: {e}");
                    assert!(!format!("{e} {e:?}").contains("pw"), "{e}");
                }
                Ok(c) => panic!("{url} was accepted as {c:?}"),
            }
        }
    }

    #[test]
    fn errors_name_the_problem() {
        for (url, needle) in [
            ("postgres://u:pw@h:notaport/d", "option `port`"),
            (
                "postgres://u:pw@h/d?bogus_param=1",
                "unknown option `bogus_param`",
            ),
            ("postgres://u:pw@h/d?sslmode=sometimes", "\"sometimes\""),
            ("postgres://u:a@b@h/d", "%40"),
            ("host=h user=u", "key=value"),
        ] {
            let err = PostgresBuilder::from_url(url).expect_err(url);
            assert!(err.message().contains(needle), "{url}: {err}");
        }
        // After a secret parameter, a quoted value could be a piece of it.
        let err = PostgresBuilder::from_url("postgres://h/d?password=a&sslmode=b")
            .expect_err("bad sslmode");
        assert!(!err.message().contains("\"b\""), "{err}");
    }
}
