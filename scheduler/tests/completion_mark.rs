//! The completion mark a finished tick leaves is a retained lock, and a
//! retained hold is a TTL on the server: on a backend with a minimum TTL
//! (whole seconds on etcd) the scheduler keeps the mark for at least that
//! long instead of asking for a hold the backend refuses. And a `Completed`
//! record the store cannot write: sent again, then reported `unrecorded`
//! (never `success`), the tick left `Started` under its kept lock, and what
//! each delivery mode does with it afterwards. On the memory backend and
//! tokio's paused clock.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::DateTime;
use common::{
    first_record, outcomes, replica, tick_lock_held, Completes, FlakyCompletes, Handler, Solo,
};
use lock_core::{Error as LockError, LockName, LockOptions, TickRecord};
use lock_memory::{Counting, Intercepted, MemoryBackend};
use prometheus::Registry;
use scheduler::{Delivery, Job, RunReport, Scheduler, TickOutcome, TokioClock};

const MIN_TTL: Duration = Duration::from_secs(1);

/// A tick that finishes with less than the minimum TTL left of the skew
/// tolerance keeps its lock as a mark for the minimum TTL: another replica
/// cannot take it for that long, and the hold asked of the backend is never
/// one it refuses.
#[tokio::test(start_paused = true)]
async fn a_short_mark_is_raised_to_the_backends_minimum_ttl() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let memory = MemoryBackend::new();
        // etcd's rule: a TTL below one second is refused with a
        // configuration error. A retained hold is set by a single renewal.
        let backend = Intercepted::over(memory.clone(), Counting::default().with_min_ttl(MIN_TTL));
        let locker = common::locker(backend.clone());
        // The first tick is due 100 ms after the start: at +0.1 s.
        let base = DateTime::from_timestamp(1_800_000_000, 900_000_000).expect("valid");
        let outcomes: Arc<Mutex<Vec<TickOutcome>>> = Arc::default();
        let seen = Arc::clone(&outcomes);
        let s = Scheduler::builder(locker, Arc::new(memory.clone()))
            .with_registry(&Registry::new())
            .with_clock(Arc::new(TokioClock::starting_at(base)))
            .with_skew_tolerance(Duration::from_millis(500))
            .with_on_outcome(move |r| seen.lock().expect("log").push(r.outcome))
            .with_job(
                Job::new("marked", "* * * * * *", |_| async { Ok(()) })
                    .with_ttl(Duration::from_secs(3)),
            )
            .start()
            .expect("starts");
        // Past the tick and the tolerance (+0.6 s), inside the minimum TTL.
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(*outcomes.lock().expect("log"), vec![TickOutcome::Success]);
        let holds: Vec<Duration> = backend
            .renewal_calls()
            .into_iter()
            .filter(|r| !r.batch)
            .flat_map(|r| r.ttls)
            .collect();
        assert_eq!(
            holds,
            vec![MIN_TTL],
            "the mark's hold must be raised to the backend's minimum TTL"
        );
        let other = common::locker(memory.clone());
        let tick = LockName::new("marked/1800000001000").expect("valid");
        let taken = other.try_lock(&tick, &LockOptions::new(MIN_TTL)).await;
        assert!(
            matches!(taken, Err(LockError::HeldElsewhere { .. })),
            "the tick's mark must still hold it: {taken:?}"
        );
        s.shutdown(Duration::from_secs(1)).await.expect("clean");
    })
    .await
    .expect("the test finishes within its bound");
}

/// A `Completed` write the store fails every time is sent three times, then
/// the run is reported `unrecorded`, not `success`, and counted so; the
/// tick stays `Started` and its lock is kept as its mark, so no replica
/// within the skew tolerance runs it. A replica that fires it after the
/// mark ran out (its clock 4 s behind, beyond the 2 s tolerance) finds a
/// stale start: at most once marks it abandoned without running it, at
/// least once runs it again and completes it under its higher token.
#[tokio::test(start_paused = true)]
async fn an_unwritable_completion_is_reported_unrecorded_and_left_to_the_mode() {
    tokio::time::timeout(Duration::from_secs(60), async {
        for delivery in [Delivery::AtMostOnce, Delivery::AtLeastOnce] {
            let memory = MemoryBackend::new();
            let store = FlakyCompletes::new(memory.clone(), Completes::Fail);
            let calls: Arc<Mutex<Vec<u64>>> = Arc::default();
            let first: Arc<Mutex<Vec<RunReport>>> = Arc::default();
            let later: Arc<Mutex<Vec<RunReport>>> = Arc::default();
            let (a, metrics) = replica(
                &memory,
                &store,
                0,
                delivery,
                &calls,
                &first,
                Handler::Returns,
            );
            let (b, _) = replica(
                &memory,
                &store,
                -4_000,
                delivery,
                &calls,
                &later,
                Handler::Returns,
            );
            // The tick at +0.1 s, its three writes 100 ms and 200 ms apart.
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(
                outcomes(&first),
                vec![TickOutcome::Unrecorded],
                "{delivery}"
            );
            assert_eq!(metrics.runs("recorded", TickOutcome::Unrecorded), 1);
            assert_eq!(metrics.runs("recorded", TickOutcome::Success), 0);
            assert_eq!(store.sent(), 3, "{delivery}: the write is sent three times");
            let token = calls.lock().expect("log")[0];
            let record = first_record(&memory).await;
            assert!(
                matches!(record, Some(TickRecord::Started { token: t, .. }) if t == token),
                "{delivery}: the tick stays Started: {record:?}"
            );
            assert!(
                tick_lock_held(&memory).await,
                "{delivery}: the lock is kept as the tick's mark"
            );
            // The store heals; the replica 4 s behind fires at +4.1 s, after
            // the mark (the 2 s tolerance from +0.4 s) ran out.
            store.set(Completes::Land);
            tokio::time::sleep(Duration::from_secs(5)).await;
            let calls = calls.lock().expect("log").clone();
            let outcomes = outcomes(&later);
            let record = first_record(&memory).await;
            match delivery {
                Delivery::AtMostOnce => {
                    assert_eq!(calls.len(), 1, "never run twice");
                    assert_eq!(outcomes, vec![TickOutcome::Abandoned]);
                    assert!(
                        matches!(record, Some(TickRecord::Abandoned { .. })),
                        "{record:?}"
                    );
                }
                _ => {
                    assert_eq!(calls.len(), 2, "run again: {calls:?}");
                    assert!(calls[1] > calls[0], "{calls:?}");
                    assert_eq!(outcomes, vec![TickOutcome::Success]);
                    assert_eq!(record, Some(TickRecord::Completed { token: calls[1] }));
                }
            }
            a.shutdown(Duration::from_secs(1)).await.expect("clean");
            b.shutdown(Duration::from_secs(1)).await.expect("clean");
        }
    })
    .await
    .expect("the test finishes within its bound");
}

/// A `Completed` write that landed but whose reply was lost is sent again,
/// and the retry finds its own record: the run is a plain success, the tick
/// `Completed` once.
#[tokio::test(start_paused = true)]
async fn a_completion_whose_reply_was_lost_is_confirmed_by_its_retry() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let solo = Solo::start(Completes::LoseFirstReply, Handler::Returns);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(solo.outcomes(), vec![TickOutcome::Success]);
        assert_eq!(solo.metrics.runs("recorded", TickOutcome::Unrecorded), 0);
        assert_eq!(solo.store.sent(), 2);
        let token = solo.calls.lock().expect("log")[0];
        assert_eq!(solo.record().await, Some(TickRecord::Completed { token }));
        solo.shutdown().await;
    })
    .await
    .expect("the test finishes within its bound");
}
