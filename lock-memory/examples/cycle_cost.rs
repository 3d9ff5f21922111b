//! Runs `N` uncontended acquire + release cycles on the in-process backend,
//! through a `Locker` or on the bare backend, for counting the instructions
//! one cycle costs under `valgrind --tool=callgrind`, which, unlike wall
//! time, does not move with the load of a shared machine.
//!
//! ```text
//! cargo build --release -p lock-memory --example cycle_cost
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.1k  target/release/examples/cycle_cost locker 1000
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.11k target/release/examples/cycle_cost locker 11000
//! ```
//!
//! The difference of the two totals divided by 10,000 is the cost of one
//! cycle, without start-up. `bare` instead of `locker` measures
//! `LockBackend::try_acquire` + `release` alone, the bench's floor.

use std::time::Duration;

use lock_core::{LockBackend, LockName, LockOptions, Locker, OwnerToken};
use lock_memory::MemoryBackend;
use prometheus::Registry;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "locker".into());
    let cycles: u64 = args.next().map_or(Ok(1000), |n| n.parse())?;
    let backend = MemoryBackend::new();
    let name = LockName::new("cycle-cost")?;
    let ttl = Duration::from_secs(30);
    match mode.as_str() {
        "locker" => {
            let locker = Locker::builder()
                .with_backend(backend)
                .with_registry(&Registry::new())
                .build()?;
            let opts = LockOptions::new(ttl);
            for _ in 0..cycles {
                locker.try_lock(&name, &opts).await?.release().await?;
                // As in the bench: lets the heartbeat task run (the backend
                // never waits, so without it the task never would).
                tokio::task::yield_now().await;
            }
        }
        "bare" => {
            for _ in 0..cycles {
                let owner = OwnerToken::generate()?;
                backend.try_acquire(&name, &owner, ttl).await?;
                backend.release(&name, &owner).await?;
                tokio::task::yield_now().await;
            }
        }
        other => return Err(format!("unknown mode {other:?}: use locker or bare").into()),
    }
    println!("{cycles} {mode} cycles");
    Ok(())
}
