//! What the server cases share: the over-admission run.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

pub(crate) mod procs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock_ratelimit::store::{Store, StoreRequest};
use distlock_ratelimit::Quota;
use tokio::time::Instant;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The variable that sets how long each over-admission run lasts, in whole
/// seconds (default [`DEFAULT_RUN_SECS`]; 10 for the soak runs).
pub(crate) const SOAK_VAR: &str = "RATE_LIMIT_SOAK_SECS";

/// Each over-admission run's length unless `RATE_LIMIT_SOAK_SECS` says
/// otherwise: short, for CI.
pub(crate) const DEFAULT_RUN_SECS: u64 = 3;

/// How long each over-admission run lasts: `RATE_LIMIT_SOAK_SECS` (1 to
/// 600), else [`DEFAULT_RUN_SECS`]. A value out of range or not a number
/// fails the test rather than silently running the default.
pub(crate) fn run() -> Duration {
    match std::env::var(SOAK_VAR) {
        Err(_) => Duration::from_secs(DEFAULT_RUN_SECS),
        Ok(v) => {
            let secs: u64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s| (1..=600).contains(s))
                .unwrap_or_else(|| panic!("{SOAK_VAR}={v:?}: expected whole seconds, 1 to 600"));
            Duration::from_secs(secs)
        }
    }
}

/// A whole case's time limit: the run plus `setup` for starting servers and
/// connecting.
pub(crate) fn case_limit(setup: Duration) -> Duration {
    run() + setup
}

/// A key prefix unique to this run.
pub(crate) fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("t{}x{nanos}", std::process::id())
}

/// 3 stores (separate connections, as 3 replicas) × 16 tasks on one key for
/// [`run`]: admitted ≤ burst + rate × elapsed on the store's clock, and ≥ 95 %
/// of it. Returns (admitted, bound).
pub(crate) async fn hammer(
    stores: Vec<Arc<dyn Store>>,
    side: impl std::future::Future<Output = ()>,
) -> Result<(u64, u64), BoxError> {
    let key = format!("rl-test:{}:{{one}}:s", run_id());
    let (times, ()) = tokio::join!(admissions(stores, &key), side);
    bound(&times?)
}

/// 200 a second with a burst of a second's worth: a process stalled by a
/// loaded machine for under a second loses no admissions (the bucket refills
/// meanwhile and the backlog takes it), so the 95 % floor holds.
pub(crate) fn cell() -> distlock_ratelimit::gcra::Cell {
    Quota::per_second(200)
        .map(|q| q.cell())
        .unwrap_or(distlock_ratelimit::gcra::Cell {
            interval: 5_000,
            capacity: 1_000_000,
        })
}

/// (admitted, burst + rate × elapsed) for these admission times (store
/// clock, µs).
pub(crate) fn bound(times: &[u64]) -> Result<(u64, u64), BoxError> {
    let cell = cell();
    let first = times.iter().min().copied().ok_or("nothing admitted")?;
    let last = times.iter().max().copied().ok_or("nothing admitted")?;
    let admitted = u64::try_from(times.len())?;
    Ok((
        admitted,
        cell.capacity / cell.interval + (last - first) / cell.interval,
    ))
}

/// 16 tasks per store deciding on `key` for [`run`]; the store's clock at each
/// admission.
pub(crate) async fn admissions(
    stores: Vec<Arc<dyn Store>>,
    key: &str,
) -> Result<Vec<u64>, BoxError> {
    let cell = cell();
    let deadline = Instant::now() + run();
    let mut tasks = Vec::new();
    for store in &stores {
        for _ in 0..16 {
            let store = Arc::clone(store);
            let keys = [key.to_owned()];
            tasks.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                let mut calls = 0u32;
                while Instant::now() < deadline && calls < 1_000_000 {
                    calls += 1;
                    let request = StoreRequest {
                        subject: "one",
                        keys: &keys,
                        cells: &[cell],
                        cost: 1,
                    };
                    let d = store.decide(&request).await?;
                    if d.allowed {
                        admitted.push(d.now_us);
                    }
                    // The memory store answers without ever yielding; let
                    // the other tasks (and the runtime) run.
                    tokio::task::yield_now().await;
                }
                Ok::<_, distlock_ratelimit::StoreError>(admitted)
            }));
        }
    }
    let mut times = Vec::new();
    for r in futures_join(tasks).await {
        times.extend(r??);
    }
    Ok(times)
}

pub(crate) async fn futures_join<T>(
    tasks: Vec<tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await);
    }
    out
}

/// Asserts admitted ≤ bound and ≥ 95 % of it, printing both.
pub(crate) fn check_bound(backend: &str, admitted: u64, bound: u64) {
    eprintln!("{backend}: admitted {admitted}, bound {bound}");
    assert!(admitted <= bound, "{backend} admitted {admitted} > {bound}");
    assert!(
        admitted * 100 >= bound * 95,
        "{backend} admitted only {admitted} of {bound}"
    );
}

/// 16 tasks per store on `key` until `stop` (at most 120 s), each call
/// bounded by 1 s; errors (a failover) are counted (the first 3 printed),
/// not fatal. Returns the
/// store's clock at each admission.
pub(crate) async fn tolerant_admissions(
    stores: &[Arc<dyn Store>],
    key: &str,
    stop: &tokio::sync::watch::Receiver<bool>,
    errors: &Arc<AtomicU64>,
) -> Result<Vec<u64>, BoxError> {
    let cell = cell();
    let hard_end = Instant::now() + Duration::from_secs(120);
    let mut tasks = Vec::new();
    for store in stores {
        for _ in 0..16 {
            let store = Arc::clone(store);
            let keys = [key.to_owned()];
            let stop = stop.clone();
            let errors = Arc::clone(errors);
            tasks.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                while !*stop.borrow() && Instant::now() < hard_end {
                    let request = StoreRequest {
                        subject: "one",
                        keys: &keys,
                        cells: &[cell],
                        cost: 1,
                    };
                    match tokio::time::timeout(Duration::from_secs(1), store.decide(&request)).await
                    {
                        Ok(Ok(d)) if d.allowed => admitted.push(d.now_us),
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => {
                            if errors.fetch_add(1, Ordering::Relaxed) < 3 {
                                eprintln!("a call failed: {e}");
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Err(_) => {
                            if errors.fetch_add(1, Ordering::Relaxed) < 3 {
                                eprintln!("a call took over 1 s");
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    tokio::task::yield_now().await;
                }
                admitted
            }));
        }
    }
    let mut times = Vec::new();
    for r in futures_join(tasks).await {
        times.extend(r?);
    }
    Ok(times)
}
