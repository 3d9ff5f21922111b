//! What still fails at start: a URL that cannot work whatever the server
//! does, and a server that answers and refuses the credentials.

use std::time::Duration;

use lock_core::BackendErrorKind;
use scheduler::{Error, Policy};
use tokio::time::Instant;

use super::servers::{redis_with_password, Kind, Private};
use crate::backends::postgres::server::{PASSWORD, ROLE_WITH_PASSWORD};
use crate::BoxError;

/// The wrong password every case offers; it must never show in an error.
const WRONG: &str = "n0t-the-Pw-7f3a";
/// A start that is refused needs one round trip; far less than this.
const BOUND: Duration = Duration::from_secs(10);

fn runtime() -> Result<tokio::runtime::Runtime, BoxError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Starts with `url` and expects an error that `check` accepts and that
/// does not carry [`WRONG`] or `s3cret`.
async fn refused(url: &str, check: impl Fn(&Error) -> bool) -> Result<(), BoxError> {
    let policy = Policy::from_vars(Some(url), None);
    let answer = match policy {
        Ok(policy) => tokio::time::timeout(BOUND, policy.connect())
            .await
            .map_err(|_| format!("starting took over {BOUND:?}"))?,
        Err(e) => Err(e),
    };
    let err = match answer {
        Ok(backend) => return Err(format!("started anyway: {backend:?}").into()),
        Err(e) => e,
    };
    let shown = format!("{err} {err:?}");
    if shown.contains(WRONG) || shown.contains("s3cret") {
        return Err(format!("the error shows the password: {shown}").into());
    }
    if !check(&err) {
        return Err(format!("unexpected error: {err:?}").into());
    }
    Ok(())
}

fn kind_is(want: BackendErrorKind) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::Connect { source, .. } if source.kind() == want)
}

/// A reachable server that refuses the password fails the start.
///
/// # Errors
///
/// If the start succeeded, or failed otherwise than with an `Auth` error.
pub fn rejected_password(kind: Kind) -> Result<(), BoxError> {
    let rt = runtime()?;
    match kind {
        Kind::Redis => {
            let server = redis_with_password("the-Right-one-9c1")?;
            let port = server.port();
            rt.block_on(async {
                refused(
                    &format!("redis://:{WRONG}@127.0.0.1:{port}"),
                    kind_is(BackendErrorKind::Auth),
                )
                .await?;
                // No password at all is refused the same way.
                refused(
                    &format!("redis://127.0.0.1:{port}"),
                    kind_is(BackendErrorKind::Auth),
                )
                .await
            })
        }
        Kind::Postgres => {
            let (private, _) = Private::start(Kind::Postgres)?;
            let port = private.process()?.port();
            let base = format!("127.0.0.1:{port}/postgres");
            rt.block_on(async {
                refused(
                    &format!("postgres://{ROLE_WITH_PASSWORD}:{WRONG}@{base}"),
                    kind_is(BackendErrorKind::Auth),
                )
                .await?;
                // The right password starts, so the refusal was the password's.
                let good = format!("postgres://{ROLE_WITH_PASSWORD}:{PASSWORD}@{base}");
                Policy::from_vars(Some(&good), None)?.connect().await?;
                Ok(())
            })
        }
        Kind::Etcd => Err("the etcd harness has no authenticating server".into()),
    }
}

/// URLs that are wrong whatever the server does fail the start at once,
/// without waiting for any server, and without showing their password.
///
/// # Errors
///
/// If one of them started, or failed slowly.
pub fn malformed_urls() -> Result<(), BoxError> {
    let rt = runtime()?;
    let malformed = |e: &Error| match e {
        Error::InvalidUrl { .. } | Error::UnknownScheme { .. } => true,
        Error::Connect { source, .. } => source.kind() == BackendErrorKind::Config,
        _ => false,
    };
    rt.block_on(async {
        for url in [
            "u:s3cret@127.0.0.1:6379",
            "redis://u:s3cret@127.0.0.1:notaport",
            "redis://127.0.0.1:6379/notadb",
            "postgres://u:s3cret@127.0.0.1:notaport/db",
            "postgres://u:s3cret@127.0.0.1:5432/db?sslmode=sometimes",
            "etcd://",
            "etcd://u:s3cret@",
            "etcd://u:s3cret@127.0.0.1:notaport",
            "ftp://u:s3cret@127.0.0.1",
        ] {
            let started = Instant::now();
            refused(url, malformed)
                .await
                .map_err(|e| format!("{}: {e}", lock_core::redact::redact_url(url)))?;
            if started.elapsed() > Duration::from_secs(2) {
                return Err(format!(
                    "{}: took {:?} to refuse",
                    lock_core::redact::redact_url(url),
                    started.elapsed()
                )
                .into());
            }
        }
        Ok(())
    })
}
