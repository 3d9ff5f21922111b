//! A grant the server keeps for less than the TTL asked for
//! (`Lease::lasts_at_least`, as a backend whose locks share one server-side
//! lease reports when that lease was last proven alive before the attempt):
//! the lock is valid locally only that long, its first renewal comes as much
//! earlier, and a grant too short to use is refused and undone. All on
//! tokio's paused clock.

use std::time::Duration;

use lock_core::backend::AcquireAttempt;
use lock_core::{Error, LockBackend, LockName, LockOptions, LossReason, OwnerToken};
use lock_memory::{Counting, Intercepted};
use tokio::time::{sleep_until, timeout, Instant};

mod common;
use common::{locker, BOUND};

const TTL: Duration = Duration::from_secs(3);

/// The in-process backend granting every lock as kept for only `lasts`,
/// logging its renewal calls.
fn short_grant(lasts: Duration) -> Intercepted<Counting> {
    Intercepted::new(Counting::default().with_grants_lasting(lasts))
}

/// When each renewal call was made.
fn renewals(backend: &Intercepted<Counting>) -> Vec<Instant> {
    backend.renewal_calls().iter().map(|r| r.at).collect()
}

fn name(s: &str) -> LockName {
    LockName::new(format!("short-grant/{s}")).expect("a valid name")
}

#[tokio::test(start_paused = true)]
async fn a_short_grant_is_valid_only_as_long_as_the_server_keeps_it() {
    timeout(BOUND, async {
        let lasts = Duration::from_secs(2);
        let backend = short_grant(lasts);
        let locker = locker(&backend);
        let opts = LockOptions::new(TTL).with_auto_renew(false);
        let start = Instant::now();
        let guard = locker
            .try_lock(&name("valid"), &opts)
            .await
            .expect("uncontended");
        let left = guard.remaining_validity().expect("a backend lease");
        assert_eq!(
            left,
            lasts - opts.drift(),
            "validity counts from what the server keeps, not the TTL"
        );
        assert_eq!(guard.lost().await, LossReason::Expired);
        assert_eq!(
            Instant::now() - start,
            lasts - opts.drift(),
            "the lease ended at the short grant's deadline"
        );
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_short_grant_is_renewed_before_its_deadline_and_kept() {
    timeout(BOUND, async {
        // One second short of the TTL: the first renewal, due one interval
        // (1 s) after the grant for a full one, is due at once.
        let backend = short_grant(Duration::from_millis(2_500));
        let locker = locker(&backend);
        let opts = LockOptions::new(TTL);
        let start = Instant::now();
        let guard = locker
            .try_lock(&name("renewed"), &opts)
            .await
            .expect("uncontended");
        sleep_until(start + Duration::from_secs(10)).await;
        assert!(guard.is_held(), "renewed every interval, never lapsed");
        let renewals = renewals(&backend);
        let first = renewals.first().map(|at| *at - start);
        // Renewals due within an eighth of the interval of each other share
        // a call, so the heartbeat may send one up to 125 ms early.
        assert!(
            first.is_some_and(|d| d <= Duration::from_millis(500)
                && d >= Duration::from_millis(375)),
            "the first renewal comes half a second (the shortfall) before a full grant's: {first:?}"
        );
        guard.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_grant_the_server_keeps_the_full_ttl_is_renewed_as_usual() {
    timeout(BOUND, async {
        let backend = short_grant(TTL * 2);
        let locker = locker(&backend);
        let opts = LockOptions::new(TTL);
        let start = Instant::now();
        let guard = locker
            .try_lock(&name("full"), &opts)
            .await
            .expect("uncontended");
        assert_eq!(guard.remaining_validity(), Some(TTL - opts.drift()));
        sleep_until(start + Duration::from_secs(2)).await;
        let first = renewals(&backend).first().map(|at| *at - start);
        assert!(
            first.is_some_and(|d| d <= Duration::from_secs(1) && d >= Duration::from_millis(875)),
            "a grant longer than the TTL changes nothing: first renewal after {first:?}"
        );
        guard.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_grant_shorter_than_the_drift_is_refused_and_undone() {
    timeout(BOUND, async {
        let backend = short_grant(Duration::from_millis(1));
        let locker = locker(&backend);
        let lock = name("too-short");
        let got = locker.try_lock(&lock, &LockOptions::new(TTL)).await;
        assert!(
            matches!(got, Err(Error::Unavailable { .. })),
            "a grant with no validity left is not a lock: {got:?}"
        );
        // The refused grant is released in the background.
        let other = OwnerToken::generate().expect("entropy");
        let mut free = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if matches!(
                backend.memory().try_acquire(&lock, &other, TTL).await,
                Ok(AcquireAttempt::Acquired(_))
            ) {
                free = true;
                break;
            }
        }
        assert!(free, "the refused grant was not released within a second");
    })
    .await
    .expect("the test ran past its bound");
}
