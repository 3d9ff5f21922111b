//! The path a service takes through the `distlock` facade, against each
//! backend's server: `connect(url)` twice (two replicas) and their `Locker`s
//! on the default registry; then the tick store and a scheduler running a job.

use std::time::Duration;

use distlock::scheduler::{Job, RunReport, Scheduler, TickOutcome};
use distlock::{Error, Locks};
use tokio::sync::mpsc;

use crate::Ctx;

/// Longest the scheduler may take to run its first every-second tick.
const FIRST_RUN_WITHIN: Duration = Duration::from_secs(10);

/// Two replicas of a service, as `distlock::connect` makes them.
async fn two_replicas(ctx: &Ctx) -> (Locks, Locks) {
    let url = ctx
        .factory()
        .connect_url()
        .expect("cases requiring a URL get one");
    let a = distlock::connect(&url)
        .await
        .expect("first replica connects");
    let b = distlock::connect(&url)
        .await
        .expect("second replica connects");
    (a, b)
}

/// Two replicas' `Locker`s exclude each other; both report into the default
/// registry.
pub(crate) async fn facade_connect(ctx: Ctx) {
    let (a, b) = two_replicas(&ctx).await;
    // Both on the default registry, as services use it: the second shares
    // the metrics the first registered.
    let (la, lb) = (
        a.locker().expect("locker on the default registry"),
        b.locker_with_registry(distlock::prometheus::default_registry())
            .expect("a second locker on the default registry"),
    );

    let name = ctx.name("lock");
    let guard = la.try_lock(&name, &ctx.opts()).await.expect("a acquires");
    assert!(
        matches!(
            lb.try_lock(&name, &ctx.opts()).await,
            Err(Error::HeldElsewhere { .. })
        ),
        "b must be turned away while a holds the lock"
    );
    guard.assert_held().expect("a holds");
    guard.release().await.expect("a releases");
    let guard = lb.try_lock(&name, &ctx.opts()).await.expect("b acquires");
    guard.release().await.expect("b releases");
}

/// A scheduler over one replica's `Locks` runs a job; the other replica's
/// tick store sees the tick marked. (Named as a scheduler case: its
/// completion marks outlive it on purpose, for at least a minute.)
pub(crate) async fn scheduler_through_facade(ctx: Ctx) {
    let (a, b) = two_replicas(&ctx).await;
    let locker = a.locker().expect("locker on the default registry");
    let job = ctx.name("job");
    let (reports, mut reported) = mpsc::unbounded_channel::<RunReport>();
    let scheduler = Scheduler::builder(locker, a.tick_store())
        .with_registry(&distlock::prometheus::Registry::new())
        .with_on_outcome(move |r| {
            let _ = reports.send(r.clone());
        })
        .with_job(
            Job::new(job.as_str(), "* * * * * *", |run| async move {
                run.assert_held()?;
                Ok(())
            })
            // The profile's TTL: backends may cap it (Postgres's max_ttl).
            .with_ttl(ctx.timing().ttl),
        )
        .start()
        .expect("scheduler starts");
    let ran = tokio::time::timeout(FIRST_RUN_WITHIN, async {
        while let Some(report) = reported.recv().await {
            if report.outcome == TickOutcome::Success {
                return Some(report);
            }
        }
        None
    })
    .await
    .unwrap_or_else(|_| panic!("no successful run within {FIRST_RUN_WITHIN:?}"))
    .expect("the scheduler reports its runs");
    scheduler
        .shutdown(Duration::from_secs(5))
        .await
        .expect("clean shutdown");
    // The other replica's connection sees the finished tick.
    let marked = b
        .tick_store()
        .is_completed(&job, ran.scheduled.timestamp_millis())
        .await
        .expect("tick store answers");
    assert!(
        marked,
        "the run of {} is not marked completed",
        ran.scheduled
    );
}
