//! What the benchmark measures. Library and floor alternate in short rounds,
//! so both see the same machine load.

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::{BoxError, Ctx};
use lock_core::{LockGuard, LockName, LockOptions, Locker};
use tokio::time::Instant;

use crate::floors::Floor;
use crate::report::Row;
use crate::stats::{ms, Samples};
use crate::Mode;
use conformance_tests::faulty::{FaultyBackend, RenewCall};

const ROUNDS: u32 = 6;

/// Uncontended `try_lock` + `release` at `concurrency`, each task on its own
/// name, against the raw floor.
///
/// `against` names what `floor` is in the figures: `floor` for the raw
/// protocol, or a peer library's name.
pub(crate) async fn uncontended(
    ctx: &Ctx,
    floor: &Arc<dyn Floor>,
    against: &str,
    concurrency: usize,
    mode: Mode,
) -> Result<Row, BoxError> {
    let replica = ctx.replica().await;
    let opts = ctx.opts();
    let per_round = mode.duration() / ROUNDS;
    let (mut lib, mut raw) = (Samples::default(), Samples::default());
    for round in 0..ROUNDS {
        let mut tasks = Vec::new();
        let started = Instant::now();
        for t in 0..concurrency {
            let (locker, opts) = (replica.locker.clone(), opts.clone());
            let name = ctx.name(&format!("u{concurrency}-{round}-{t}"));
            tasks.push(tokio::spawn(async move {
                let mut s = Samples::default();
                let end = Instant::now() + per_round;
                while Instant::now() < end {
                    let t0 = Instant::now();
                    let g = locker.try_lock(&name, &opts).await?;
                    g.release().await?;
                    s.push(t0.elapsed());
                    // The memory backend never waits: without a yield, 16
                    // tasks on 2 workers would run one after another.
                    tokio::task::yield_now().await;
                }
                Ok::<_, BoxError>(s)
            }));
        }
        for t in tasks {
            lib.merge(t.await??);
        }
        lib.add_wall(started.elapsed());

        let mut tasks = Vec::new();
        let started = Instant::now();
        for t in 0..concurrency {
            let floor = Arc::clone(floor);
            let name = ctx.name(&format!("f{concurrency}-{round}-{t}"));
            tasks.push(tokio::spawn(async move {
                let mut s = Samples::default();
                let end = Instant::now() + per_round;
                while Instant::now() < end {
                    let t0 = Instant::now();
                    floor.cycle(t, &name).await?;
                    s.push(t0.elapsed());
                    // The memory backend never waits: without a yield, 16
                    // tasks on 2 workers would run one after another.
                    tokio::task::yield_now().await;
                }
                Ok::<_, BoxError>(s)
            }));
        }
        for t in tasks {
            raw.merge(t.await??);
        }
        raw.add_wall(started.elapsed());
    }
    let ratio = raw.ops_per_sec() / lib.ops_per_sec().max(f64::MIN_POSITIVE);
    Ok(Row::new(
        ctx.factory().name(),
        "acquire+release",
        format!("concurrency {concurrency}; {against}: {}", floor.describe()),
    )
    .figure("lib ops/s", format!("{:.0}", lib.ops_per_sec()))
    .figure("lib p50 ms", ms(lib.percentile(50.0)))
    .figure("lib p99 ms", ms(lib.percentile(99.0)))
    .figure(
        &format!("{against} ops/s"),
        format!("{:.0}", raw.ops_per_sec()),
    )
    .figure(&format!("{against} p50 ms"), ms(raw.percentile(50.0)))
    .figure(&format!("{against} p99 ms"), ms(raw.percentile(99.0)))
    .figure(&format!("lib/{against} time"), format!("{ratio:.2}")))
}

/// One `Locker` holding `leases` leases: the time and round trips of one
/// heartbeat sweep, next to one batched call and one call per lease; CPU
/// while holding; memory per lease.
pub(crate) async fn renewal_at_scale(
    ctx: &Ctx,
    leases: usize,
    mode: Mode,
) -> Result<Row, BoxError> {
    let backend = ctx.factory().replica().await?;
    let counting = FaultyBackend::new(Arc::clone(&backend), Duration::ZERO);
    let replica = ctx.replica_over(Arc::new(counting.clone()));
    // 9 s (3 s in short mode) within what the backend allows: Postgres'
    // test profile caps it at 2 s.
    let caps = backend.capabilities();
    let mut ttl = mode.renewal_ttl().max(caps.min_ttl);
    if let Some(max) = caps.max_ttl {
        ttl = ttl.min(max);
    }
    let interval = ttl / 3;
    // One metric label for every lease, as the scheduler labels a job's
    // per-tick locks by job name: otherwise each distinct name adds its own
    // Prometheus series (about 880 heap bytes, kept for the process's life)
    // and the figure would measure metric cardinality, not lease state.
    let opts = LockOptions::new(ttl).with_metric_label("bench-renewal");
    let names: Vec<LockName> = (0..leases)
        .map(|i| ctx.name(&format!("s{leases}-{i}")))
        .collect();
    let heap_before = crate::live_heap_bytes();
    let setup = Instant::now();
    let guards = acquire_all(&replica.locker, &names, &opts).await?;
    let setup = setup.elapsed();
    let heap_after = crate::live_heap_bytes();
    let acquired_at = Instant::now();
    let cpu_before = cpu_time();
    // Hold through at least three sweeps (every ttl / 3).
    tokio::time::sleep(mode.hold().max(ttl + interval / 2)).await;
    let cpu = cpu_time().saturating_sub(cpu_before);
    let held_for = acquired_at.elapsed();
    // Per sweep: the calls that started in whole intervals after the first
    // one (leases taken over a spread of time renew in several groups, so a
    // sweep is the work of one interval, not one burst), averaged.
    let from = acquired_at + interval;
    let whole = ((held_for - interval).as_secs_f64() / interval.as_secs_f64()).floor();
    if whole < 1.0 {
        return Err("held for less than two renewal intervals".into());
    }
    let until = from + interval.mul_f64(whole);
    let calls: Vec<RenewCall> = counting
        .renew_calls()
        .into_iter()
        .filter(|c| c.start >= from && c.start < until)
        .collect();
    if calls.is_empty() {
        return Err("no renewal happened".into());
    }
    let sweep_time = busy_time(&calls).div_f64(whole);
    let round_trips = calls.len() as f64 / whole;
    let renewed = calls.iter().map(|c| c.leases).sum::<usize>() as f64 / whole;

    // The library's leases go before the floors run, so that neither
    // competes with the other for the server. A lease lost while held (on a
    // machine too slow to renew this many in time) is a figure, not a
    // failed run: it is what the measurement found.
    let mut lost = 0usize;
    for g in guards {
        if g.release().await.is_err() {
            lost += 1;
        }
    }
    // Floors on the raw backend: one batched call over every lease, and one
    // call per lease. Their leases get the longest TTL the backend allows
    // (a renewal costs the same whatever it asks for), so that a slow setup
    // or per-key pass does not let the first ones expire.
    let floor_ttl = caps.max_ttl.unwrap_or(FLOOR_TTL).min(FLOOR_TTL).max(ttl);
    let (batched, per_key) = floors_for_renewal(ctx, &backend, leases, floor_ttl).await?;
    let mem_per_lease = (heap_after - heap_before) as f64 / leases as f64;
    Ok(Row::new(
        ctx.factory().name(),
        "renewal sweep",
        format!(
            "{leases} leases under one metric label, ttl {} ms (sweep every {} ms), acquired by {SETUP_TASKS} tasks in {} ms; per sweep: mean over {whole} intervals; per-key floor timed on {} leases, scaled",
            ttl.as_millis(),
            interval.as_millis(),
            setup.as_millis(),
            leases.min(PER_KEY_SAMPLE)
        ),
    )
    .figure("busy ms/sweep", ms(sweep_time))
    .figure("round trips", format!("{round_trips:.1}"))
    .figure("leases renewed", format!("{renewed:.0}"))
    .figure("batched floor ms", ms(batched))
    .figure("per-key floor ms", ms(per_key))
    .figure(
        "sweep/batched",
        format!(
            "{:.2}",
            sweep_time.as_secs_f64() / batched.as_secs_f64().max(1e-9)
        ),
    )
    .figure(
        "cpu % while holding",
        format!("{:.1}", 100.0 * cpu.as_secs_f64() / held_for.as_secs_f64()),
    )
    .figure("heap bytes/lease", format!("{mem_per_lease:.0}"))
    .figure("lost", lost.to_string()))
}

/// The per-key renewal floor is timed on this many leases and scaled (one
/// round trip per lease is linear; Postgres takes ~7 ms each).
const PER_KEY_SAMPLE: usize = 1000;

/// The TTL of the renewal floors' leases, unless the backend caps it lower.
const FLOOR_TTL: Duration = Duration::from_secs(60);

/// How many tasks take the leases of a renewal measurement (setup only).
const SETUP_TASKS: usize = 16;

/// Takes every name through `locker`, `SETUP_TASKS` at a time.
async fn acquire_all(
    locker: &Locker,
    names: &[LockName],
    opts: &LockOptions,
) -> Result<Vec<LockGuard>, BoxError> {
    let mut tasks = Vec::new();
    for part in names.chunks(names.len().div_ceil(SETUP_TASKS).max(1)) {
        let (locker, opts, part) = (locker.clone(), opts.clone(), part.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut guards = Vec::with_capacity(part.len());
            for n in &part {
                guards.push(locker.try_lock(n, &opts).await?);
            }
            Ok::<_, BoxError>(guards)
        }));
    }
    let mut guards = Vec::with_capacity(names.len());
    for t in tasks {
        guards.extend(t.await??);
    }
    Ok(guards)
}

/// The time during which at least one of `calls` was in flight.
fn busy_time(calls: &[RenewCall]) -> Duration {
    let mut spans: Vec<(Instant, Instant)> = calls.iter().map(|c| (c.start, c.end)).collect();
    spans.sort();
    let mut total = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (s, e) in spans {
        current = match current {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + current.map_or(Duration::ZERO, |(s, e)| e - s)
}

/// One batched renewal of `leases` fresh leases, and `leases` single renewals.
async fn floors_for_renewal(
    ctx: &Ctx,
    backend: &Arc<dyn lock_core::LockBackend>,
    leases: usize,
    ttl: Duration,
) -> Result<(Duration, Duration), BoxError> {
    let names: Vec<LockName> = (0..leases)
        .map(|i| ctx.name(&format!("floor{leases}-{i}")))
        .collect();
    let mut tasks = Vec::new();
    for part in names.chunks(leases.div_ceil(SETUP_TASKS).max(1)) {
        let (backend, part) = (Arc::clone(backend), part.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut requests = Vec::with_capacity(part.len());
            for name in part {
                let owner = lock_core::OwnerToken::generate()?;
                backend.try_acquire(&name, &owner, ttl).await?;
                requests.push(lock_core::backend::RenewRequest { name, owner, ttl });
            }
            Ok::<_, BoxError>(requests)
        }));
    }
    let mut requests = Vec::with_capacity(leases);
    for t in tasks {
        requests.extend(t.await??);
    }
    let t0 = Instant::now();
    for chunk in requests.chunks(1000) {
        backend.renew_many(chunk).await?;
    }
    let batched = t0.elapsed();
    let t0 = Instant::now();
    let sample = &requests[..leases.min(PER_KEY_SAMPLE)];
    for r in sample {
        backend.renew(&r.name, &r.owner, r.ttl).await?;
    }
    let per_key = t0
        .elapsed()
        .mul_f64(leases as f64 / sample.len().max(1) as f64);
    for r in &requests {
        backend.release(&r.name, &r.owner).await?;
    }
    Ok((batched, per_key))
}

/// Two replicas contend one name with waiting acquires: time from release
/// to the waiter holding the lock.
pub(crate) async fn handoff(ctx: &Ctx, mode: Mode) -> Result<Row, BoxError> {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let name = ctx.name("handoff");
    let opts = ctx.opts().with_acquire_timeout(Duration::from_secs(10));
    let mut samples = Samples::default();
    let end = Instant::now() + mode.duration();
    let mut holder = a.locker.lock(&name, &opts).await?;
    let mut b_waits = true;
    while Instant::now() < end {
        let waiter = if b_waits {
            b.locker.clone()
        } else {
            a.locker.clone()
        };
        let (n, o) = (name.clone(), opts.clone());
        let task = tokio::spawn(async move {
            let g = waiter.lock(&n, &o).await;
            (Instant::now(), g)
        });
        // Let the waiter start waiting before the release.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let released = Instant::now();
        holder.release().await?;
        let (acquired, g) = task.await?;
        holder = g?;
        samples.push(acquired - released);
        b_waits = !b_waits;
    }
    samples.add_wall(mode.duration());
    holder.release().await?;
    Ok(Row::new(
        ctx.factory().name(),
        "handoff",
        "2 waiters, blocking acquire",
    )
    .figure("samples", samples.count().to_string())
    .figure("p50 ms", ms(samples.percentile(50.0)))
    .figure("p99 ms", ms(samples.percentile(99.0))))
}

/// User + system CPU time of this process.
pub(crate) fn cpu_time() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the command name (which may contain spaces) start after ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of stat, i.e. 11 and 12 after ')'.
    let total = ticks(11) + ticks(12);
    Duration::from_millis(total * 10)
}

/// Time this process's threads spent runnable but not running (waiting for
/// a core), summed over its live threads: how much CPU the machine denied
/// it. Zero where `/proc` cannot say.
pub(crate) fn run_queue_wait() -> Duration {
    let Ok(threads) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let waited_ns: u64 = threads
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        // schedstat: time on a core, time waiting on a run queue (both ns),
        // timeslices.
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(waited_ns)
}
