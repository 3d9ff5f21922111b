//! Benchmarks the library against each backend's raw protocol floor,
//! measured in the same run, and prints one table (also written as JSON to
//! `target/bench.json`).
//!
//! `cargo run --release -p conformance-tests --bin bench` (add `-- --short`
//! for a seconds-long smoke run, `-- --only memory` for one backend).
//! Servers come from the same places as in the conformance suite.

mod floors;
mod measures;
mod report;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::backends::memory::MemoryFactory;
use conformance_tests::{BackendFactory, BoxError, Ctx};

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
            Self::Short => Duration::from_secs(7),
            Self::Full => Duration::from_secs(30),
        }
    }

    fn scales(self) -> &'static [usize] {
        match self {
            Self::Short => &[1_000],
            Self::Full => &[1_000, 10_000],
        }
    }
}

fn factories() -> Vec<Arc<dyn BackendFactory>> {
    vec![Arc::new(MemoryFactory::new())]
}

async fn bench_backend(
    factory: Arc<dyn BackendFactory>,
    mode: Mode,
    run_id: &str,
) -> Result<Vec<Row>, BoxError> {
    let ctx = Ctx::new(Arc::clone(&factory), run_id, "bench");
    let floor = floors::floor_for(&factory).await?;
    eprintln!("{}: floor = {}", factory.name(), floor.describe());
    let mut rows = Vec::new();
    for concurrency in [1, 16] {
        rows.push(measures::uncontended(&ctx, &floor, concurrency, mode).await?);
    }
    for &leases in mode.scales() {
        rows.push(measures::renewal_at_scale(&ctx, leases, mode).await?);
    }
    rows.push(measures::handoff(&ctx, mode).await?);
    Ok(rows)
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = if args.iter().any(|a| a == "--short") {
        Mode::Short
    } else {
        Mode::Full
    };
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let run_id = format!("{:08x}", getrandom::u32().map_err(|e| e.to_string())?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    for factory in factories() {
        if only.as_deref().is_some_and(|o| o != factory.name()) {
            continue;
        }
        rows.extend(runtime.block_on(bench_backend(factory, mode, &run_id))?);
    }
    report::print_table(&rows);
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    std::fs::create_dir_all(&target)?;
    let path = std::path::Path::new(&target).join("bench.json");
    std::fs::write(&path, report::to_json(&rows))?;
    eprintln!("written to {}", path.display());
    Ok(())
}
