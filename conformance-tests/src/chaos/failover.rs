//! X6 (Redis): a failover that loses the lock key. The library reaches "the
//! primary" through the fault proxy, as through a virtual IP; the primary
//! takes the lock without replicating it, dies, and the replica is promoted.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_core::{Error, LeaseHandle, LossReason};
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use super::case_timing;
use super::figures::{self, Row};
use super::key_int;
use super::Target;
use crate::backends::redis::{config_for, server};
use crate::proxy::FaultProxy;
use crate::{Ctx, Replica};

/// Pause between guarded writes.
const WRITE_EVERY: Duration = Duration::from_millis(10);
/// Upper bound on writes per writer.
const MAX_WRITES: usize = 6_000;
/// Attempts the successor makes on the promoted replica.
const SUCCESSOR_ATTEMPTS: usize = 100;

/// One fenced store, with the order in which it accepted writes.
#[derive(Debug, Default)]
struct Fenced {
    max: u64,
    /// Accepted writes: (when, writer, token), in the store's order.
    accepted: Vec<(Instant, Writer, u64)>,
    rejected: usize,
}

impl Fenced {
    fn write(&mut self, writer: Writer, token: u64) -> bool {
        if token < self.max {
            self.rejected += 1;
            return false;
        }
        self.max = token;
        self.accepted.push((Instant::now(), writer, token));
        true
    }

    /// The old holder's writes accepted after the successor's first
    /// accepted write: what a fenced resource exists to refuse.
    fn stale_accepted(&self) -> usize {
        let Some(first) = self
            .accepted
            .iter()
            .position(|(_, w, _)| *w == Writer::Successor)
        else {
            return 0;
        };
        self.accepted[first..]
            .iter()
            .filter(|(_, w, _)| *w == Writer::Old)
            .count()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Old,
    Successor,
}

/// The same writes offered to two stores: one fenced by tokens from the
/// test's own counter (independent of the Redis that fails over), one by
/// the library's Redis `INCR` tokens.
#[derive(Debug, Default)]
struct Stores {
    independent: Fenced,
    redis: Fenced,
}

type Shared = Arc<Mutex<Stores>>;

fn write_both(stores: &Shared, writer: Writer, independent: u64, redis: u64) {
    let mut s = stores.lock().expect("stores");
    s.independent.write(writer, independent);
    s.redis.write(writer, redis);
}

/// Writes under `handle` until its guard fails; (writes, writes after the
/// deadline).
fn writer(
    handle: LeaseHandle,
    stores: Shared,
    who: Writer,
    independent: u64,
    until: Option<Instant>,
) -> JoinHandle<(usize, usize)> {
    let redis = handle.fencing_token().expect("the backend fences");
    tokio::spawn(async move {
        let (mut n, mut late) = (0, 0);
        while n < MAX_WRITES && until.is_none_or(|u| Instant::now() < u) {
            let deadline = handle.remaining_validity().map(|r| Instant::now() + r);
            if handle.assert_held().is_err() {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                late += 1;
            }
            write_both(&stores, who, independent, redis);
            n += 1;
            sleep(WRITE_EVERY).await;
        }
        (n, late)
    })
}

async fn plain(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("a plain connection")
}

async fn replica_via(ctx: &Ctx, proxy: SocketAddr, prefix: &str) -> Replica {
    let backend = config_for(&format!("redis://{proxy}"))
        .expect("config")
        .with_key_prefix(prefix)
        .connect()
        .await
        .expect("connects through the proxy");
    ctx.replica_over(Arc::new(backend))
}

/// What one failover measured.
#[derive(Debug)]
struct Trial {
    detection: Duration,
    abort: Duration,
    reason: LossReason,
    overlap: Option<Duration>,
    writes: usize,
    late: usize,
    stale_independent: usize,
    stale_redis: usize,
    redis_backwards: bool,
    leaked: usize,
}

async fn one_failover(ctx: &Ctx, target: Target, prefix: &str, i: usize) -> Trial {
    let (ttl, tol, opts) = case_timing(ctx);
    let interval = opts.renew_interval();
    let primary = server::start_plain().expect("the primary starts");
    // Full sync at once, not after the default 5 s wait for more replicas.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("repl-diskless-sync-delay")
        .arg("0")
        .query_async(&mut plain(primary.port()).await)
        .await
        .expect("CONFIG SET");
    let replica = server::start_replica_of(primary.port()).expect("the replica starts");
    server::replica_link_up(replica.port(), Duration::from_secs(10))
        .await
        .expect("replication links up");
    let proxy = FaultProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, primary.port())))
        .await
        .expect("proxy starts");
    let old = replica_via(ctx, proxy.addr(), prefix).await;
    let successor = replica_via(ctx, proxy.addr(), prefix).await;
    let name = ctx.name(&format!("failover-{i}"));
    let key = format!("{prefix}{}", name.as_str());

    // Warm up: the fencing counter exists and has reached the replica.
    let warm = ctx.name(&format!("failover-warm-{i}"));
    for rep in [&old, &successor] {
        let g = rep.locker.try_lock(&warm, &opts).await.expect("warm-up");
        g.release().await.expect("warm-up release");
    }
    let fence = format!("{prefix}#fence");
    let (mut p, mut q) = (plain(primary.port()).await, plain(replica.port()).await);
    let on_primary: Option<u64> = redis::cmd("GET")
        .arg(&fence)
        .query_async(&mut p)
        .await
        .expect("GET");
    for _ in 0..100 {
        let on_replica: Option<u64> = redis::cmd("GET")
            .arg(&fence)
            .query_async(&mut q)
            .await
            .expect("GET");
        if on_replica == on_primary {
            break;
        }
        sleep(Duration::from_millis(20)).await;
    }

    // Cut replication (d5): stop the replica and kill its link, so the
    // lock taken next never reaches it.
    replica.pause().expect("SIGSTOP the replica");
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut p)
        .await
        .expect("CLIENT KILL TYPE replica");
    let stores: Shared = Arc::default();
    let counter = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let next = || counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let guard = old
        .locker
        .try_lock(&name, &opts)
        .await
        .expect("the old holder acquires on the primary");
    let old_redis = guard.fencing_token().expect("fenced");
    let handle = guard.handle();
    let old_writer = writer(
        handle.clone(),
        Arc::clone(&stores),
        Writer::Old,
        next(),
        None,
    );
    let lost = {
        let h = handle.clone();
        tokio::spawn(async move {
            let reason = h.lost().await;
            (Instant::now(), reason)
        })
    };
    sleep(interval).await;
    assert!(handle.is_held(), "healthy before the failover");

    // The failover: the primary dies, the replica is promoted, the virtual
    // IP moves.
    let killed_at = Instant::now();
    primary.kill().expect("SIGKILL the primary");
    replica.resume().expect("SIGCONT the replica");
    let () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut q)
        .await
        .expect("REPLICAOF NO ONE");
    proxy.set_upstream(SocketAddr::from((Ipv4Addr::LOCALHOST, replica.port())));
    proxy.reset_all();
    let switched_at = Instant::now();
    let gone: i64 = key_int(&mut q, "EXISTS", &key).await;
    assert_eq!(
        gone, 0,
        "the promoted replica has the key: nothing was lost"
    );

    // The successor takes the lock on the new primary at once.
    let mut succ = None;
    for _ in 0..SUCCESSOR_ATTEMPTS {
        match successor.locker.try_lock(&name, &opts).await {
            Ok(g) => {
                succ = Some(g);
                break;
            }
            Err(Error::HeldElsewhere { .. } | Error::Unavailable { .. }) => {
                assert!(
                    switched_at.elapsed() < ttl * 3,
                    "the successor never acquired"
                );
                sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("the successor's acquire failed with {e}"),
        }
    }
    let succ = succ.expect("the successor acquires on the promoted replica");
    let acquired_at = Instant::now();
    let succ_redis = succ.fencing_token().expect("fenced");
    let succ_writer = writer(
        succ.handle(),
        Arc::clone(&stores),
        Writer::Successor,
        next(),
        Some(acquired_at + interval * 2),
    );

    let bound = interval + target.op_timeout + tol;
    let (lost_at, reason) = tokio::time::timeout_at(switched_at + bound, lost)
        .await
        .expect("the old holder detects the loss within renew interval + op timeout")
        .expect("loss watcher");
    let (writes, late) = tokio::time::timeout(ttl, old_writer)
        .await
        .expect("the old writer stops")
        .expect("writer task");
    let _ = tokio::time::timeout(ttl * 2, succ_writer)
        .await
        .expect("the successor's writer stops")
        .expect("writer task");
    assert!(
        guard.release().await.is_err(),
        "the old holder released a lock it had lost"
    );
    succ.handle()
        .verify()
        .await
        .expect("the successor still holds");
    succ.release().await.expect("the successor releases");
    let leaked: i64 = key_int(&mut q, "EXISTS", &key).await;
    let s = stores.lock().expect("stores");
    Trial {
        detection: lost_at.saturating_duration_since(switched_at),
        abort: lost_at - killed_at,
        reason,
        overlap: (lost_at > acquired_at).then(|| lost_at - acquired_at),
        writes,
        late,
        stale_independent: s.independent.stale_accepted(),
        stale_redis: s.redis.stale_accepted(),
        redis_backwards: succ_redis <= old_redis,
        leaked: usize::try_from(leaked).unwrap_or(1),
    }
}

/// X6 against private primary/replica pairs (one per iteration); the
/// replicas use key `prefix`.
pub(super) async fn failover(ctx: Ctx, target: Target, prefix: String) {
    let mut row = Row::of(&ctx, "chaos_failover");
    let (mut overlaps, mut reasons, mut stale_redis, mut backwards) =
        (Vec::new(), Vec::new(), 0, 0);
    for i in 0..target.iterations {
        let t = one_failover(&ctx, target, &prefix, i).await;
        row.count_fault(t.writes, t.late, t.stale_independent, t.leaked);
        row.detection.push(t.detection);
        row.abort.push(t.abort);
        if let Some(o) = t.overlap {
            row.overlaps += 1;
            overlaps.push(o);
        }
        reasons.push(t.reason);
        stale_redis += t.stale_redis;
        backwards += usize::from(t.redis_backwards);
    }
    row.iterations = target.iterations;
    let summary = format!(
        "{row:?}; loss reasons {reasons:?}; overlap windows (successor acquired -> old holder aborted) {overlaps:?}; \
         with the library's Redis INCR fence instead: the token went backwards (or repeated) in {backwards} of {} failovers and {stale_redis} stale writes were accepted",
        target.iterations
    );
    figures::record_safe("chaos_failover", row, &summary);
}
