//! A loopback TCP fault proxy, placed between a client and its server.
//!
//! It forwards bytes both ways and can, on demand: blackhole traffic (hold
//! it silently while connections stay open, as a partition does: TCP
//! retransmits, so the bytes arrive late once it heals, never lost), delay
//! every chunk (both ways, or responses only), reset every open connection,
//! stop accepting new ones, or send new connections to another upstream (a
//! failover behind a virtual IP). Modelled on etcd's test proxy; it needs no
//! kernel support (this machine has no netem) and touches no shared server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::BoxError;

#[derive(Debug)]
struct Faults {
    /// `true` while blackholed; writers wait for it to turn `false`.
    blackhole: watch::Sender<bool>,
    delay_ms: AtomicU64,
    /// Extra delay on the server-to-client direction only.
    response_delay_ms: AtomicU64,
    accept_paused: AtomicBool,
    upstream: Mutex<SocketAddr>,
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
            blackhole: watch::channel(false).0,
            delay_ms: AtomicU64::new(0),
            response_delay_ms: AtomicU64::new(0),
            accept_paused: AtomicBool::new(false),
            upstream: Mutex::new(upstream),
            resets: Mutex::new(Some(reset_tx)),
            connections: AtomicU64::new(0),
        });
        let accept_task =
            tokio::spawn(accept_loop(listener, Arc::clone(&faults), reset_rx.clone()));
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

    /// Holds all traffic in both directions while on; connections stay
    /// open. Nothing is dropped: what was held is delivered, in order, once
    /// it is turned off, as TCP retransmission does after a partition heals.
    pub fn blackhole(&self, on: bool) {
        self.faults.blackhole.send_replace(on);
    }

    /// Delays every forwarded chunk, both ways, by `delay` (zero turns it
    /// off). Each chunk is due `delay` after it was read, so chunks in
    /// flight together are delayed together, not one after the other.
    pub fn set_delay(&self, delay: Duration) {
        self.faults.delay_ms.store(millis(delay), Ordering::SeqCst);
    }

    /// Delays what the server sends back by `delay`, on top of
    /// [`FaultProxy::set_delay`] (zero turns it off): a slow reply path.
    pub fn set_response_delay(&self, delay: Duration) {
        self.faults
            .response_delay_ms
            .store(millis(delay), Ordering::SeqCst);
    }

    /// Sends connections accepted from now on to `upstream`; open ones keep
    /// their server until they end (pair it with [`FaultProxy::reset_all`]
    /// to emulate a failover behind a virtual IP or a sentinel).
    pub fn set_upstream(&self, upstream: SocketAddr) {
        if let Ok(mut slot) = self.faults.upstream.lock() {
            *slot = upstream;
        }
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn accept_loop(listener: TcpListener, faults: Arc<Faults>, resets: watch::Receiver<u64>) {
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
        let Ok(upstream) = faults.upstream.lock().map(|u| *u) else {
            continue;
        };
        // Counted from here: a reset while the upstream connection is being
        // made must reset this one too, or a client would keep a connection
        // that a reset of "every connection" missed.
        let mut resets = resets.clone();
        resets.mark_unchanged();
        let faults = Arc::clone(&faults);
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
    let up = pump(cr, sw, Arc::clone(&faults), false);
    let down = pump(sr, cw, Arc::clone(&faults), true);
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = resets.changed() => {
            let _ = client_for_reset.set_zero_linger();
        }
    }
}

/// Forwards `from` to `to`: a reader that stamps every chunk when it
/// arrives, and a writer that sends it when it is due and no blackhole holds
/// it. Splitting the two keeps chunks moving in parallel through a delay,
/// and keeps a blackhole from losing anything.
async fn pump(from: OwnedReadHalf, to: OwnedWriteHalf, faults: Arc<Faults>, response: bool) {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::join!(read_side(from, tx), write_side(rx, to, faults, response));
}

async fn read_side(mut from: OwnedReadHalf, tx: mpsc::UnboundedSender<(Instant, Vec<u8>)>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
            break;
        }
    }
}

async fn write_side(
    mut rx: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>,
    mut to: OwnedWriteHalf,
    faults: Arc<Faults>,
    response: bool,
) {
    let mut healed = faults.blackhole.subscribe();
    while let Some((read_at, chunk)) = rx.recv().await {
        let mut delay = faults.delay_ms.load(Ordering::SeqCst);
        if response {
            delay = delay.saturating_add(faults.response_delay_ms.load(Ordering::SeqCst));
        }
        if delay > 0 {
            tokio::time::sleep_until(read_at + Duration::from_millis(delay)).await;
        }
        // Held, not dropped, while the blackhole lasts.
        if healed.wait_for(|on| !*on).await.is_err() {
            break;
        }
        if to.write_all(&chunk).await.is_err() {
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
        // The held ping arrives after healing: nothing was dropped.
        let mut held = [0u8; 4];
        timeout(Duration::from_secs(2), s.read_exact(&mut held))
            .await
            .expect("held bytes arrive after healing")
            .expect("read");
        assert_eq!(&held, b"ping");
        assert!(
            round_trip(&mut s, short).await.is_some(),
            "the blackholed connection works after healing"
        );
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

    #[tokio::test]
    async fn delays_responses_in_parallel_and_switches_upstream() {
        let proxy = FaultProxy::start(echo_server().await).await.expect("proxy");
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        proxy.set_response_delay(Duration::from_millis(200));
        // Two pings sent together come back together, one delay later.
        let start = Instant::now();
        s.write_all(b"pi").await.expect("write");
        s.write_all(b"ng").await.expect("write");
        let mut buf = [0u8; 4];
        timeout(Duration::from_secs(2), s.read_exact(&mut buf))
            .await
            .expect("delayed echo")
            .expect("read");
        let rtt = start.elapsed();
        assert!(
            rtt >= Duration::from_millis(200) && rtt < Duration::from_millis(390),
            "response delay of 200 ms gave {rtt:?}"
        );
        proxy.set_response_delay(Duration::ZERO);

        // A second server: new connections go there, open ones stay.
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let other = listener.local_addr().expect("addr");
        proxy.set_upstream(other);
        let _fresh = TcpStream::connect(proxy.addr()).await.expect("connect");
        let accepted = timeout(Duration::from_secs(2), listener.accept()).await;
        assert!(
            accepted.is_ok(),
            "a new connection reached the new upstream"
        );
        assert!(
            round_trip(&mut s, Duration::from_secs(1)).await.is_some(),
            "an open connection keeps its server"
        );
    }
}
