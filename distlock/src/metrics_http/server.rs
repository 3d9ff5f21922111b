//! The listener: accepts connections within a limit and serves each with
//! hyper under a header deadline, a buffer cap and a lifetime.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use super::config::{MetricsHttpError, MetricsServerBuilder, MIN_HEADER_BYTES};
use super::handler::MetricsService;

/// Sent, without reading the request, to a connection over the limit.
const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// How long a connection past its lifetime may take to finish the response
/// it is sending before it is cut.
const LIFETIME_GRACE: Duration = Duration::from_secs(5);

/// A standalone `/metrics` HTTP server. See the [module docs](super).
#[derive(Debug)]
pub struct MetricsServer(());

impl MetricsServer {
    /// Starts configuring a server for `registry` (a clone of a `Registry`
    /// shares its metrics).
    pub fn builder(registry: Registry) -> MetricsServerBuilder {
        MetricsServerBuilder::new(registry)
    }
}

impl MetricsServerBuilder {
    /// Binds the address and serves in a spawned task until the returned
    /// handle is shut down or dropped. Warns in the log when no token is set.
    /// Must be called inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`MetricsHttpError::Bind`] if the address cannot be listened on.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropped before it returns, nothing is left listening.
    pub async fn start(self) -> Result<MetricsServerHandle, MetricsHttpError> {
        let addr = self.addr;
        let bind = |source| MetricsHttpError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(bind)?;
        let local_addr = listener.local_addr().map_err(bind)?;
        if self.token.is_none() {
            warn!(
                %local_addr,
                "the metrics endpoint has no bearer token: anyone who can connect can read \
                 the metrics; set METRICS_TOKEN (or call token()) to require one"
            );
        } else {
            info!(%local_addr, "serving metrics at /metrics; scrapes need the bearer token");
        }
        let (stop, stopped) = watch::channel(());
        let task = tokio::spawn(accept_loop(listener, self, stopped));
        Ok(MetricsServerHandle {
            local_addr,
            stop,
            task,
        })
    }
}

/// A running [`MetricsServer`]. Dropping it stops the server too.
#[derive(Debug)]
#[must_use = "dropping the handle stops the server"]
pub struct MetricsServerHandle {
    local_addr: SocketAddr,
    stop: watch::Sender<()>,
    task: JoinHandle<()>,
}

impl MetricsServerHandle {
    /// The address the server listens on (with the port picked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every open connection, and waits until the
    /// server task has ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the server stops even if this future is dropped; only
    /// the wait is lost.
    pub async fn shutdown(self) {
        let Self { stop, task, .. } = self;
        drop(stop);
        let _ = task.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    settings: MetricsServerBuilder,
    mut stopped: watch::Receiver<()>,
) {
    let permits = Arc::new(Semaphore::new(settings.max_connections));
    let service = MetricsService::new(settings.registry, settings.token);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(settings.max_header_bytes.max(MIN_HEADER_BYTES));
    let lifetime = settings.connection_timeout;
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            // The only sender is the handle; its drop (or shutdown) ends this.
            _ = stopped.changed() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, usually: back off instead of spinning.
                warn!(error = %e, "cannot accept a metrics connection");
                tokio::select! {
                    _ = stopped.changed() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            // Refuse at once rather than queue: a queue would let idle or
            // slow clients hold up the scrapes behind them.
            let _ = stream.try_write(BUSY);
            debug!(%peer, "metrics connection refused: connection limit reached");
            continue;
        };
        let connection = http.serve_connection(TokioIo::new(stream), service.clone());
        connections.spawn(async move {
            let _permit = permit;
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                () = tokio::time::sleep(lifetime) => {
                    // Let a scrape in flight finish; an idle keep-alive
                    // connection closes at once.
                    connection.as_mut().graceful_shutdown();
                    match tokio::time::timeout(LIFETIME_GRACE, connection).await {
                        Ok(ended) => ended,
                        Err(_) => {
                            debug!(%peer, "metrics connection cut at its lifetime limit");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = ended {
                debug!(%peer, error = %e, "metrics connection ended with an error");
            }
        });
    }
    connections.shutdown().await;
}
