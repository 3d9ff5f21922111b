//! The README's example: a guarded job on the embedded memory backend.
//!
//! Run with `cargo run -p lock-memory --example with_lock`.

use std::time::Duration;

use lock_core::{LockName, LockOptions, Locker, RunOutcome};
use lock_memory::MemoryBackend;

#[tokio::main]
async fn main() -> lock_core::Result<()> {
    let locker = Locker::new(MemoryBackend::new())?; // one per process; clone freely
    let name = LockName::new("billing/nightly-report")?;
    let opts = LockOptions::new(Duration::from_secs(30)) // how long a crashed holder blocks others
        .with_max_hold(Duration::from_secs(600)); // watchdog for a hung run
    let outcome = locker
        .with_lock(&name, &opts, |lease| async move {
            for batch in 0..3 {
                lease.assert_held()?; // before every unsafe write
                println!(
                    "writing batch {batch} with fencing token {:?}",
                    lease.fencing_token()
                );
            }
            Ok::<_, lock_core::Error>(())
        })
        .await?;
    match outcome {
        RunOutcome::Completed(result) => result?,
        RunOutcome::Skipped(why) => println!("not run: {why}"),
        RunOutcome::Aborted(reason) => println!("lock lost ({reason}); the run was stopped"),
    }
    Ok(())
}
