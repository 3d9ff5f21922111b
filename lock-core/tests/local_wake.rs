//! Waiting for a name held in this process: a release wakes the local
//! waiters at its instant, not at their next backoff poll. On a `Locker`
//! without a backend, so no backend notification can do the waking, and
//! on tokio's paused clock, so "at its instant" is exact.

use std::time::Duration;

use lock_core::{LockName, LockOptions, Locker};
use prometheus::Registry;
use tokio::time::{sleep, timeout, Instant};

/// A bound on each test, in the paused clock's time.
const BOUND: Duration = Duration::from_secs(60);

fn unlocked() -> Locker {
    Locker::builder()
        .with_registry(&Registry::new())
        .build()
        .expect("a fresh registry takes the metrics")
}

#[tokio::test(start_paused = true)]
async fn local_waiters_are_woken_at_the_release() {
    timeout(BOUND, async {
        let locker = unlocked();
        let name = LockName::new("local/wake").expect("a valid name");
        let opts =
            LockOptions::new(Duration::from_secs(30)).with_acquire_timeout(Duration::from_secs(20));
        let guard = locker.try_lock(&name, &opts).await.expect("uncontended");

        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (locker, name, opts) = (locker.clone(), name.clone(), opts.clone());
                tokio::spawn(async move {
                    let got = locker.lock(&name, &opts).await.expect("granted in time");
                    let at = Instant::now();
                    got.release().await.expect("held");
                    at
                })
            })
            .collect();
        // Long enough for every waiter to be denied a few times and settle
        // into a backoff sleep of several milliseconds.
        sleep(Duration::from_millis(50)).await;
        let released_at = Instant::now();
        guard.release().await.expect("held");
        for waiter in waiters {
            let acquired_at = waiter.await.expect("the waiter ran");
            assert_eq!(
                acquired_at, released_at,
                "a waiter slept on past the release"
            );
        }
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_gave_up_leaves_later_waits_working() {
    timeout(BOUND, async {
        let locker = unlocked();
        let name = LockName::new("local/gave-up").expect("a valid name");
        let quick = LockOptions::new(Duration::from_secs(30))
            .with_acquire_timeout(Duration::from_millis(20));
        let guard = locker.try_lock(&name, &quick).await.expect("uncontended");
        assert!(locker.lock(&name, &quick).await.is_err(), "timed out");
        // A wait dropped midway, as by a select! elsewhere.
        let _ = timeout(Duration::from_millis(5), locker.lock(&name, &quick)).await;

        let patient = quick.clone().with_acquire_timeout(Duration::from_secs(20));
        let waiter = {
            let (locker, name) = (locker.clone(), name.clone());
            tokio::spawn(async move {
                let got = locker.lock(&name, &patient).await.expect("granted");
                let at = Instant::now();
                got.release().await.expect("held");
                at
            })
        };
        sleep(Duration::from_millis(50)).await;
        let released_at = Instant::now();
        guard.release().await.expect("held");
        assert_eq!(waiter.await.expect("the waiter ran"), released_at);
    })
    .await
    .expect("the test ran past its bound");
}
