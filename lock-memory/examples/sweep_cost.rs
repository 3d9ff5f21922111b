//! Holds `L` leases through `S` heartbeat sweeps on the in-process backend,
//! on tokio's paused clock, for counting what the heartbeat's sweeps cost
//! under `valgrind --tool=callgrind` (instructions, which unlike the CPU
//! share of a shared machine do not move with its load).
//!
//! ```text
//! cargo build --release -p lock-memory --example sweep_cost
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/sw.1 target/release/examples/sweep_cost 10000 1
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/sw.6 target/release/examples/sweep_cost 10000 6
//! ```
//!
//! The difference of the two totals divided by 5 is one sweep of `L`
//! leases (10,000 by default): the renewal call itself, on the in-process
//! backend, plus the heartbeat's bookkeeping around it.

use std::time::Duration;

use lock_core::{LockName, LockOptions, Locker};
use lock_memory::MemoryBackend;
use prometheus::Registry;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let leases: usize = args.next().map_or(Ok(10_000), |n| n.parse())?;
    let sweeps: u32 = args.next().map_or(Ok(1), |n| n.parse())?;
    // Paused: the clock jumps to the heartbeat's next wake-up whenever the
    // runtime is idle, so a sweep every second costs no real second.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    runtime.block_on(async move {
        let locker = Locker::builder()
            .with_backend(MemoryBackend::new())
            .with_registry(&Registry::new())
            .build()?;
        // Renewed every second; one label, as a job's per-tick locks share.
        let opts = LockOptions::new(Duration::from_secs(3)).with_metric_label("sweep-cost");
        let mut guards = Vec::with_capacity(leases);
        for i in 0..leases {
            let name = LockName::new(format!("sweep-cost/{i}"))?;
            guards.push(locker.try_lock(&name, &opts).await?);
        }
        // Half an interval past the last sweep counted.
        tokio::time::sleep(Duration::from_millis(500) + Duration::from_secs(1) * sweeps).await;
        let held = guards.iter().filter(|g| g.is_held()).count();
        println!("{leases} leases through {sweeps} sweep(s), {held} still held");
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}
