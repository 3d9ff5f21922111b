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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_local_holder_at_a_time_across_threads() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    timeout(BOUND, async {
        let locker = unlocked();
        let inside = Arc::new(AtomicUsize::new(0));
        let granted = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (locker, inside, granted) = (locker.clone(), inside.clone(), granted.clone());
                tokio::spawn(async move {
                    let opts = LockOptions::new(Duration::from_secs(30));
                    for i in 0..2_000 {
                        // Two shared names and one of the task's own, so slots
                        // are reused, contended and swept all at once.
                        let text = match i % 3 {
                            0 => "local/shared-a".to_owned(),
                            1 => "local/shared-b".to_owned(),
                            _ => format!("local/own-{t}-{i}"),
                        };
                        let name = LockName::new(&text).expect("a valid name");
                        let Ok(guard) = locker.try_lock(&name, &opts).await else {
                            continue;
                        };
                        if i % 3 == 0 {
                            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                            tokio::task::yield_now().await;
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                        granted.fetch_add(1, Ordering::SeqCst);
                        guard.release().await.expect("held");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("no holder saw another");
        }
        assert!(
            granted.load(Ordering::SeqCst) >= 8 * 666,
            "every own name was granted"
        );
    })
    .await
    .expect("the test ran past its bound");
}
