//! A loopback TCP fault proxy, placed between a client and its server.
//!
//! It forwards bytes both ways and can, on demand: blackhole traffic (drop it
//! silently while connections stay open, like a partition that loses
//! packets), delay every chunk, reset every open connection, or stop
//! accepting new ones. Modelled on etcd's test proxy; it needs no kernel
//! support (this machine has no netem) and touches no shared server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::BoxError;

#[derive(Debug, Default)]
struct Faults {
    blackhole: AtomicBool,
    delay_ms: AtomicU64,
    accept_paused: AtomicBool,
    /// Bumped by `reset_all`; every connection watches it and dies when it moves.
    resets: Mutex<Option<watch::Sender<u64>>>,
    connections: AtomicU64,
}

/// A running proxy. Dropping it stops accepting; open connections end with it.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: Arc<Faults>,
    reset_rx: watch::Receiver<u64>,
    accept_task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<Self, BoxError> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (reset_tx, reset_rx) = watch::channel(0u64);
        let faults = Arc::new(Faults {
            resets: Mutex::new(Some(reset_tx)),
            ..Faults::default()
        });
        let accept_task = tokio::spawn(accept_loop(
            listener,
            upstream,
            Arc::clone(&faults),
            reset_rx.clone(),
        ));
        Ok(Self {
            addr,
            faults,
            reset_rx,
            accept_task,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops all traffic in both directions while on; connections stay open.
    pub fn blackhole(&self, on: bool) {
        self.faults.blackhole.store(on, Ordering::SeqCst);
    }

    /// Delays every forwarded chunk by `delay` (zero turns it off).
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.faults.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Stops (or resumes) accepting new connections. The kernel still
    /// completes handshakes up to the backlog, so connects succeed and then hang.
    pub fn pause_accept(&self, on: bool) {
        self.faults.accept_paused.store(on, Ordering::SeqCst);
    }

    /// Resets every open connection (RST to the client, close to the server).
    pub fn reset_all(&self) {
        if let Ok(guard) = self.faults.resets.lock() {
            if let Some(tx) = guard.as_ref() {
                tx.send_modify(|n| *n += 1);
            }
        }
    }

    /// How many connections the proxy has accepted so far.
    pub fn connections(&self) -> u64 {
        self.faults.connections.load(Ordering::SeqCst)
    }

    /// A receiver that changes on every reset (for tests of the proxy itself).
    pub fn resets(&self) -> watch::Receiver<u64> {
        self.reset_rx.clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.reset_all();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    faults: Arc<Faults>,
    resets: watch::Receiver<u64>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        // A connection that arrives while paused is held unserved until resume,
        // which is what the client of a server that stopped accepting sees.
        while faults.accept_paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        faults.connections.fetch_add(1, Ordering::SeqCst);
        let (faults, resets) = (Arc::clone(&faults), resets.clone());
        tokio::spawn(async move {
            if let Ok(server) = TcpStream::connect(upstream).await {
                connection(client, server, faults, resets).await;
            }
        });
    }
}

async fn connection(
    client: TcpStream,
    server: TcpStream,
    faults: Arc<Faults>,
    mut resets: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    resets.mark_unchanged();
    let client_std = client.into_std();
    let server_std = server.into_std();
    let (Ok(client), Ok(server)) = (client_std, server_std) else {
        return;
    };
    // Keep a handle to set SO_LINGER=0 on reset, so the client sees an RST.
    let (Ok(client_for_reset), Ok(client), Ok(server)) = (
        client.try_clone().and_then(TcpStream::from_std),
        TcpStream::from_std(client),
        TcpStream::from_std(server),
    ) else {
        return;
    };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, Arc::clone(&faults));
    let down = pump(sr, cw, Arc::clone(&faults));
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = resets.changed() => {
            let _ = client_for_reset.set_zero_linger();
        }
    }
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, faults: Arc<Faults>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = faults.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if faults.blackhole.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{timeout, Instant};

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
        let start = Instant::now();
        s.write_all(b"ping").await.ok()?;
        let mut buf = [0u8; 4];
        match timeout(limit, s.read_exact(&mut buf)).await {
            Ok(Ok(_)) if &buf == b"ping" => Some(start.elapsed()),
            _ => None,
        }
    }

    #[tokio::test]
    async fn forwards_blackholes_delays_and_resets() {
        let proxy = FaultProxy::start(echo_server().await).await.expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        let short = Duration::from_millis(300);
        assert!(
            round_trip(&mut s, short).await.is_some(),
            "healthy proxy forwards"
        );

        proxy.blackhole(true);
        assert!(
            round_trip(&mut s, short).await.is_none(),
            "blackholed bytes arrived"
        );
        proxy.blackhole(false);
        let mut fresh = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(
            round_trip(&mut fresh, short).await.is_some(),
            "healed proxy forwards"
        );

        proxy.set_delay(Duration::from_millis(150));
        let rtt = round_trip(&mut fresh, Duration::from_secs(2))
            .await
            .expect("delayed echo");
        assert!(
            rtt >= Duration::from_millis(300),
            "two delayed hops took only {rtt:?}"
        );
        proxy.set_delay(Duration::ZERO);

        proxy.reset_all();
        let mut buf = [0u8; 4];
        let read = timeout(Duration::from_secs(2), fresh.read(&mut buf))
            .await
            .expect("reset is prompt");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "connection survived a reset: {read:?}"
        );

        proxy.pause_accept(true);
        let before = proxy.connections();
        let mut paused = TcpStream::connect(proxy.addr())
            .await
            .expect("kernel completes the handshake");
        assert!(
            round_trip(&mut paused, short).await.is_none(),
            "a paused proxy served a new connection"
        );
        assert_eq!(proxy.connections(), before);
        proxy.pause_accept(false);
        assert!(
            round_trip(&mut paused, Duration::from_secs(2))
                .await
                .is_some(),
            "accepted after resume"
        );
    }
}
