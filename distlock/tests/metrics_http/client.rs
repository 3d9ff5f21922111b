//! A raw TCP client and a server under test, shared by the cases.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use distlock::metrics_http::{MetricsServer, MetricsServerHandle};
use distlock::prometheus::{IntCounter, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

pub(crate) const TOKEN: &str = "t0ken-for-tests";
/// Every case ends within this, so a server that stalls fails fast.
pub(crate) const CASE_LIMIT: Duration = Duration::from_secs(30);

pub(crate) fn registry() -> Registry {
    let registry = Registry::new();
    let counter = IntCounter::new("probe_total", "A probe.").expect("valid metric");
    counter.inc_by(7);
    registry
        .register(Box::new(counter))
        .expect("registers in a fresh registry");
    registry
}

pub(crate) async fn start(max_connections: usize, header_timeout: Duration) -> MetricsServerHandle {
    MetricsServer::builder(registry())
        .with_token(TOKEN)
        .with_bind(([127, 0, 0, 1], 0).into())
        .with_max_connections(max_connections)
        .with_header_read_timeout(header_timeout)
        .start()
        .await
        .expect("binds a free loopback port")
}

/// Sends `raw` and reads until the server closes; returns what came back.
pub(crate) async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connects");
    stream.write_all(raw).await.expect("sends the request");
    let mut out = Vec::new();
    let _ = timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn get(path: &str, auth: Option<&str>) -> Vec<u8> {
    let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n{auth}Connection: close\r\n\r\n").into_bytes()
}

/// A scrape with the token; panics unless it returns the exposition.
pub(crate) async fn good_scrape(addr: SocketAddr) -> Duration {
    let started = Instant::now();
    let reply = exchange(addr, &get("/metrics", Some(&format!("Bearer {TOKEN}")))).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("probe_total 7"), "{reply}");
    started.elapsed()
}

pub(crate) fn status(reply: &str) -> &str {
    reply.lines().next().unwrap_or("")
}
