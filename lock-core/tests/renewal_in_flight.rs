//! Deadlines while a batch renewal is in flight: the heartbeat watches the
//! call, not each lease in it, and must still end every lease at its own
//! local deadline, keep the ones an answer arrives in time for, and never
//! end a lease early. All on tokio's paused clock.

use std::time::Duration;

use lock_core::{LockGuard, LockName, LockOptions, Locker, LossReason};
use lock_memory::{Counting, Intercepted};
use tokio::time::{sleep, sleep_until, timeout, Instant};

mod common;
use common::{locker, BOUND};

/// The in-process backend, its renewals stalled from the first one on
/// until answered, logging each batch.
type Stalling = Intercepted<Counting>;

/// 3 s TTL, renewed every second: renewals due within 125 ms (an eighth of
/// the interval) of each other share a batch.
fn opts() -> LockOptions {
    LockOptions::new(Duration::from_secs(3))
}

/// Takes `first` at the current instant and `second` 100 ms later, through
/// a locker on a backend whose renewals stall from the start, so their
/// renewals share one batch but their deadlines are 100 ms apart. Returns
/// the backend, the locker (kept alive for the heartbeat), both guards, and
/// when the first was taken.
async fn stalled_leases() -> (Stalling, Locker, LockGuard, LockGuard, Instant) {
    let backend = Stalling::default();
    backend.stall_renewals(opts().ttl());
    let locker = locker(&backend);
    let start = Instant::now();
    let first = LockName::new("in-flight/first").expect("a valid name");
    let second = LockName::new("in-flight/second").expect("a valid name");
    let a = locker.try_lock(&first, &opts()).await.expect("uncontended");
    sleep(Duration::from_millis(100)).await;
    let b = locker
        .try_lock(&second, &opts())
        .await
        .expect("uncontended");
    (backend, locker, a, b, start)
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_never_answers_ends_each_lease_at_its_own_deadline() {
    timeout(BOUND, async {
        let (backend, _locker, a, b, start) = stalled_leases().await;

        assert_eq!(a.lost().await, LossReason::BackendError);
        let a_ended = Instant::now();
        assert_eq!(backend.batches(), vec![2], "one renewal call for both");
        assert!(
            a_ended - start > Duration::from_secs(1) && a_ended - start < Duration::from_secs(3),
            "the first lease ended at its local deadline, before its TTL: {:?}",
            a_ended - start
        );
        assert!(b.is_held(), "the second lease's deadline is 100 ms later");

        assert_eq!(b.lost().await, LossReason::BackendError);
        assert_eq!(
            Instant::now() - a_ended,
            Duration::from_millis(100),
            "each lease ends at its own deadline, watched through the batch"
        );
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn an_answer_after_one_lease_ended_keeps_the_others_of_its_batch() {
    timeout(BOUND, async {
        let (backend, _locker, a, b, start) = stalled_leases().await;

        assert_eq!(a.lost().await, LossReason::BackendError);
        // The answer arrives between the two deadlines.
        backend.answer_stalled();
        sleep(Duration::from_millis(10)).await;
        assert!(b.is_held(), "renewed by the batch's late answer");

        // Well past the second lease's first deadline, renewed every second.
        sleep_until(start + Duration::from_secs(6)).await;
        assert!(b.is_held());
        assert!(!a.is_held());
        let batches = backend.batches();
        assert_eq!(batches.first(), Some(&2));
        assert!(
            batches.len() >= 4 && batches[1..].iter().all(|&n| n == 1),
            "the ended lease is never renewed again: {batches:?}"
        );
        b.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}
