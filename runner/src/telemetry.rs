//! Logs and the /metrics endpoint.

use std::io::IsTerminal;
use std::net::SocketAddr;

use distlock::metrics_http::{MetricsServer, MetricsServerHandle};
use tracing::info;
use tracing_subscriber::EnvFilter;

use crate::exit::Failure;

/// Logs to stderr (stdout carries the commands' output): human-readable,
/// or JSON lines; RUST_LOG sets the filter, default `info`.
pub(crate) fn init_logs(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a terminal: a journal or a log file would keep the
    // escape codes.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // A second initialisation can only come from a bug; logging then goes
    // wherever the first one sends it.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Serves the process's default registry (the lock and scheduler metrics
/// report there) on `addr`, with the token from `METRICS_TOKEN` if set.
pub(crate) async fn serve_metrics(
    addr: Option<SocketAddr>,
) -> Result<Option<MetricsServerHandle>, Failure> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let registry = distlock::prometheus::default_registry().clone();
    let handle = MetricsServer::builder(registry)
        .with_bind(addr)
        .with_token_from_env()
        .start()
        .await
        .map_err(|e| Failure::usage(e.to_string()))?;
    info!(addr = %handle.local_addr(), "serving /metrics");
    Ok(Some(handle))
}
