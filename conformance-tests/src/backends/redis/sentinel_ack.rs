//! `redis_sentinel::replica_ack`: acquires and renewals that wait for
//! replica acknowledgement, on a private Sentinel deployment (a primary and
//! two replicas) and on a lone server; and `redis_sentinel::replica_ack_cost`
//! (ignored), which prints what the acknowledgement costs.

use std::sync::Arc;
use std::time::Duration;

use lock_core::backend::AcquireAttempt;
use lock_core::{BackendErrorKind, LockBackend, LockName, OwnerToken};
use lock_redis::{RedisBackend, ReplicaAck};
use tokio::time::{timeout, Instant};

use super::sentinel::SentinelSet;
use super::{config_for, server};
use crate::BoxError;

/// Key prefix of these cases (their servers are their own).
const PREFIX: &str = "ack:";
/// Lease TTL.
const TTL: Duration = Duration::from_secs(5);
/// Acknowledgement timeout where the replicas are expected to answer: far
/// above a loopback round trip, so a loaded machine does not refuse.
const ACK_WAIT: Duration = Duration::from_secs(2);
/// Acknowledgement timeout where too few replicas exist: the refusal waits
/// all of it.
const SHORT_ACK_WAIT: Duration = Duration::from_millis(400);
/// Slack on top of an acknowledgement timeout for a refused call: the
/// script, the WAIT's own rounding, the owner-checked release, and a loaded
/// 2-core machine.
const SLACK: Duration = Duration::from_secs(2);
/// Bound on one call that should succeed.
const WITHIN: Duration = Duration::from_secs(10);
/// Rounds of acquire, renew and release acknowledged by both replicas.
const ROUNDS: usize = 5;

async fn backend(url: &str, ack: Option<(u8, Duration)>) -> Result<RedisBackend, BoxError> {
    let mut config = config_for(url)?.with_key_prefix(PREFIX);
    if let Some((n, t)) = ack {
        config = config.with_replica_ack(n, t);
    }
    Ok(timeout(WITHIN, config.connect()).await??)
}

async fn get(port: u16, key: &str) -> Result<Option<String>, BoxError> {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_multiplexed_async_connection()
        .await?;
    Ok(redis::cmd("GET").arg(key).query_async(&mut c).await?)
}

/// Acquires `name` as `owner`, expecting a grant; returns the token.
async fn granted(b: &RedisBackend, name: &LockName, owner: &OwnerToken) -> Result<u64, BoxError> {
    match timeout(WITHIN, b.try_acquire(name, owner, TTL)).await?? {
        AcquireAttempt::Acquired(lease) => Ok(lease.fencing_token.ok_or("no fencing token")?),
        other => Err(format!("expected a grant of a free name, got {other:?}").into()),
    }
}

/// Runs `call`, expecting an `Unavailable` error naming `needle` within
/// `bound`; returns how long it took.
async fn refused<T: std::fmt::Debug>(
    what: &str,
    bound: Duration,
    needle: &str,
    call: impl std::future::Future<Output = Result<T, lock_core::BackendError>>,
) -> Result<Duration, BoxError> {
    let started = Instant::now();
    let answer = timeout(bound, call)
        .await
        .map_err(|_| format!("{what}: no answer within {bound:?}"))?;
    let took = started.elapsed();
    match answer {
        Err(e) if e.kind() == BackendErrorKind::Unavailable && e.message().contains(needle) => {
            Ok(took)
        }
        Err(e) => Err(format!(
            "{what}: refused as {:?} ({e}), expected Unavailable with {needle:?}",
            e.kind()
        )
        .into()),
        Ok(v) => Err(format!("{what}: succeeded ({v:?}) without the acknowledgements").into()),
    }
}

/// See the module docs. Starts its own deployment and lone server, all
/// killed on return.
pub async fn replica_ack() -> Result<(), BoxError> {
    let set = Arc::new(tokio::task::spawn_blocking(SentinelSet::start).await??);
    let result = on_deployment(&set).await;
    tokio::task::block_in_place(move || drop(set));
    result?;
    lone_server().await
}

async fn on_deployment(set: &SentinelSet) -> Result<(), BoxError> {
    let primary = set.primary_port()?;
    let replicas: Vec<u16> = set
        .server_ports()
        .into_iter()
        .filter(|p| *p != primary)
        .collect();
    // Through the URL parameters, as an operator would configure it.
    let both = backend(
        &format!("{}?replica_ack=2&replica_ack_timeout=2s", set.url()),
        None,
    )
    .await?;
    if both.replica_ack() != Some(ReplicaAck::new(2, ACK_WAIT)?) || !both.tokens_survive_failover(2)
    {
        return Err(format!("the URL's acknowledgement was not taken: {both:?}").into());
    }
    let name = LockName::new("sentinel/ack")?;
    let key = both.key_for(&name);
    let mut last = 0;
    for round in 0..ROUNDS {
        let owner = OwnerToken::generate()?;
        let token = granted(&both, &name, &owner).await?;
        if token <= last {
            return Err(format!("round {round}: token {token} after {last}").into());
        }
        last = token;
        // Acknowledged means both replicas already hold the key.
        for r in &replicas {
            if get(*r, &key).await?.as_deref() != Some(owner.to_hex().as_str()) {
                return Err(
                    format!("round {round}: replica {r} lacks the acknowledged lock").into(),
                );
            }
        }
        let renewed = timeout(WITHIN, both.renew(&name, &owner, TTL)).await??;
        if renewed != lock_core::backend::LeaseStatus::Held {
            return Err(
                format!("round {round}: an acknowledged renewal answered {renewed:?}").into(),
            );
        }
        timeout(WITHIN, both.release(&name, &owner)).await??;
    }

    // Three replicas asked of two: refused within the timeout plus slack,
    // and the name is left free at once.
    let three = backend(&set.url(), Some((3, SHORT_ACK_WAIT))).await?;
    let took = refused(
        "an acquire asking for 3 replicas",
        SHORT_ACK_WAIT + SLACK,
        "2 of the 3 replicas",
        three.try_acquire(&name, &OwnerToken::generate()?, TTL),
    )
    .await?;
    if took < SHORT_ACK_WAIT {
        return Err(format!("refused after {took:?}, before the {SHORT_ACK_WAIT:?} WAIT").into());
    }
    let owner = OwnerToken::generate()?;
    let token = granted(&both, &name, &owner).await?;
    if token <= last {
        return Err(
            format!("the grant after a refusal has token {token}, not above {last}").into(),
        );
    }
    // A renewal asking for three is refused too (the owner check passes:
    // the token is the holder's).
    refused(
        "a renewal asking for 3 replicas",
        SHORT_ACK_WAIT + SLACK,
        "2 of the 3 replicas",
        three.renew(&name, &owner, TTL),
    )
    .await?;
    timeout(WITHIN, both.release(&name, &owner)).await??;
    Ok(())
}

/// A server with no replica: every acquire asking for one is refused and
/// leaves the name free.
async fn lone_server() -> Result<(), BoxError> {
    let lone = server::start_plain()?;
    let url = format!("redis://127.0.0.1:{}", lone.port());
    let acked = backend(&url, Some((1, SHORT_ACK_WAIT))).await?;
    let name = LockName::new("lone/ack")?;
    refused(
        "an acquire asking for 1 replica of a lone server",
        SHORT_ACK_WAIT + SLACK,
        "0 of the 1 replicas",
        acked.try_acquire(&name, &OwnerToken::generate()?, TTL),
    )
    .await?;
    if let Some(v) = get(lone.port(), &acked.key_for(&name)).await? {
        return Err(format!("the refused lock was left behind (holding {v})").into());
    }
    let plain = backend(&url, None).await?;
    let owner = OwnerToken::generate()?;
    granted(&plain, &name, &owner).await?;
    timeout(WITHIN, plain.release(&name, &owner)).await??;
    tokio::task::block_in_place(move || drop(lone));
    Ok(())
}

/// How long each cell of the cost table runs.
const CELL: Duration = Duration::from_secs(2);

/// Operation timeout of the cost table: the stalls of a loaded machine
/// should show in p99, not end the measurement.
const COST_OP_TIMEOUT: Duration = Duration::from_secs(5);

/// `redis_sentinel::replica_ack_cost`: acquire + release cycles on one
/// backend (as one process has), off and acknowledged by 1 and 2 replicas,
/// at concurrency 1 and 16; prints ops/s, p50, p99, refused acquires and
/// failed calls.
pub async fn replica_ack_cost() -> Result<(), BoxError> {
    let set = Arc::new(tokio::task::spawn_blocking(SentinelSet::start).await??);
    let result = cost_table(&set).await;
    tokio::task::block_in_place(move || drop(set));
    println!("{}", result?);
    Ok(())
}

async fn cost_table(set: &SentinelSet) -> Result<String, BoxError> {
    let wait = Duration::from_millis(200);
    let mut out = String::from(
        "| replica_ack | concurrency | ops/s | p50 ms | p99 ms | refused | failed |\n|---|---|---|---|---|---|---|\n",
    );
    for ack in [None, Some(1u8), Some(2)] {
        for concurrency in [1usize, 16] {
            let mut config = config_for(&set.url())?
                .with_key_prefix(PREFIX)
                .with_operation_timeout(COST_OP_TIMEOUT);
            if let Some(n) = ack {
                config = config.with_replica_ack(n, wait);
            }
            let b = Arc::new(timeout(WITHIN, config.connect()).await??);
            let until = Instant::now() + CELL;
            let mut tasks = Vec::new();
            for w in 0..concurrency {
                let b = Arc::clone(&b);
                let name = LockName::new(format!("cost/{}/{concurrency}/{w}", ack.unwrap_or(0)))?;
                tasks.push(tokio::spawn(async move {
                    let (mut lat, mut refusals, mut failed) = (Vec::new(), 0usize, 0usize);
                    while Instant::now() < until {
                        let owner = OwnerToken::generate()?;
                        let t0 = Instant::now();
                        match b.try_acquire(&name, &owner, TTL).await {
                            Ok(AcquireAttempt::Acquired(_)) => {
                                if b.release(&name, &owner).await.is_ok() {
                                    lat.push(t0.elapsed());
                                } else {
                                    failed += 1;
                                }
                            }
                            Err(e) if e.kind() == BackendErrorKind::Unavailable => refusals += 1,
                            _ => failed += 1,
                        }
                    }
                    Ok::<_, BoxError>((lat, refusals, failed))
                }));
            }
            let (mut lat, mut refusals, mut failed) = (Vec::new(), 0, 0);
            for t in tasks {
                let (l, r, f) = t.await??;
                lat.extend(l);
                refusals += r;
                failed += f;
            }
            lat.sort();
            let pct = |p: usize| {
                lat.get((lat.len() * p / 100).min(lat.len().saturating_sub(1)))
                    .map_or(0.0, |d| d.as_secs_f64() * 1e3)
            };
            let label = ack.map_or_else(|| "off".to_owned(), |n| format!("{n} ({wait:?})"));
            out.push_str(&format!(
                "| {label} | {concurrency} | {:.0} | {:.3} | {:.3} | {refusals} | {failed} |\n",
                lat.len() as f64 / CELL.as_secs_f64(),
                pct(50),
                pct(99)
            ));
        }
    }
    Ok(out)
}
