//! Benchmarks the library against each backend's raw protocol floor,
//! measured in the same run, and prints one table (also written as JSON to
//! `target/bench.json`).
//!
//! `cargo run --release -p conformance-tests --bin bench` (add `-- --short`
//! for a seconds-long smoke run, `-- --only memory` for one backend,
//! `-- --acquire-only` for the acquire+release rows alone, `-- --sched-only`
//! for the scheduler-at-scale rows alone (with `--only memory` for one
//! backend's, `--sched-mode per-tick` or `leader` for one mode's,
//! `--sched-seconds 300` for a longer window than the full run's 60 s), `-- --sweep-only` for the renewal-sweep rows alone, `-- --pg-sessions 1,2,4,8,16` for the lock session counts of
//! the Postgres 10,000-lease rows, `-- --only postgres-sessions` for the
//! Postgres-only rows alone).
//! Backends whose server cannot be had are listed as SKIPPED; one whose
//! measurement fails is listed as FAILED and makes the exit status non-zero.
//! Servers come from the same places as in the conformance suite.

mod failover;
mod floors;
mod measures;
mod pg;
mod report;
mod sched;
mod sched_tally;
mod server_work;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::backends::memory::MemoryFactory;
use conformance_tests::backends::{etcd, postgres, redis};
use conformance_tests::harness::Availability;
use conformance_tests::{BackendFactory, BoxError, Ctx};

use floors::FloorSource;
use report::Row;

/// Counts live heap bytes, for the memory-per-lease figure (RSS is too coarse:
/// the allocator reuses memory freed by earlier measurements).
#[global_allocator]
static ALLOC: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Heap bytes currently allocated by this process.
pub(crate) fn live_heap_bytes() -> i64 {
    let s = ALLOC.stats();
    i64::try_from(s.bytes_allocated).unwrap_or(i64::MAX)
        - i64::try_from(s.bytes_deallocated).unwrap_or(i64::MAX)
}

/// How long each measurement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Seconds in total: proves the benchmark still runs.
    Short,
    /// The figures worth reporting.
    Full,
}

impl Mode {
    fn duration(self) -> Duration {
        match self {
            Self::Short => Duration::from_millis(300),
            Self::Full => Duration::from_secs(6),
        }
    }

    fn hold(self) -> Duration {
        match self {
            Self::Short => Duration::from_secs(3),
            Self::Full => Duration::from_secs(30),
        }
    }

    /// The TTL of the renewal measurement (clamped to what the backend allows).
    fn renewal_ttl(self) -> Duration {
        match self {
            Self::Short => Duration::from_secs(3),
            Self::Full => Duration::from_secs(9),
        }
    }

    fn scales(self) -> &'static [usize] {
        match self {
            Self::Short => &[1_000],
            Self::Full => &[1_000, 10_000],
        }
    }
}

/// A backend to measure, or why it cannot be.
type Target = (
    &'static str,
    Availability<(Arc<dyn BackendFactory>, FloorSource)>,
);

/// Every backend, with its server found the way the conformance suite finds
/// it (an URL in the environment, else a private server). Starts private
/// servers, so call it outside the runtime.
fn targets(run_id: &str, only: Option<&str>) -> Vec<Target> {
    let wanted = |name: &str| only.is_none_or(|o| name.starts_with(o));
    let mut out: Vec<Target> = Vec::new();
    if wanted("memory") {
        let memory: Arc<dyn BackendFactory> = Arc::new(MemoryFactory::new());
        out.push(("memory", Availability::Ready((memory, FloorSource::Trait))));
    }
    if wanted("redis") {
        let found = match redis::factory(&format!("lock-bench:{run_id}:")) {
            Availability::Ready(f) => {
                let source = FloorSource::Redis {
                    url: f.url().to_owned(),
                    prefix: f.prefix().to_owned(),
                    unfenced: Arc::new(f.without_fencing()),
                };
                Availability::Ready((f as Arc<dyn BackendFactory>, source))
            }
            Availability::Missing(why) => Availability::Missing(why),
        };
        out.push(("redis", found));
    }
    if wanted("postgres") {
        let found = match postgres::factory(run_id) {
            Availability::Ready(f) => match f.url() {
                Ok(url) => Availability::Ready((
                    f as Arc<dyn BackendFactory>,
                    FloorSource::Postgres { url },
                )),
                Err(why) => Availability::Missing(why.to_string()),
            },
            Availability::Missing(why) => Availability::Missing(why),
        };
        out.push(("postgres", found));
    }
    if wanted("etcd") {
        let found = match etcd::find() {
            Availability::Ready(f) => match f.endpoints() {
                Ok(endpoints) => Availability::Ready((
                    f as Arc<dyn BackendFactory>,
                    FloorSource::Etcd { endpoints },
                )),
                Err(why) => Availability::Missing(why.to_string()),
            },
            Availability::Missing(why) => Availability::Missing(why),
        };
        out.push(("etcd", found));
    }
    out
}

/// Which rows to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    AcquireOnly,
    SchedOnly,
    SweepOnly,
}

/// The scheduler-at-scale rows, per tick and leader. A measurement that
/// errors becomes a FAILED row of its own, so the other rows still show.
async fn sched_rows(ctx: &Ctx, source: &FloorSource, mode: Mode, shape: sched::Shape) -> Vec<Row> {
    let mut rows = Vec::new();
    for leader in shape.modes() {
        let kind = if leader { "leader" } else { "per-tick" };
        let row = match tokio::time::timeout(
            shape.time_bound(),
            sched::at_scale(ctx, source, leader, mode, shape),
        )
        .await
        .unwrap_or_else(|_| Err("did not finish in time".into()))
        {
            Ok(row) => row,
            Err(e) => Row::new(
                ctx.factory().name(),
                "FAILED",
                format!("scheduler {kind}: {e}"),
            ),
        };
        eprintln!("  {}: {} ({})", row.backend, row.measure, row.setting);
        rows.push(row);
    }
    rows
}

/// The renewal-sweep rows, one per scale the mode measures.
async fn sweep_rows(
    ctx: &Ctx,
    source: &FloorSource,
    mode: Mode,
    done: impl Fn(Row) -> Row,
) -> Result<Vec<Row>, BoxError> {
    let mut rows = Vec::new();
    for &leases in mode.scales() {
        let leases = source
            .max_leases()
            .await?
            .map_or(leases, |max| leases.min(max));
        rows.push(done(measures::renewal_at_scale(ctx, leases, mode).await?));
    }
    Ok(rows)
}

async fn bench_backend(
    factory: Arc<dyn BackendFactory>,
    source: FloorSource,
    mode: Mode,
    only: Rows,
    shape: sched::Shape,
    run_id: &str,
) -> Result<Vec<Row>, BoxError> {
    let ctx = Ctx::new(Arc::clone(&factory), run_id, "bench");
    if only == Rows::SchedOnly {
        return Ok(sched_rows(&ctx, &source, mode, shape).await);
    }
    let mut rows = Vec::new();
    let done = |row: Row| {
        eprintln!("  {}: {} ({})", row.backend, row.measure, row.setting);
        row
    };
    if only == Rows::SweepOnly {
        rows.extend(sweep_rows(&ctx, &source, mode, done).await?);
        return Ok(rows);
    }
    let floor = floors::floor_for(&factory, &source).await?;
    eprintln!("{}: floor = {}", factory.name(), floor.describe());
    for concurrency in [1, 16] {
        rows.push(done(
            measures::uncontended(&ctx, &floor, "floor", concurrency, mode).await?,
        ));
    }
    if let FloorSource::Redis { unfenced, .. } = &source {
        // Like for like with rslock, which draws no fencing token; the
        // fenced rows above pay for the counter.
        let unfenced = Ctx::new(
            Arc::clone(unfenced) as Arc<dyn BackendFactory>,
            run_id,
            "bench",
        );
        for concurrency in [1, 16] {
            rows.push(done(
                measures::uncontended(&unfenced, &floor, "floor", concurrency, mode).await?,
            ));
        }
        if let Some(peer) = floors::peer_for(&factory, &source) {
            for concurrency in [1, 16] {
                rows.push(done(
                    measures::uncontended(&unfenced, &peer, "rslock", concurrency, mode).await?,
                ));
            }
        }
    }
    if let Some((against, second)) = floors::second_floor(&source).await? {
        for concurrency in [1, 16] {
            rows.push(done(
                measures::uncontended(&ctx, &second, against, concurrency, mode).await?,
            ));
        }
    }
    if only == Rows::AcquireOnly {
        return Ok(rows);
    }
    rows.extend(sweep_rows(&ctx, &source, mode, done).await?);
    rows.push(done(measures::handoff(&ctx, mode).await?));
    rows.push(done(failover::failover(&ctx, mode).await?));
    rows.extend(sched_rows(&ctx, &source, mode, shape).await);
    Ok(rows)
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = if args.iter().any(|a| a == "--short") {
        Mode::Short
    } else {
        Mode::Full
    };
    // Only the acquire+release rows, at full length: for iterating on them.
    let acquire_only = args.iter().any(|a| a == "--acquire-only");
    let rows_wanted = if args.iter().any(|a| a == "--sched-only") {
        Rows::SchedOnly
    } else if args.iter().any(|a| a == "--sweep-only") {
        Rows::SweepOnly
    } else if acquire_only {
        Rows::AcquireOnly
    } else {
        Rows::All
    };
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let pg_sessions = match args.iter().position(|a| a == "--pg-sessions") {
        Some(i) => pg::parse_sessions(args.get(i + 1).map_or("", String::as_str))?,
        None => pg::default_sessions(mode),
    };
    let shape = sched::Shape::from_args(&args)?;
    let run_id = format!("{:08x}", getrandom::u32().map_err(|e| e.to_string())?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    let mut failed = false;
    for (backend, found) in targets(&run_id, only.as_deref()) {
        match found {
            Availability::Ready((factory, source)) => {
                eprintln!("{backend}: measuring");
                match runtime.block_on(bench_backend(
                    factory,
                    source,
                    mode,
                    rows_wanted,
                    shape,
                    &run_id,
                )) {
                    Ok(r) => rows.extend(r),
                    Err(e) => {
                        failed = true;
                        eprintln!("{backend}: FAILED: {e}");
                        rows.push(Row::new(backend, "FAILED", e.to_string()));
                    }
                }
            }
            Availability::Missing(why) => {
                eprintln!("!!! {backend}: SKIPPED, no server ({why})");
                rows.push(Row::new(backend, "SKIPPED", format!("no server: {why}")));
            }
        }
    }
    // `--only postgres-sessions` runs these rows alone.
    if !matches!(rows_wanted, Rows::SchedOnly | Rows::SweepOnly)
        && only
            .as_deref()
            .is_none_or(|o| "postgres".starts_with(o) || o == "postgres-sessions")
    {
        // A private server (started here, outside the runtime): see pg.rs.
        let base = postgres::private_factory(&run_id).and_then(|b| b.url().map(|_| b));
        let measured = base.and_then(|base| {
            runtime.block_on(pg::rows(base, &pg_sessions, mode, acquire_only, &run_id))
        });
        match measured {
            Ok(r) => rows.extend(r),
            Err(e) => {
                failed = true;
                eprintln!("postgres sessions: FAILED: {e}");
                rows.push(Row::new("postgres sessions", "FAILED", e.to_string()));
            }
        }
    }
    report::print_table(&rows);
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    std::fs::create_dir_all(&target)?;
    let path = std::path::Path::new(&target).join("bench.json");
    std::fs::write(&path, report::to_json(&rows))?;
    eprintln!("written to {}", path.display());
    // Repeated after the table so that the end of a long log says what failed.
    let failures: Vec<&Row> = rows.iter().filter(|r| r.measure == "FAILED").collect();
    for r in &failures {
        eprintln!("FAILED: {}: {}", r.backend, r.setting);
    }
    if failed || !failures.is_empty() {
        return Err("a backend's measurement failed".into());
    }
    Ok(())
}
