//! Redis outages for real: a private redis-server (from PATH, on a free
//! loopback port) SIGSTOPped and later SIGCONTed, and one SIGKILLed and
//! restarted on the same port, while three limiter instances per policy
//! (separate connections, as three replicas) keep deciding. Deny gives
//! refusals only; fallback admits at most each instance's share of the limit
//! and counts every fallback decision; no call waits much past the store
//! timeout; every breaker closes once the server answers. Skipped with a
//! printed reason without redis-server, except under CI=true.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_ratelimit::store::{RedisStore, Store};
use distlock_ratelimit::{
    BreakerConfig, Error, Limit, Limiter, OnStoreError, Quota, RateLimitMetrics, Source,
};
use prometheus::Registry;
use tokio::time::Instant;

mod common;
use common::procs::{self, Dir, Server};
use common::BoxError;

type TestResult = Result<(), BoxError>;

/// Limiter instances per policy, each with its own connection.
const INSTANCES: usize = 3;
/// Tasks deciding through each instance.
const TASKS: usize = 4;
/// The limiters' store timeout (the crate's default).
const STORE_TIMEOUT: Duration = Duration::from_millis(50);
/// What a call may take beyond the store timeout: scheduling delay on a
/// loaded 2-core machine running the 24 deciding tasks, the server and
/// other builds.
const MARGIN: Duration = Duration::from_millis(250);
/// How long the server stays stopped or dead.
const OUTAGE: Duration = Duration::from_secs(2);
/// The fallback limit: 90 per 10 s, so each of the 3 instances may admit a
/// burst of 30 and 3 a second from its own memory.
const FALLBACK_COUNT: u64 = 90;
const FALLBACK_PERIOD: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Store,
    Fallback(bool),
    Refused,
}

#[derive(Debug, Clone, Copy)]
struct Call {
    instance: usize,
    started: Instant,
    took: Duration,
    outcome: Outcome,
}

struct Instance {
    name: String,
    limiter: Limiter,
    metrics: RateLimitMetrics,
}

fn instances(url: &str, tag: &str, policy: OnStoreError) -> Result<Vec<Instance>, BoxError> {
    let prefix = format!("rl-test:{}", common::run_id());
    let mut out = Vec::new();
    for i in 0..INSTANCES {
        let name = format!("{tag}-{i}");
        let store: Arc<dyn Store> = Arc::new(RedisStore::connect(url)?);
        let metrics = RateLimitMetrics::register(&Registry::new())?;
        let quota = Quota::new(FALLBACK_COUNT, FALLBACK_PERIOD)?;
        let limiter = Limiter::builder(&name)
            .with_limit(Limit::new("s", quota)?)
            .with_key_prefix(prefix.clone())
            .with_store(store)
            .with_on_store_error(policy)
            .with_store_timeout(STORE_TIMEOUT)
            .with_breaker(BreakerConfig {
                failures: 3,
                open_for: Duration::from_millis(200),
            })
            .with_metrics(metrics.clone())
            .build()?;
        out.push(Instance {
            name,
            limiter,
            metrics,
        });
    }
    Ok(out)
}

/// Until every instance has had a decision from the store (at most 10 s):
/// the connections are made before the load starts.
async fn warm_up(instances: &[Instance]) -> TestResult {
    for i in instances {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if matches!(i.limiter.check("warm-up").await, Ok(d) if d.source == Source::Store) {
                break;
            }
            if Instant::now() >= until {
                return Err(format!("{} never reached the server", i.name).into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

type Log = Arc<Mutex<Vec<Call>>>;

/// `TASKS` tasks per instance deciding on one key, every 2 ms, until `stop`
/// turns true (or 200 000 calls each); every call goes into `log`.
fn drive(
    instances: &Arc<Vec<Instance>>,
    log: &Log,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<Result<(), String>>> {
    let mut tasks = Vec::new();
    for instance in 0..instances.len() {
        for _ in 0..TASKS {
            let instances = Arc::clone(instances);
            let log = Arc::clone(log);
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let limiter = &instances[instance].limiter;
                for _ in 0..200_000 {
                    if *stop.borrow() {
                        break;
                    }
                    let started = Instant::now();
                    let r = limiter.check("k").await;
                    let took = started.elapsed();
                    let outcome = match r {
                        Ok(d) if d.source == Source::Store => Outcome::Store,
                        Ok(d) if d.source == Source::Fallback => Outcome::Fallback(d.allowed),
                        Ok(d) => return Err(format!("a decision from {:?}", d.source)),
                        Err(Error::StoreUnavailable { .. }) => Outcome::Refused,
                        Err(e) => return Err(format!("unexpected error: {e}")),
                    };
                    log.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Call {
                            instance,
                            started,
                            took,
                            outcome,
                        });
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Ok(())
            }));
        }
    }
    tasks
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGSTOP, then SIGCONT.
    Pause,
    /// SIGKILL, then a new process on the same port.
    Kill,
}

/// The first instant, per instance, at which a call started at or after
/// `since` was decided by the store; `None` for an instance without one.
fn first_store_after(log: &Log, since: Instant, n: usize) -> Vec<Option<Instant>> {
    let calls = log.lock().unwrap_or_else(PoisonError::into_inner);
    (0..n)
        .map(|i| {
            calls
                .iter()
                .filter(|c| c.instance == i && c.started >= since && c.outcome == Outcome::Store)
                .map(|c| c.started + c.took)
                .min()
        })
        .collect()
}

async fn outage(fault: Fault) -> TestResult {
    let dir = Dir::new("outage")?;
    let port = procs::free_port()?;
    let path = dir.0.clone();
    let server = tokio::task::spawn_blocking(move || Server::start(&path, port, &[])).await??;
    let url = server.url();
    let replicas = NonZeroU32::new(3).ok_or("3")?;
    let deny = Arc::new(instances(&url, "deny", OnStoreError::Deny)?);
    let fallback = Arc::new(instances(
        &url,
        "fallback",
        OnStoreError::Fallback { replicas },
    )?);
    warm_up(&deny).await?;
    warm_up(&fallback).await?;

    let deny_log: Log = Arc::default();
    let fallback_log: Log = Arc::default();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let mut tasks = drive(&deny, &deny_log, &stop);
    tasks.extend(drive(&fallback, &fallback_log, &stop));

    tokio::time::sleep(Duration::from_millis(500)).await;
    let (server, down_at) = tokio::task::spawn_blocking(move || {
        let mut server = server;
        match fault {
            Fault::Pause => server.pause()?,
            Fault::Kill => server.kill()?,
        }
        Ok::<_, BoxError>((server, Instant::now()))
    })
    .await??;
    tokio::time::sleep(OUTAGE).await;
    let (server, up_at) = tokio::task::spawn_blocking(move || {
        let mut server = server;
        match fault {
            Fault::Pause => server.resume()?,
            // Waits for PING: the server answers from here on.
            Fault::Kill => server.restart()?,
        }
        Ok::<_, BoxError>((server, Instant::now()))
    })
    .await??;

    // Every instance decides on the server again: its breaker closed.
    let until = Instant::now() + Duration::from_secs(10);
    let closed = loop {
        let d = first_store_after(&deny_log, up_at, INSTANCES);
        let f = first_store_after(&fallback_log, up_at, INSTANCES);
        if d.iter().chain(&f).all(Option::is_some) {
            break d.into_iter().chain(f).flatten().collect::<Vec<_>>();
        }
        if Instant::now() >= until {
            return Err(format!(
                "{fault:?}: not every instance decided on the server within 10 s of its return (deny {d:?}, fallback {f:?})"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_tx.send_replace(true);
    for t in tasks {
        t.await??;
    }
    drop(server);

    let closed_after = closed
        .iter()
        .map(|t| t.saturating_duration_since(up_at))
        .max()
        .unwrap_or_default();
    let deny_calls = deny_log
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let fallback_calls = fallback_log
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let during = |c: &&Call| c.started >= down_at && c.started + c.took <= up_at;
    let all = || deny_calls.iter().chain(&fallback_calls);
    let worst = all().map(|c| c.took).max().unwrap_or_default();
    let worst_down = all()
        .filter(during)
        .map(|c| c.took)
        .max()
        .unwrap_or_default();

    // Deny: only refusals while the server is down, each counted.
    let refusals = deny_calls.iter().filter(during).count();
    let admitted_down = deny_calls
        .iter()
        .filter(during)
        .filter(|c| c.outcome != Outcome::Refused)
        .count();
    eprintln!(
        "{fault:?} for {:?}: deny {refusals} calls while down, {admitted_down} not refused; worst latency {worst_down:?} while down, {worst:?} overall; every breaker closed within {closed_after:?} of the server's return",
        up_at - down_at
    );
    assert!(refusals > 0, "calls were made while the server was down");
    assert_eq!(admitted_down, 0, "deny gives only refusals while down");
    for (n, i) in deny.iter().enumerate() {
        let ours = deny_calls
            .iter()
            .filter(|c| c.instance == n && c.outcome == Outcome::Refused)
            .count();
        let ours = u64::try_from(ours)?;
        assert_eq!(
            i.metrics.decisions(&i.name, "unavailable", Source::None),
            ours
        );
        assert!(
            !i.metrics.breaker_open(&i.name),
            "{} breaker closed",
            i.name
        );
    }

    // Fallback: each instance admits at most its third of the limit, on its
    // own, and counts every fallback decision.
    assert!(
        fallback_calls
            .iter()
            .filter(during)
            .all(|c| matches!(c.outcome, Outcome::Fallback(_))),
        "fallback decides from memory while down"
    );
    let burst = FALLBACK_COUNT / 3;
    for (n, i) in fallback.iter().enumerate() {
        let mine: Vec<&Call> = fallback_calls
            .iter()
            .filter(|c| c.instance == n && matches!(c.outcome, Outcome::Fallback(_)))
            .collect();
        let admitted = u64::try_from(
            mine.iter()
                .filter(|c| c.outcome == Outcome::Fallback(true))
                .count(),
        )?;
        let first = mine
            .iter()
            .map(|c| c.started)
            .min()
            .ok_or("no fallback decision")?;
        let last = mine
            .iter()
            .map(|c| c.started + c.took)
            .max()
            .ok_or("no fallback decision")?;
        // The share refills at 3 a second over the span of its decisions.
        let span = last - first;
        let share = burst + (span.as_millis() as u64) * FALLBACK_COUNT / 3 / 10_000 + 1;
        let decisions = u64::try_from(mine.len())?;
        eprintln!(
            "{fault:?}: {} admitted {admitted} from its share (at most {share}: {burst} + 3/s over {span:?}), {decisions} fallback decisions, counter {}",
            i.name,
            i.metrics.fallbacks(&i.name)
        );
        assert!(
            admitted <= share,
            "{} admitted {admitted} > {share}",
            i.name
        );
        assert!(admitted >= burst, "{} admitted its burst share", i.name);
        assert_eq!(i.metrics.fallbacks(&i.name), decisions);
        assert_eq!(
            i.metrics.decisions(&i.name, "allowed", Source::Fallback)
                + i.metrics.decisions(&i.name, "limited", Source::Fallback),
            decisions
        );
        assert!(
            !i.metrics.breaker_open(&i.name),
            "{} breaker closed",
            i.name
        );
    }
    assert!(
        worst <= STORE_TIMEOUT + MARGIN,
        "a call took {worst:?}, over {STORE_TIMEOUT:?} + {MARGIN:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigstopped_refuses_or_falls_back_within_the_timeout_then_recovers() -> TestResult {
    if !procs::redis_on_path() {
        return Ok(());
    }
    tokio::time::timeout(Duration::from_secs(40), outage(Fault::Pause)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkilled_and_restarted_refuses_or_falls_back_then_recovers() -> TestResult {
    if !procs::redis_on_path() {
        return Ok(());
    }
    tokio::time::timeout(Duration::from_secs(40), outage(Fault::Kill)).await?
}
