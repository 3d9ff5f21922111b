//! Two replicas share one in-process lock server: they contend for a lock, a
//! theft is detected and aborts the job, and the watchdog ends a job that
//! holds its lock too long.
//!
//! Run with `cargo run -p lock-memory --example contention`.

use std::time::Duration;

use lock_core::{LockName, LockOptions, Locker, RunOutcome};
use lock_memory::MemoryBackend;
use prometheus::Registry;
use tokio::time::{sleep, Instant};

fn replica(server: &MemoryBackend) -> lock_core::Result<Locker> {
    Locker::builder()
        .with_backend(server.clone())
        .with_registry(&Registry::new())
        .build()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let t = move || format!("{:>6.0} ms", start.elapsed().as_secs_f64() * 1000.0);
    let server = MemoryBackend::new();
    let (a, b) = (replica(&server)?, replica(&server)?);
    let opts = LockOptions::new(Duration::from_millis(600));

    println!("--- 1. two replicas contend for one lock");
    let name = LockName::new("reports/nightly")?;
    let job_a = {
        let (a, name, opts) = (a.clone(), name.clone(), opts.clone());
        tokio::spawn(async move {
            a.with_lock(&name, &opts, |lease| async move {
                println!(
                    "{} A runs the job (fencing token {:?})",
                    t(),
                    lease.fencing_token()
                );
                sleep(Duration::from_millis(1500)).await;
                println!("{} A finishes; its lease was renewed the whole time", t());
            })
            .await
        })
    };
    sleep(Duration::from_millis(100)).await;
    match b.with_lock(&name, &opts, |_| async {}).await? {
        RunOutcome::Skipped(why) => println!("{} B skips this run: {why:?}", t()),
        other => println!("{} B: unexpected {other:?}", t()),
    }
    let waiting = opts.clone().with_acquire_timeout(Duration::from_secs(5));
    let guard = b.lock(&name, &waiting).await?;
    println!(
        "{} B waited and got the lock after A released it (fencing token {:?})",
        t(),
        guard.fencing_token()
    );
    guard.release().await?;
    job_a
        .await??
        .completed()
        .ok_or("A's run did not complete")?;

    println!("--- 2. another owner steals the lock mid-job");
    let name = LockName::new("payouts")?;
    let thief_server = server.clone();
    let stolen = name.clone();
    let stolen_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let mark = std::sync::Arc::clone(&stolen_at);
    let outcome = a
        .with_lock(&name, &opts, |lease| async move {
            sleep(Duration::from_millis(300)).await;
            thief_server.steal(&stolen, Duration::from_secs(5));
            *mark.lock().expect("not poisoned") = Some(Instant::now());
            println!(
                "{} someone overwrites the lock (an operator, a bug, a failover)",
                t()
            );
            lease.assert_held().ok(); // still looks valid until the next renewal
            sleep(Duration::from_secs(10)).await; // never finishes: the job is dropped
        })
        .await?;
    let detected = stolen_at
        .lock()
        .expect("not poisoned")
        .map(|at| at.elapsed())
        .unwrap_or_default();
    println!(
        "{} with_lock returned {outcome:?}: the job was cancelled {:.0} ms after the theft (renewal every 200 ms)",
        t(),
        detected.as_secs_f64() * 1000.0
    );
    server.expire(&name);

    println!("--- 3. the watchdog ends a job that holds too long");
    let name = LockName::new("reindex")?;
    let capped = opts.clone().with_max_hold(Duration::from_millis(1200));
    let outcome = a
        .with_lock(&name, &capped, |_| async {
            println!(
                "{} A starts a job that would run for 5 s (max hold 1.2 s)",
                t()
            );
            sleep(Duration::from_secs(5)).await;
        })
        .await?;
    println!("{} with_lock returned {outcome:?}", t());
    let guard = b.try_lock(&name, &opts).await?;
    println!("{} B acquires at once: the watchdog released the lock", t());
    guard.release().await?;
    Ok(())
}
