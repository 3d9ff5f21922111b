//! README's service recipe, run for a few seconds: connect, build a locker,
//! schedule a job, serve, shut down.
//!
//! ```sh
//! cargo run -p distlock --features scheduler --example service
//! LOCK_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run -p distlock --features scheduler,postgres --example service
//! ```

use std::time::Duration;

use distlock::scheduler::{Job, Scheduler};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("LOCK_URL").unwrap_or_else(|_| "memory://".into());
    let locks = distlock::connect(&url).await?;
    let locker = locks.locker()?;
    let scheduler = Scheduler::builder(locker.clone(), locks.tick_store())
        .with_job(Job::new(
            "examples/every-second",
            "* * * * * *",
            |ctx| async move {
                ctx.assert_held()?;
                println!(
                    "tick {} (fencing token {:?})",
                    ctx.scheduled_at(),
                    ctx.fencing_token()
                );
                Ok(())
            },
        ))
        .start()?;
    // A service would serve requests here until SIGTERM; this one stops itself.
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = tokio::time::sleep(Duration::from_millis(3_500)) => {}
    }
    scheduler.shutdown(Duration::from_secs(5)).await?;
    locker.shutdown(Duration::from_secs(5)).await?;
    let ran = scheduler_runs();
    println!("scheduler_runs_total{{outcome=\"success\"}} = {ran}");
    Ok(())
}

/// Successful runs, as the default registry exposes them.
fn scheduler_runs() -> f64 {
    distlock::prometheus::gather()
        .iter()
        .filter(|family| family.name() == "scheduler_runs_total")
        .flat_map(|family| family.get_metric())
        .filter(|m| m.get_label().iter().any(|l| l.value() == "success"))
        .map(|m| m.get_counter().get_value())
        .sum()
}
