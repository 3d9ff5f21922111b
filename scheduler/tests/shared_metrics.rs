//! Schedulers in one process share their metrics: any number of them on the
//! default registry, implicit or explicit, build and count into one series.

mod common;

use std::sync::Arc;
use std::time::Duration;

use chrono::DateTime;
use lock_memory::MemoryBackend;
use scheduler::{Job, Scheduler, SchedulerBuilder, TickOutcome, TokioClock};

/// A replica of a per-tick service on `memory`, running `job` every second.
fn replica(memory: &MemoryBackend, clock: &Arc<TokioClock>) -> SchedulerBuilder {
    let locker = common::locker(memory.clone());
    Scheduler::builder(locker, Arc::new(memory.clone()))
        .with_clock(Arc::clone(clock) as _)
        .with_job(Job::new("shared/job", "* * * * * *", |_| async { Ok(()) }))
}

#[tokio::test(start_paused = true)]
async fn schedulers_on_the_default_registry_share_one_series() {
    let memory = MemoryBackend::new();
    let base = DateTime::from_timestamp(1_800_000_000, 500_000_000).expect("valid");
    let clock = Arc::new(TokioClock::starting_at(base));
    let implicit = replica(&memory, &clock).build().expect("first implicit");
    let again = replica(&memory, &clock).build().expect("second implicit");
    let explicit = replica(&memory, &clock)
        .with_registry(prometheus::default_registry())
        .build()
        .expect("explicit default registry");
    let replicas = [implicit, again, explicit].map(|s| s.start().expect("starts"));
    // Ticks at +0.5 s, +1.5 s and +2.5 s from the start.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for s in replicas {
        let m = s.metrics().clone();
        s.shutdown(Duration::from_secs(1)).await.expect("clean");
        let (ran, skipped) = (
            m.runs("shared/job", TickOutcome::Success),
            m.runs("shared/job", TickOutcome::Skipped),
        );
        assert_eq!(
            (ran, skipped),
            (3, 6),
            "every replica sees all three ticks, each run once"
        );
    }
}
