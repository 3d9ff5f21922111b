//! A run's `Completed` write at the edges: a handler that panicked and whose
//! completion cannot be written, and a shutdown whose deadline passes while
//! the write is being retried. On the memory backend and tokio's paused
//! clock.

mod common;

use std::time::Duration;

use common::{first_record, outcomes, tick_lock_held, Completes, Handler, Solo};
use lock_core::TickRecord;
use scheduler::TickOutcome;
use tokio::time::Instant;

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
            let solo = Solo::start(completes, Handler::Panics);
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(solo.outcomes(), vec![expected], "{completes:?}");
            assert_eq!(solo.metrics.runs("recorded", expected), 1, "{completes:?}");
            let token = solo.calls.lock().expect("log")[0];
            let record = solo.record().await;
            match completes {
                Completes::Land => assert_eq!(record, Some(TickRecord::Completed { token })),
                _ => assert!(
                    matches!(record, Some(TickRecord::Started { token: t, .. }) if t == token),
                    "the tick stays Started: {record:?}"
                ),
            }
            assert_eq!(tick_lock_held(&solo.memory).await, held, "{completes:?}");
            solo.shutdown().await;
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
        let Solo {
            memory,
            store,
            reports,
            scheduler,
            metrics,
            ..
        } = Solo::start(Completes::Fail, Handler::Returns);
        // The tick at +0.1 s, its first write failed at once; the second
        // would go at +0.2 s.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(store.sent(), 1);
        let began = Instant::now();
        let deadline = Duration::from_millis(10);
        let _ = scheduler.shutdown(deadline).await;
        let took = began.elapsed();
        assert_eq!(store.sent(), 1, "no write is sent after the deadline");
        assert_eq!(outcomes(&reports), vec![TickOutcome::Unrecorded]);
        assert_eq!(metrics.runs("recorded", TickOutcome::Unrecorded), 1);
        assert!(
            took < Duration::from_millis(50),
            "shutdown returned {took:?} after it began, its deadline {deadline:?}"
        );
        let record = first_record(&memory).await;
        assert!(
            matches!(record, Some(TickRecord::Started { .. })),
            "{record:?}"
        );
    })
    .await
    .expect("the test finishes within its bound");
}
