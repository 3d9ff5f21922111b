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
/// [`run`]: what [`check_hammered`] checks.
pub(crate) async fn hammer(
    stores: Vec<Arc<dyn Store>>,
    side: impl std::future::Future<Output = ()>,
) -> Result<Hammered, BoxError> {
    let key = format!("rl-test:{}:{{one}}:s", run_id());
    let (outcomes, ()) = tokio::join!(decisions(stores, &key), side);
    hammered(&outcomes?)
}

/// 200 a second with a burst of a second's worth: a process stalled by a
/// loaded machine for under a second loses no admissions (the bucket refills
/// meanwhile and the backlog takes it).
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

/// What one over-admission run saw, on the store's clock (µs).
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    /// The time of each admission.
    pub(crate) admitted: Vec<u64>,
    /// The time of each refusal.
    pub(crate) refused: Vec<u64>,
}

/// An over-admission run's figures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hammered {
    /// Requests admitted.
    pub(crate) admitted: u64,
    /// burst + rate × (last admission − first), on the store's clock: the
    /// most GCRA may admit.
    pub(crate) bound: u64,
    /// Microseconds, on the store's clock, during which the key was
    /// saturated: the spans of the chains of refusals no more than a
    /// bucket's refill (less one interval) apart.
    pub(crate) saturated_us: u64,
    /// Chains of refusals (0: never saturated).
    pub(crate) chains: u64,
    /// burst × chains + rate × `saturated_us`: what a correct limiter
    /// admits at least (less up to two per chain), however starved the
    /// process was.
    pub(crate) expected: u64,
}

/// The figures of `outcomes`.
///
/// The lower line comes from GCRA itself, not from the run's length. A
/// refusal at `r` means the key's TAT was past `r + capacity − interval`.
/// The TAT only moves by one interval per admission, except when the bucket
/// is full (the TAT behind the clock) and it restarts from the clock, which
/// cannot happen within `capacity − interval` of a refusal. So, with
/// `interval` as the unit:
/// - between two refusals `f < l` of one chain (consecutive refusals at most
///   `capacity − interval` apart), at least `(l − f) − 1` admissions;
/// - before the first chain, and between two chains (more than
///   `capacity − interval` apart), at least `burst − 2`: the bucket refilled.
///
/// A process starved for longer than `capacity − interval` breaks a chain
/// and the starved time is not counted, so starvation cannot fail the
/// check; a shorter stall costs nothing (the backlog takes the refill). A
/// limiter that refuses what it should admit, or does not refill, still
/// fails it.
pub(crate) fn hammered(outcomes: &Outcomes) -> Result<Hammered, BoxError> {
    let cell = cell();
    let (admitted, bound) = bound(&outcomes.admitted)?;
    let mut refused = outcomes.refused.clone();
    refused.sort_unstable();
    let max_gap = cell.capacity - cell.interval;
    let (mut saturated_us, mut chains) = (0, 0);
    let mut chain: Option<(u64, u64)> = None;
    for &r in &refused {
        chain = match chain {
            Some((first, last)) if r - last <= max_gap => Some((first, r)),
            done => {
                if let Some((first, last)) = done {
                    saturated_us += last - first;
                }
                chains += 1;
                Some((r, r))
            }
        };
    }
    if let Some((first, last)) = chain {
        saturated_us += last - first;
    }
    Ok(Hammered {
        admitted,
        bound,
        saturated_us,
        chains,
        expected: cell.capacity / cell.interval * chains + saturated_us / cell.interval,
    })
}

/// Asserts admitted ≤ bound (exact), that the key was saturated at all, and
/// admitted ≥ 95 % of what GCRA admits at least while saturated
/// ([`hammered`]), printing the figures.
pub(crate) fn check_hammered(backend: &str, h: &Hammered) {
    eprintln!(
        "{backend}: admitted {}, bound {}, saturated {} ms in {} chain(s), expected ≥ {}",
        h.admitted,
        h.bound,
        h.saturated_us / 1000,
        h.chains,
        h.expected
    );
    assert!(
        h.admitted <= h.bound,
        "{backend} admitted {} > {}",
        h.admitted,
        h.bound
    );
    assert!(
        h.chains > 0,
        "{backend} never refused: the run never saturated the key"
    );
    assert!(
        h.admitted * 100 >= h.expected * 95,
        "{backend} admitted only {} while saturated for {} ms (expected ≥ {})",
        h.admitted,
        h.saturated_us / 1000,
        h.expected
    );
}

/// 16 tasks per store deciding on `key` for [`run`]; the store's clock at each
/// admission.
pub(crate) async fn admissions(
    stores: Vec<Arc<dyn Store>>,
    key: &str,
) -> Result<Vec<u64>, BoxError> {
    Ok(decisions(stores, key).await?.admitted)
}

/// 16 tasks per store deciding on `key` for [`run`]; the store's clock at each
/// admission and each refusal.
pub(crate) async fn decisions(
    stores: Vec<Arc<dyn Store>>,
    key: &str,
) -> Result<Outcomes, BoxError> {
    let cell = cell();
    let deadline = Instant::now() + run();
    let mut tasks = Vec::new();
    for store in &stores {
        for _ in 0..16 {
            let store = Arc::clone(store);
            let keys = [key.to_owned()];
            tasks.push(tokio::spawn(async move {
                let mut seen = Outcomes::default();
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
                        seen.admitted.push(d.now_us);
                    } else {
                        seen.refused.push(d.now_us);
                    }
                    // The memory store answers without ever yielding; let
                    // the other tasks (and the runtime) run.
                    tokio::task::yield_now().await;
                }
                Ok::<_, distlock_ratelimit::StoreError>(seen)
            }));
        }
    }
    let mut all = Outcomes::default();
    for r in futures_join(tasks).await {
        let seen = r??;
        all.admitted.extend(seen.admitted);
        all.refused.extend(seen.refused);
    }
    Ok(all)
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
