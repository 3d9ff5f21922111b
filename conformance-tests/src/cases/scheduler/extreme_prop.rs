//! Random combinations of extreme durations on the in-process backend and
//! tokio's paused clock: the scheduler is refused at build time with a
//! clear error, or it runs, shuts down by its deadline plus the stated
//! margin, and leaves no lease behind once its completion marks have run
//! out. Nothing panics, in any task.

use std::sync::Arc;
use std::time::Duration;

use chrono::DateTime;
use lock_core::{LockName, Locker, TickStore};
use lock_memory::MemoryBackend;
use prometheus::Registry;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use scheduler::TokioClock;
use tokio::time::{sleep, Instant};

use super::extreme::{is_clear_refusal, Settings, EXTREMES, SHUTDOWN_MARGIN};
use super::panics::{count_panics, panics_on_this_thread};
use crate::Ctx;

/// The memory profile's TTL.
const TTL: Duration = Duration::from_secs(3);
/// The longest skew tolerance the scheduler accepts is a day; its
/// completion marks are gone two days after the last tick.
const PAST_EVERY_MARK: Duration = Duration::from_secs(2 * 86_400);

/// The extremes, plus ordinary values so that some combinations build.
fn duration() -> impl Strategy<Value = Duration> {
    let mut values = EXTREMES.to_vec();
    values.extend([
        Duration::from_millis(1),
        TTL,
        TTL * 2,
        Duration::from_secs(86_400),
    ]);
    select(values)
}

fn settings(ttls: Vec<Duration>) -> impl Strategy<Value = Settings> {
    let ttl = select(ttls);
    (
        duration(),
        proptest::option::of((ttl.clone(), duration())),
        ttl,
        proptest::option::of(duration()),
        proptest::option::of(duration()),
        duration(),
    )
        .prop_map(
            |(tolerance, election, job_ttl, max_hold, window, deadline)| Settings {
                tolerance,
                election,
                job_ttl,
                max_hold,
                window,
                deadline,
            },
        )
}

/// Runs the property with lock TTLs drawn from `ttls`.
fn never_panics_nor_leaks(ttls: Vec<Duration>) {
    count_panics();
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&settings(ttls), |s| {
            let before = panics_on_this_thread();
            let result = one(&s);
            let panics = panics_on_this_thread() - before;
            prop_assert_eq!(panics, 0, "a task panicked with {:?}", s);
            result
        })
        .unwrap_or_else(|e| panic!("{e}"));
}

fn one(s: &Settings) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    rt.block_on(async {
        let memory = MemoryBackend::new();
        let locker = Locker::builder()
            .with_backend(memory.clone())
            .with_registry(&Registry::new())
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let base = DateTime::from_timestamp(1_800_000_001, 0).expect("valid");
        let clock = Arc::new(TokioClock::starting_at(base));
        let name = LockName::new("extreme/job").expect("valid");
        // Three ticks missed before the start, for the catch-up policies.
        let last = (base.timestamp() - 7) * 1_000;
        memory
            .record_completed(&name, last, Duration::from_secs(60))
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let ticks: Arc<dyn TickStore> = Arc::new(memory.clone());
        let scheduler = match s.build(locker, ticks, clock, &name, "*/2 * * * * *") {
            Err(e) => {
                prop_assert!(is_clear_refusal(&e), "unclear refusal: {:?}", e);
                return Ok(());
            }
            Ok(scheduler) => scheduler,
        };
        let scheduler = scheduler
            .start()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        sleep(Duration::from_secs(5)).await;
        let began = Instant::now();
        let _ = scheduler.shutdown(s.deadline).await;
        let took = began.elapsed();
        prop_assert!(
            took <= s.deadline.saturating_add(SHUTDOWN_MARGIN),
            "shutdown took {:?}",
            took
        );
        sleep(PAST_EVERY_MARK).await;
        prop_assert_eq!(memory.live_leases(), 0, "a lease outlived its marks");
        Ok(())
    })
}

/// The scheduler's own settings at their extremes (skew tolerance, max hold,
/// catch-up window, election interval, shutdown deadline), with lock TTLs
/// the lock layer handles itself: ordinary, 0, 1 ns and `u64::MAX` ms.
pub(crate) fn scheduler_extreme_durations_never_panic(ctx: Ctx) {
    let _ = ctx;
    never_panics_nor_leaks(vec![TTL, Duration::ZERO, super::extreme::HUGE]);
}

/// As [`scheduler_extreme_durations_never_panic`], with lock TTLs of
/// `Duration::MAX` too: whether those are refused or run is the lock
/// layer's to decide.
pub(crate) fn scheduler_extreme_lock_ttls_never_panic(ctx: Ctx) {
    let _ = ctx;
    never_panics_nor_leaks(vec![TTL, Duration::MAX, super::extreme::HUGE]);
}
