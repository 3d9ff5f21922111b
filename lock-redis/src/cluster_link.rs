//! The cluster connection commands run on: redis-rs's cluster connection,
//! plus re-sending while the cluster answers "not here" or "not now".

use std::future::Future;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::RoutingInfo;
use redis::{
    Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;
use tracing::debug;

/// First wait before a command is sent again after an undecided answer;
/// the wait doubles up to [`MAX_RESEND_WAIT`].
const FIRST_RESEND_WAIT: Duration = Duration::from_millis(20);
/// Longest wait between two sends: short next to a renewal's budget (a
/// third of the TTL), long enough for the nodes to exchange a few gossip
/// messages between two tries.
const MAX_RESEND_WAIT: Duration = Duration::from_millis(160);

/// A cluster connection that sends a command again, with backoff, while the
/// cluster answers that it did not run it, for up to `patience` per call.
///
/// redis-rs follows `MOVED`/`ASK` itself but gives up after a fixed number
/// of tries, and it follows a `MOVED` at once, without waiting. After a
/// failover the surviving nodes learn of the promotion one gossip message
/// at a time, and a node that has not yet learnt it answers `MOVED` to the
/// dead primary: a client whose slot map is stale (every client that was
/// idle during the failover) can spend all its tries in a few milliseconds
/// while the cluster converges, and a holder's renewal would fail although
/// its lock is safe on the promoted replica. Each such answer means the
/// command did not run, so sending it again is always safe; the caller's
/// operation timeout still bounds the whole call, and `patience` (the same
/// timeout) bounds this loop on its own.
#[derive(Clone)]
pub(crate) struct ClusterLink {
    conn: ClusterConnection,
    patience: Duration,
}

impl ClusterLink {
    /// Wraps `conn`; one call keeps re-sending for at most `patience`.
    pub(crate) fn new(conn: ClusterConnection, patience: Duration) -> Self {
        Self { conn, patience }
    }
}

impl ClusterLink {
    /// Sends `cmd` to the node `routing` names (for commands about one
    /// node, such as `SCAN`, or about the cluster, such as `CLUSTER
    /// SLOTS`), again with backoff while the cluster did not run it.
    pub(crate) async fn route(&self, cmd: &Cmd, routing: &RoutingInfo) -> RedisResult<Value> {
        let conn = &self.conn;
        resend(self.patience, move || {
            let mut conn = conn.clone();
            let (cmd, routing) = (cmd.clone(), routing.clone());
            async move { conn.route_command(cmd, routing).await }
        })
        .await
    }
}

/// Whether `e` says the cluster did not run the command and may run it
/// later: a redirect (the slot map is changing), a slot being migrated or
/// unserved, or no connection to send it on. Never "lost": a lock's fate is
/// decided only by an answer from the primary of its slot.
fn not_run_yet(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
        ) | ErrorKind::ClusterConnectionNotFound
    ) || e.is_connection_refusal()
}

/// The wait before the next send after `wait`, or `None` when sending
/// again would pass `patience` counted from `started`.
fn next_wait(started: Instant, wait: Duration, patience: Duration) -> Option<Duration> {
    (started.elapsed().saturating_add(wait) < patience).then_some(wait)
}

/// `send`'s answer, sent again with backoff while it says the command did
/// not run, for at most `patience`.
async fn resend<T, F, Fut>(patience: Duration, mut send: F) -> RedisResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = RedisResult<T>>,
{
    let started = Instant::now();
    let mut wait = FIRST_RESEND_WAIT;
    loop {
        match send().await {
            Err(e) if not_run_yet(&e) => {
                let Some(nap) = next_wait(started, wait, patience) else {
                    return Err(e);
                };
                debug!(error = %e, wait = ?nap, "the cluster did not run the command; sending it again");
                tokio::time::sleep(nap).await;
                wait = wait.saturating_mul(2).min(MAX_RESEND_WAIT);
            }
            other => return other,
        }
    }
}

impl ConnectionLike for ClusterLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let conn = &self.conn;
        Box::pin(resend(self.patience, move || {
            let mut conn = conn.clone();
            async move { conn.req_packed_command(cmd).await }
        }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let conn = &self.conn;
        Box::pin(resend(self.patience, move || {
            let mut conn = conn.clone();
            async move { conn.req_packed_commands(pipeline, offset, count).await }
        }))
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use lock_core::backend::LeaseStatus;
    use lock_core::{LockBackend, LockName, OwnerToken};

    use crate::RedisBuilder;

    const OP_TIMEOUT: Duration = Duration::from_millis(500);

    /// A one-node "cluster" on loopback that owns every slot but answers
    /// the first `moved` scripts with `MOVED` to itself, as a node that has
    /// not yet learnt of a failover answers with the dead primary's
    /// address. Returns its port and the count of scripts it was sent.
    fn redirecting_node(moved: usize) -> (u16, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        let scripts = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&scripts);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || serve(stream, port, moved, &seen));
            }
        });
        (port, scripts)
    }

    fn serve(stream: TcpStream, port: u16, moved: usize, scripts: &AtomicUsize) {
        let Ok(mut out) = stream.try_clone() else {
            return;
        };
        let mut input = BufReader::new(stream);
        while let Some(args) = read_command(&mut input) {
            let name = args.first().map(|a| a.to_ascii_uppercase());
            let reply = match name.as_deref() {
                Some("PING") => "+PONG\r\n".to_owned(),
                Some("CLUSTER") => {
                    format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n")
                }
                Some("EVALSHA" | "EVAL") => {
                    if scripts.fetch_add(1, Ordering::SeqCst) < moved {
                        format!("-MOVED 1 127.0.0.1:{port}\r\n")
                    } else {
                        ":1\r\n".to_owned()
                    }
                }
                _ => "+OK\r\n".to_owned(),
            };
            if out.write_all(reply.as_bytes()).is_err() {
                return;
            }
        }
    }

    /// One RESP array of bulk strings, or `None` at the end of the stream.
    fn read_command(input: &mut impl BufRead) -> Option<Vec<String>> {
        let mut line = String::new();
        input.read_line(&mut line).ok()?;
        let n: usize = line.trim().strip_prefix('*')?.parse().ok()?;
        let mut args = Vec::with_capacity(n);
        for _ in 0..n {
            line.clear();
            input.read_line(&mut line).ok()?;
            let len: usize = line.trim().strip_prefix('$')?.parse().ok()?;
            let mut buf = vec![0; len + 2];
            input.read_exact(&mut buf).ok()?;
            buf.truncate(len);
            args.push(String::from_utf8(buf).ok()?);
        }
        Some(args)
    }

    async fn renew_on(port: u16) -> (Result<LeaseStatus, lock_core::BackendError>, Duration) {
        let backend = RedisBuilder::from_url(&format!("redis+cluster://127.0.0.1:{port}"))
            .expect("a cluster URL")
            .with_operation_timeout(OP_TIMEOUT)
            .build()
            .expect("a backend");
        let name = LockName::new("moved").expect("a lock name");
        let owner = OwnerToken::generate().expect("an owner token");
        let started = std::time::Instant::now();
        let got = backend.renew(&name, &owner, Duration::from_secs(10)).await;
        (got, started.elapsed())
    }

    /// A renewal whose first ten answers are `MOVED` (more than redis-rs
    /// follows by itself) still finds its lease held, within one
    /// operation timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renewal_outlasts_a_run_of_redirects() {
        let (port, scripts) = redirecting_node(10);
        let (got, took) = renew_on(port).await;
        assert!(
            matches!(got, Ok(LeaseStatus::Held)),
            "{got:?} after {took:?}"
        );
        assert!(took < OP_TIMEOUT, "{took:?}");
        assert_eq!(scripts.load(Ordering::SeqCst), 11);
    }

    /// Redirects that never end make the renewal fail as not decided
    /// (never as lost), within the operation timeout, and nothing is sent
    /// after the call returned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn endless_redirects_end_with_the_timeout() {
        let (port, scripts) = redirecting_node(usize::MAX);
        let (got, took) = renew_on(port).await;
        let err = got.expect_err("no answer but MOVED");
        assert!(err.kind().is_unavailable(), "{err}");
        assert!(took < OP_TIMEOUT + Duration::from_millis(100), "{took:?}");
        let sent = scripts.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(scripts.load(Ordering::SeqCst), sent, "sent after the call");
    }
}
