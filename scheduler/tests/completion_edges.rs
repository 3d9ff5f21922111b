//! A run's `Completed` write at the edges: a handler that panicked and whose
//! completion cannot be written, and a shutdown whose deadline passes while
//! the write is being retried. On the memory backend and tokio's paused
//! clock.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{replica, Completes, FlakyCompletes, Handler, TICK_MS};
use lock_core::{Error as LockError, LockName, LockOptions, Locker, TickRecord, TickStore};
use lock_memory::MemoryBackend;
use prometheus::Registry;
use scheduler::{Delivery, RunReport, TickOutcome};
use tokio::time::Instant;

/// Whether another locker over `memory` finds the tick's lock held.
async fn tick_lock_held(memory: &MemoryBackend) -> bool {
    let other = Locker::builder()
        .with_backend(memory.clone())
        .with_registry(&Registry::new())
        .build()
        .expect("locker");
    let name = LockName::new(format!("recorded/{TICK_MS}")).expect("valid");
    match other
        .try_lock(&name, &LockOptions::new(Duration::from_secs(1)))
        .await
    {
        Ok(guard) => {
            guard.release().await.expect("release");
            false
        }
        Err(LockError::HeldElsewhere { .. }) => true,
        Err(e) => panic!("unexpected: {e}"),
    }
}

fn outcomes(reports: &Mutex<Vec<RunReport>>) -> Vec<TickOutcome> {
    reports
        .lock()
        .expect("log")
        .iter()
        .map(|r| r.outcome)
        .collect()
}

/// A handler that panicked is counted `panicked` and its lock freed only
/// when its `Completed` record landed. When the store fails every write,
/// the run is `unrecorded` like any other whose completion was lost (the
/// panic is in the log), the tick stays `Started` and the lock is kept as
/// its mark, so no replica within the skew tolerance runs it again.
#[tokio::test(start_paused = true)]
async fn a_panicked_run_whose_completion_fails_is_unrecorded_and_keeps_its_mark() {
    tokio::time::timeout(Duration::from_secs(60), async {
        for (completes, expected, held) in [
            (Completes::Land, TickOutcome::Panicked, false),
            (Completes::Fail, TickOutcome::Unrecorded, true),
        ] {
            let memory = MemoryBackend::new();
            let store = FlakyCompletes::new(memory.clone(), completes);
            let calls: Arc<Mutex<Vec<u64>>> = Arc::default();
            let reports: Arc<Mutex<Vec<RunReport>>> = Arc::default();
            let (s, metrics) = replica(
                &memory,
                &store,
                0,
                Delivery::AtMostOnce,
                &calls,
                &reports,
                Handler::Panics,
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(outcomes(&reports), vec![expected], "{completes:?}");
            assert_eq!(metrics.runs("recorded", expected), 1, "{completes:?}");
            let token = calls.lock().expect("log")[0];
            let job = LockName::new("recorded").expect("valid");
            let record = memory.tick_record(&job, TICK_MS).await.expect("memory");
            match completes {
                Completes::Land => assert_eq!(record, Some(TickRecord::Completed { token })),
                _ => assert!(
                    matches!(record, Some(TickRecord::Started { token: t, .. }) if t == token),
                    "the tick stays Started: {record:?}"
                ),
            }
            assert_eq!(tick_lock_held(&memory).await, held, "{completes:?}");
            s.shutdown(Duration::from_secs(1)).await.expect("clean");
        }
    })
    .await
    .expect("the test finishes within its bound");
}

/// A shutdown whose deadline passes while a `Completed` write waits to be
/// sent again ends the retries at the deadline: the run is `unrecorded`
/// (the tick stays `Started`), and shutdown returns then instead of after
/// the remaining tries.
#[tokio::test(start_paused = true)]
async fn the_completion_retries_stop_at_the_shutdown_deadline() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let memory = MemoryBackend::new();
        let store = FlakyCompletes::new(memory.clone(), Completes::Fail);
        let calls: Arc<Mutex<Vec<u64>>> = Arc::default();
        let reports: Arc<Mutex<Vec<RunReport>>> = Arc::default();
        let (s, metrics) = replica(
            &memory,
            &store,
            0,
            Delivery::AtMostOnce,
            &calls,
            &reports,
            Handler::Returns,
        );
        // The tick at +0.1 s, its first write failed at once; the second
        // would go at +0.2 s.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.sent(), 1);
        let began = Instant::now();
        let deadline = Duration::from_millis(10);
        let _ = s.shutdown(deadline).await;
        let took = began.elapsed();
        assert_eq!(store.sent(), 1, "no write is sent after the deadline");
        assert_eq!(outcomes(&reports), vec![TickOutcome::Unrecorded]);
        assert_eq!(metrics.runs("recorded", TickOutcome::Unrecorded), 1);
        assert!(
            took < Duration::from_millis(50),
            "shutdown returned {took:?} after it began, its deadline {deadline:?}"
        );
        let job = LockName::new("recorded").expect("valid");
        let record = memory.tick_record(&job, TICK_MS).await.expect("memory");
        assert!(
            matches!(record, Some(TickRecord::Started { .. })),
            "{record:?}"
        );
    })
    .await
    .expect("the test finishes within its bound");
}
