//! Two replicas of a service contend for one lock through `distlock::connect`.
//!
//! ```sh
//! cargo run -p distlock --example locks                      # memory://demo
//! LOCK_URL=redis://127.0.0.1:6379 cargo run -p distlock --features redis --example locks
//! ```
//!
//! Both replicas report into the default Prometheus registry, which is then
//! printed: their counts land in the same series.

use std::time::Duration;

use distlock::{Error, LockName, LockOptions, RunOutcome};
use tokio::sync::oneshot;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A named memory URL is shared within the process, as a server is.
    let url = std::env::var("LOCK_URL").unwrap_or_else(|_| "memory://demo".into());
    let (a, b) = (
        distlock::connect(&url).await?.locker()?,
        distlock::connect(&url).await?.locker()?,
    );
    let name = LockName::new("examples/nightly-report")?;
    let opts = LockOptions::new(Duration::from_secs(10)).with_max_hold(Duration::from_secs(60));

    let (holding, held) = oneshot::channel();
    let (done, finish) = oneshot::channel::<()>();
    let job = a.with_lock(&name, &opts, |lease| async move {
        println!(
            "replica a holds {} (fencing token {:?})",
            lease.name(),
            lease.fencing_token()
        );
        let _ = holding.send(());
        let _ = finish.await; // until replica b has been turned away
        lease.assert_held()?;
        Ok::<_, Error>("report written")
    });
    let contender = async {
        let _ = held.await;
        match b.try_lock(&name, &opts).await {
            Err(Error::HeldElsewhere { .. }) => println!("replica b: held by another replica"),
            other => println!("replica b: unexpected {other:?}"),
        }
        let _ = done.send(());
    };
    let (outcome, ()) = tokio::join!(job, contender);
    match outcome? {
        RunOutcome::Completed(result) => println!("replica a: {}", result?),
        RunOutcome::Skipped(why) => println!("replica a: not run ({why})"),
        RunOutcome::Aborted(reason) => println!("replica a: lock lost ({reason}), run stopped"),
    }
    b.try_lock(&name, &opts).await?.release().await?;
    println!("replica b: acquired after a released");

    let exposition = distlock::prometheus::TextEncoder::new()
        .encode_to_string(&distlock::prometheus::gather())?;
    for line in exposition.lines() {
        if line.starts_with("distributed_lock_acquisitions_total{") {
            println!("{line}");
        }
    }
    Ok(())
}
