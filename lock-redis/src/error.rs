//! Converts native client errors into [`BackendError`]s whose kind tells
//! callers what to do (fail closed on `Unavailable`/`Timeout`, fix the
//! configuration on `Auth`/`Config`).

use std::error::Error as StdError;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// Maps an error from the redis client, naming the operation and the server.
pub(crate) fn from_redis(err: RedisError, op: &str, target: &str) -> BackendError {
    let (kind, hint) = classify(&err);
    let mut message = format!("{op} on {target} failed");
    if let Some(hint) = hint {
        message.push_str(" (");
        message.push_str(hint);
        message.push(')');
    }
    BackendError::new(kind, message).with_source(err)
}

/// The error for an operation that got no answer within `limit`.
pub(crate) fn timed_out(op: &str, target: &str, limit: Duration) -> BackendError {
    BackendError::timeout(format!(
        "{op} on {target}: no answer within the timeout of {limit:?}"
    ))
}

/// A configuration error (bad URL, bad option), detected before any I/O.
pub(crate) fn config(message: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Config, message)
}

/// A reply the scripts never produce.
pub(crate) fn protocol(op: &str, target: &str, what: impl std::fmt::Display) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("{op} on {target}: unexpected reply {what}"),
    )
}

fn classify(err: &RedisError) -> (BackendErrorKind, Option<&'static str>) {
    if is_tls_failure(err) {
        return (
            BackendErrorKind::Config,
            Some("TLS handshake failed: check the CA certificate, the host name, and that the server speaks TLS on this port"),
        );
    }
    if let Some(code) = err.code() {
        match code {
            "NOPERM" => {
                return (
                    BackendErrorKind::Auth,
                    Some("the ACL user may not run this command or touch this key or channel"),
                )
            }
            "NOREPLICAS" => {
                return (
                    BackendErrorKind::Unavailable,
                    Some("the primary has too few replicas to accept writes (min-replicas-to-write); a failover may be under way"),
                )
            }
            "WRONGPASS" | "NOAUTH" => {
                return (
                    BackendErrorKind::Auth,
                    Some("authentication failed: check the user name and password"),
                )
            }
            _ => {}
        }
    }
    match err.kind() {
        ErrorKind::AuthenticationFailed => (
            BackendErrorKind::Auth,
            Some("authentication failed: check the user name and password"),
        ),
        ErrorKind::InvalidClientConfig => (BackendErrorKind::Config, None),
        ErrorKind::Io if err.is_timeout() => (BackendErrorKind::Timeout, None),
        ErrorKind::Io if err.is_connection_refusal() => (
            BackendErrorKind::Unavailable,
            Some("connection refused: is the server running on this host and port?"),
        ),
        ErrorKind::Io if is_reset(err) => (
            BackendErrorKind::Unavailable,
            Some("connection closed by the server; if it only accepts TLS, use a rediss:// URL"),
        ),
        ErrorKind::Io => (BackendErrorKind::Unavailable, None),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::MasterDown
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown,
        ) => (BackendErrorKind::Unavailable, None),
        // The cluster did not run the command: its slot map is changing (a
        // failover or a migration) or no node could be reached for the
        // slot. Not decided, so callers retry within their deadline.
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) => (
            BackendErrorKind::Unavailable,
            Some("the cluster redirected the command until the timeout; its slots are moving (a failover or a resharding)"),
        ),
        ErrorKind::ClusterConnectionNotFound => (
            BackendErrorKind::Unavailable,
            Some("no cluster node could be reached for the key's slot"),
        ),
        ErrorKind::Server(ServerErrorKind::ReadOnly) => (
            BackendErrorKind::Unavailable,
            Some("the server is a read-only replica; locks need the primary"),
        ),
        ErrorKind::Server(ServerErrorKind::NoPerm) => (
            BackendErrorKind::Auth,
            Some("the ACL user may not run this command or touch this key or channel"),
        ),
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => (BackendErrorKind::Protocol, None),
        _ => (BackendErrorKind::Other, None),
    }
}

/// Walks the source chain for an error of the TLS layer (certificate
/// rejected, handshake garbage from a plaintext server).
fn is_tls_failure(err: &RedisError) -> bool {
    any_in_chain(err, |e| {
        e.downcast_ref::<rustls::Error>().is_some()
            || e.downcast_ref::<io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
    })
}

fn is_reset(err: &RedisError) -> bool {
    any_in_chain(err, |e| {
        e.downcast_ref::<io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionAborted
            )
        })
    })
}

/// Whether `test` holds for any error in the source chain. The client wraps
/// its causes in an `Arc`, whose own `source` skips the wrapped error, so
/// the chain is unwrapped by hand.
fn any_in_chain(err: &RedisError, test: impl Fn(&(dyn StdError + 'static)) -> bool) -> bool {
    let mut next: Option<&(dyn StdError + 'static)> = Some(err);
    let mut steps = 0;
    while let Some(e) = next {
        let e = match e.downcast_ref::<Arc<dyn StdError + Send + Sync>>() {
            Some(wrapped) => &**wrapped as &(dyn StdError + 'static),
            None => e,
        };
        if test(e) {
            return true;
        }
        steps += 1;
        if steps > 16 {
            return false;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_failure() {
        let refused = RedisError::from(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(
            from_redis(refused, "acquire", "redis://h:1").kind(),
            BackendErrorKind::Unavailable
        );
        let slow = RedisError::from(io::Error::from(io::ErrorKind::TimedOut));
        assert_eq!(
            from_redis(slow, "renew", "redis://h:1").kind(),
            BackendErrorKind::Timeout
        );
        let auth = RedisError::from((ErrorKind::AuthenticationFailed, "nope"));
        let mapped = from_redis(auth, "connect", "redis://h:1");
        assert_eq!(mapped.kind(), BackendErrorKind::Auth);
        assert!(mapped.to_string().contains("redis://h:1"), "{mapped}");
        let tls = RedisError::from(io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        assert_eq!(
            from_redis(tls, "connect", "rediss://h:1").kind(),
            BackendErrorKind::Config
        );
    }

    #[test]
    fn cluster_redirects_are_not_decided() {
        for kind in [
            ErrorKind::Server(ServerErrorKind::Moved),
            ErrorKind::Server(ServerErrorKind::Ask),
            ErrorKind::Server(ServerErrorKind::TryAgain),
            ErrorKind::Server(ServerErrorKind::ClusterDown),
            ErrorKind::ClusterConnectionNotFound,
        ] {
            let e = from_redis(RedisError::from((kind, "x")), "renew", "cluster");
            assert!(e.kind().is_unavailable(), "{kind:?} -> {:?}", e.kind());
        }
        let cross = RedisError::from((ErrorKind::Server(ServerErrorKind::CrossSlot), "x"));
        assert_eq!(
            from_redis(cross, "renew", "cluster").kind(),
            BackendErrorKind::Other
        );
    }
}
