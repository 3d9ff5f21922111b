//! The server's settings and its error type.

use std::net::SocketAddr;
use std::time::Duration;

use prometheus::Registry;

use super::auth::BearerToken;

/// The environment variable [`MetricsServerBuilder::with_token_from_env`] reads.
pub const METRICS_TOKEN_ENV: &str = "METRICS_TOKEN";

/// What went wrong serving metrics. Never carries the token.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsHttpError {
    /// The listening socket could not be opened.
    #[error("cannot listen for metrics scrapes on {addr}: {source}; pick a free port or an address this host owns")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The registry could not be encoded in the text format (a collector
    /// produced an invalid family).
    #[error("cannot encode the metrics registry: {0}; check the collectors registered in it")]
    Encode(String),
}

/// Configures and starts a [`MetricsServer`](super::MetricsServer).
///
/// Defaults: `127.0.0.1:9464`, no token, 64 connections, 5 s to send the
/// request headers, 16 KiB of headers, 30 s per connection.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `start` is called"]
pub struct MetricsServerBuilder {
    pub(super) registry: Registry,
    pub(super) token: Option<BearerToken>,
    pub(super) addr: SocketAddr,
    pub(super) max_connections: usize,
    pub(super) header_read_timeout: Duration,
    pub(super) max_header_bytes: usize,
    pub(super) connection_timeout: Duration,
}

/// hyper refuses read buffers below 8 KiB; a smaller setting is raised to it.
pub(super) const MIN_HEADER_BYTES: usize = 8192;

impl MetricsServerBuilder {
    pub(super) fn new(registry: Registry) -> Self {
        Self {
            registry,
            token: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            max_connections: 64,
            header_read_timeout: Duration::from_secs(5),
            max_header_bytes: 16 * 1024,
            connection_timeout: Duration::from_secs(30),
        }
    }

    /// Requires `Authorization: Bearer <token>` on every scrape. An empty
    /// token counts as none.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = BearerToken::new(token);
        self
    }

    /// Takes the token from `METRICS_TOKEN` when it is set and not empty;
    /// otherwise keeps the one set before, if any.
    pub fn with_token_from_env(mut self) -> Self {
        if let Some(token) = std::env::var(METRICS_TOKEN_ENV)
            .ok()
            .and_then(BearerToken::new)
        {
            self.token = Some(token);
        }
        self
    }

    /// Listens on `addr` (port 0 picks a free port; see
    /// [`MetricsServerHandle::local_addr`](super::MetricsServerHandle::local_addr)).
    pub fn with_bind(mut self, addr: SocketAddr) -> Self {
        self.addr = addr;
        self
    }

    /// Serves at most `n` connections at once (at least 1); one more is
    /// answered `503` and closed at once.
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Closes a connection whose request headers have not all arrived
    /// within `timeout` (a slow or stalled client).
    pub fn with_header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }

    /// Answers `431` to request headers larger than `bytes` (at least 8 KiB).
    pub fn with_max_header_bytes(mut self, bytes: usize) -> Self {
        self.max_header_bytes = bytes.max(MIN_HEADER_BYTES);
        self
    }

    /// Closes any connection, even a busy keep-alive one, after `timeout`: a
    /// response being sent gets 5 s more to finish, then it is cut.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The only test in this binary that touches METRICS_TOKEN.
    #[test]
    fn the_env_token_counts_only_when_set_and_not_empty() {
        let builder = || MetricsServerBuilder::new(Registry::new());
        std::env::remove_var(METRICS_TOKEN_ENV);
        assert!(builder().with_token_from_env().token.is_none());
        std::env::set_var(METRICS_TOKEN_ENV, "");
        assert!(builder().with_token_from_env().token.is_none());
        assert!(
            builder()
                .with_token("kept")
                .with_token_from_env()
                .token
                .is_some(),
            "an empty variable keeps a token set before"
        );
        std::env::set_var(METRICS_TOKEN_ENV, "from-env");
        let token = builder()
            .with_token_from_env()
            .token
            .expect("read from the env");
        assert!(token.authorize(Some(b"Bearer from-env")));
        std::env::remove_var(METRICS_TOKEN_ENV);
        assert!(builder().with_token("").token.is_none(), "empty is unset");
        assert_eq!(
            builder().with_max_header_bytes(10).max_header_bytes,
            MIN_HEADER_BYTES
        );
        assert_eq!(builder().with_max_connections(0).max_connections, 1);
    }
}
