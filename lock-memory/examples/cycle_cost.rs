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
//!
//! `bare-timer` is `bare` with one timer pending on the runtime (a task
//! asleep for an hour), as the `Locker`'s heartbeat keeps one while it waits
//! for its next renewal: tokio's time driver then reads the clock and looks
//! at its timer wheel on every park, which the plain `bare` run never pays.
//!
//! A third argument `T` splits the `N` cycles over `T` tasks, each on a
//! name of its own, as the bench's concurrency 16 does (`N` must be a
//! multiple of `T`: 1600 and 17600 cycles for 16 tasks, the difference
//! divided by 16,000).

use std::time::Duration;

use lock_core::{LockBackend, LockName, LockOptions, Locker, OwnerToken};
use lock_memory::MemoryBackend;
use prometheus::Registry;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "locker".into());
    let cycles: u64 = args.next().map_or(Ok(1000), |n| n.parse())?;
    let tasks: u64 = args.next().map_or(Ok(1), |n| n.parse())?;
    if tasks == 0 || !cycles.is_multiple_of(tasks) {
        return Err(format!("{cycles} cycles do not split over {tasks} tasks").into());
    }
    let backend = MemoryBackend::new();
    let ttl = Duration::from_secs(30);
    let _timer =
        (mode == "bare-timer").then(|| tokio::spawn(tokio::time::sleep(Duration::from_secs(3600))));
    let locker = Locker::builder()
        .with_backend(backend.clone())
        .with_registry(&Registry::new())
        .build()?;
    if tasks == 1 {
        // In the main task, as the measurements before the split were made.
        let name = LockName::new("cycle-cost")?;
        run(&mode, &locker, &backend, &name, ttl, cycles).await?;
        println!("{cycles} {mode} cycles");
        return Ok(());
    }
    let mut running = Vec::new();
    for t in 0..tasks {
        let name = LockName::new(format!("cycle-cost/{t}"))?;
        let (backend, locker, mode) = (backend.clone(), locker.clone(), mode.clone());
        running.push(tokio::spawn(async move {
            run(&mode, &locker, &backend, &name, ttl, cycles / tasks).await
        }));
    }
    for task in running {
        task.await??;
    }
    println!("{cycles} {mode} cycles over {tasks} task(s)");
    Ok(())
}

async fn run(
    mode: &str,
    locker: &Locker,
    backend: &MemoryBackend,
    name: &LockName,
    ttl: Duration,
    cycles: u64,
) -> Result<(), String> {
    match mode {
        "locker" => {
            let opts = LockOptions::new(ttl);
            for _ in 0..cycles {
                let guard = locker
                    .try_lock(name, &opts)
                    .await
                    .map_err(|e| e.to_string())?;
                guard.release().await.map_err(|e| e.to_string())?;
                // As in the bench: lets the heartbeat task run (the backend
                // never waits, so without it the task never would).
                tokio::task::yield_now().await;
            }
        }
        "bare" | "bare-timer" => {
            for _ in 0..cycles {
                let owner = OwnerToken::generate().map_err(|e| e.to_string())?;
                backend
                    .try_acquire(name, &owner, ttl)
                    .await
                    .map_err(|e| e.to_string())?;
                backend
                    .release(name, &owner)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::task::yield_now().await;
            }
        }
        other => {
            return Err(format!(
                "unknown mode {other:?}: use locker, bare or bare-timer"
            ))
        }
    }
    Ok(())
}
