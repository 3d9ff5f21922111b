//! Converts `etcd-client` errors into [`BackendError`]s of the right kind.

use etcd_client::Error as EtcdError;
use lock_core::{BackendError, BackendErrorKind};
use tonic::Code;

/// Wraps a native client error, naming the operation that failed.
pub(crate) fn convert(op: &str, e: EtcdError) -> BackendError {
    let kind = kind_of(&e);
    let what = match kind {
        BackendErrorKind::Unavailable => "etcd is unreachable",
        BackendErrorKind::Timeout => "etcd did not answer in time",
        BackendErrorKind::Auth => "etcd refused the credentials or the operation",
        BackendErrorKind::Config => "the etcd client is misconfigured",
        _ => "etcd failed",
    };
    BackendError::new(kind, format!("{op}: {what}")).with_source(e)
}

fn kind_of(e: &EtcdError) -> BackendErrorKind {
    match e {
        EtcdError::GRpcStatus(status) => match status.code() {
            Code::Unavailable | Code::Cancelled | Code::Aborted => BackendErrorKind::Unavailable,
            // Statuses from the server never carry a source; one with a source
            // was made on this side from a broken connection.
            Code::Unknown if std::error::Error::source(status).is_some() => {
                BackendErrorKind::Unavailable
            }
            Code::DeadlineExceeded => BackendErrorKind::Timeout,
            Code::Unauthenticated | Code::PermissionDenied => BackendErrorKind::Auth,
            // etcd reports bad passwords, missing credentials and "auth not
            // enabled" with these codes; only the message tells them apart.
            Code::InvalidArgument | Code::FailedPrecondition if is_auth(status.message()) => {
                BackendErrorKind::Auth
            }
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                BackendErrorKind::Protocol
            }
            _ => BackendErrorKind::Other,
        },
        EtcdError::TransportError(_) | EtcdError::IoError(_) | EtcdError::WatchError(_) => {
            BackendErrorKind::Unavailable
        }
        EtcdError::InvalidArgs(_)
        | EtcdError::InvalidUri(_)
        | EtcdError::InvalidMetadataValue(_)
        | EtcdError::EndpointError(_) => BackendErrorKind::Config,
        EtcdError::LeaseKeepAliveError(_) => BackendErrorKind::Unavailable,
        _ => BackendErrorKind::Other,
    }
}

fn is_auth(message: &str) -> bool {
    ["auth", "user name", "password", "permission"]
        .iter()
        .any(|word| message.contains(word))
}

/// True when the server said the lease does not exist (any more).
pub(crate) fn is_lease_not_found(e: &EtcdError) -> bool {
    match e {
        EtcdError::GRpcStatus(status) => {
            status.code() == Code::NotFound || status.message().contains("lease not found")
        }
        EtcdError::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    }
}

/// Whether `e` failed before any member acted on the request: the TCP
/// connection to the member was refused (a
/// killed member), or that member answered "no leader" (one cut off from
/// the others: the client asks every member to refuse requests while it has
/// no leader, which etcd checks before it handles them). The call can then
/// be repeated as it is, at another member or this one.
pub(crate) fn unserved(e: &BackendError) -> bool {
    let Some(source) = std::error::Error::source(e) else {
        return false;
    };
    let Some(EtcdError::GRpcStatus(status)) = source.downcast_ref::<EtcdError>() else {
        return false;
    };
    if status.code() != Code::Unavailable {
        return false;
    }
    // tonic names a failed TCP connect so; the io error underneath says why.
    if status.message() == "tcp connect error" || status.message() == "etcdserver: no leader" {
        return true;
    }
    let mut next = std::error::Error::source(status);
    for _ in 0..16 {
        let Some(cause) = next else {
            return false;
        };
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        next = cause.source();
    }
    false
}

/// A response that lacked a field etcd always sends.
pub(crate) fn protocol(op: &str, what: &str) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, format!("{op}: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    fn kind(status: Status) -> BackendErrorKind {
        kind_of(&EtcdError::GRpcStatus(status))
    }

    #[test]
    fn statuses_map_to_what_the_caller_must_do() {
        assert_eq!(
            kind(Status::unavailable("x")),
            BackendErrorKind::Unavailable
        );
        assert_eq!(
            kind(Status::deadline_exceeded("x")),
            BackendErrorKind::Timeout
        );
        assert_eq!(kind(Status::permission_denied("x")), BackendErrorKind::Auth);
        for message in [
            "etcdserver: user name is empty",
            "etcdserver: authentication failed, invalid user ID or password",
        ] {
            assert_eq!(
                kind(Status::invalid_argument(message)),
                BackendErrorKind::Auth
            );
        }
        assert_eq!(
            kind(Status::invalid_argument(
                "etcdserver: too many operations in txn request"
            )),
            BackendErrorKind::Protocol
        );
        assert_eq!(
            kind(Status::unknown("from the server")),
            BackendErrorKind::Other
        );
        let local = Status::from_error(Box::new(std::io::Error::other("broken pipe")));
        assert!(!unserved(&convert(
            "x",
            EtcdError::GRpcStatus(local.clone())
        )));
        let mut refused = Status::unavailable("connect");
        refused.set_source(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert!(unserved(&convert("x", EtcdError::GRpcStatus(refused))));
        assert!(unserved(&convert(
            "x",
            EtcdError::GRpcStatus(Status::unavailable("tcp connect error"))
        )));
        assert!(unserved(&convert(
            "x",
            EtcdError::GRpcStatus(Status::unavailable("etcdserver: no leader"))
        )));
        assert!(!unserved(&convert(
            "x",
            EtcdError::GRpcStatus(Status::unavailable("etcdserver: request timed out"))
        )));
        assert_eq!(kind(local), BackendErrorKind::Unavailable);
        assert_eq!(
            kind_of(&EtcdError::InvalidArgs("empty endpoints".into())),
            BackendErrorKind::Config
        );
    }
}
