//! The crate's error type.

use std::time::Duration;

/// What went wrong building a limiter or deciding a request.
///
/// No variant carries a request key or a credential: keys may hold tokens or
/// addresses, so errors name a key's length, never its text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A quota, limit or limiter setting is out of range; the text says which
    /// and what is accepted.
    #[error("invalid rate-limit configuration: {0}")]
    Config(String),
    /// The key is empty: give every caller a non-empty subject (an address, a
    /// user id), or the whole service would share one bucket.
    #[error("the rate-limit key is empty; pass a subject such as a client address or user id")]
    EmptyKey,
    /// The key is longer than [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes.
    #[error("the rate-limit key is {len} bytes long; at most {max} are accepted")]
    KeyTooLong {
        /// The key's length in bytes.
        len: usize,
        /// The longest key accepted.
        max: usize,
    },
    /// The request costs more than a limit's burst, so it could never be
    /// admitted: raise the burst or lower the cost.
    #[error(
        "a cost of {cost} exceeds the burst {burst} of limit {limit}: it could never be admitted"
    )]
    CostExceedsBurst {
        /// The requested cost.
        cost: u64,
        /// The limit's burst.
        burst: u64,
        /// The limit's name.
        limit: String,
    },
    /// The store could not decide and the limiter's policy is
    /// [`OnStoreError::Deny`](crate::OnStoreError::Deny): refuse the request as
    /// temporarily unavailable (HTTP 503) and ask the caller to retry after
    /// `retry_after`.
    #[error(
        "the rate-limit store of limiter {limiter} is unavailable; retry after {retry_after:?}"
    )]
    StoreUnavailable {
        /// The limiter's name.
        limiter: String,
        /// When to try again.
        retry_after: Duration,
    },
    /// This backend cannot hold rate limits; the text says why and what to use.
    #[error("{0}")]
    Unsupported(String),
    /// A store could not be built or set up (connection, schema).
    #[error("rate-limit store setup failed: {0}")]
    Store(#[from] StoreError),
}

/// A `Result` whose error defaults to [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure a store call met, for the `kind` label of
/// `rate_limit_store_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer within the limiter's store timeout.
    Timeout,
    /// The connection could not be made or was lost.
    Connection,
    /// The server answered with an error (a script error, a refused command).
    Server,
    /// The answer could not be understood.
    Protocol,
}

impl StoreErrorKind {
    /// Every kind, in label order.
    pub const ALL: [Self; 4] = [
        Self::Timeout,
        Self::Connection,
        Self::Server,
        Self::Protocol,
    ];

    /// The label value.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::Server => "server",
            Self::Protocol => "protocol",
        }
    }
}

/// A store call that failed; the message never carries a credential or a key.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{} error: {message}", kind.as_str())]
pub struct StoreError {
    /// What kind of failure.
    pub kind: StoreErrorKind,
    /// What happened, for logs.
    pub message: String,
}

impl StoreError {
    /// A store error of `kind`.
    #[must_use]
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}
