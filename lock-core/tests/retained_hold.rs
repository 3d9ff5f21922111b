//! A retained hold against manual renewals and refusals, on the memory
//! backend and tokio's paused clock: a renewal with the lease's TTL must
//! never cut a hold short on the server while the handles still say held,
//! and a hold that cannot be set must leave the lock released, not held by
//! nobody.

use std::time::Duration;

use lock_core::{Error, LockBackend, LockGuard, LockName, LockOptions, Locker};
use lock_memory::{Counting, Intercepted};
use tokio::time::{sleep, timeout};

mod common;
use common::{locker, BOUND};

const TTL: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(10);

/// The memory backend, its renewals with the lease's TTL stalled or every
/// renewal refused as a case sets it.
type Gated = Intercepted<Counting>;

fn name() -> LockName {
    LockName::new("retained/renewed").expect("a valid name")
}

/// A gated backend, a locker on it, and another replica's locker on the
/// same memory backend that bypasses the gate.
fn replicas() -> (Gated, Locker, Locker) {
    let backend = Gated::default();
    let (a, b) = (locker(&backend), locker(backend.memory()));
    (backend, a, b)
}

/// Takes the free lock with the TTL and auto-renewal of the cases.
async fn take(a: &Locker) -> LockGuard {
    a.try_lock(&name(), &LockOptions::new(TTL))
        .await
        .expect("free")
}

/// Whether another replica is refused the lock now.
async fn held_elsewhere(other: &Locker) -> bool {
    match other.try_lock(&name(), &LockOptions::new(TTL)).await {
        Err(Error::HeldElsewhere { .. }) => true,
        Ok(g) => {
            g.release().await.expect("release");
            false
        }
        Err(e) => panic!("unexpected error from the other replica: {e}"),
    }
}

/// A clone's `renew()` after `retain_for` keeps the hold: past the TTL the
/// lock is still held on the server, as every handle says.
#[tokio::test(start_paused = true)]
async fn renew_of_a_retained_lease_keeps_its_hold() {
    timeout(BOUND, async {
        let (_backend, a, b) = replicas();
        let guard = take(&a).await;
        let clone = guard.handle();
        guard.retain_for(HOLD).await.expect("retain");
        clone
            .renew()
            .await
            .expect("a retained lease renews as held");
        // Past the TTL a renewal would have set, inside the hold.
        sleep(TTL + Duration::from_secs(1)).await;
        assert!(clone.is_held(), "the hold is not over yet");
        assert!(
            held_elsewhere(&b).await,
            "another replica took the lock while a clone still said held"
        );
        sleep(HOLD).await;
        assert!(!clone.is_held());
        assert!(!held_elsewhere(&b).await, "the hold is over");
    })
    .await
    .expect("the test finishes within its bound");
}

/// A manual renewal still on its way when `retain_for` starts (auto-renewal
/// off) is waited for: its reply cannot set the TTL back under the hold.
#[tokio::test(start_paused = true)]
async fn retain_waits_for_a_manual_renewal_in_flight() {
    timeout(BOUND, async {
        let (backend, a, b) = replicas();
        let opts = LockOptions::new(TTL).with_auto_renew(false);
        let guard = a.try_lock(&name(), &opts).await.expect("free");
        let clone = guard.handle();
        backend.stall_renewals(TTL);
        let entered = backend.renewal_stalled();
        let renewal = tokio::spawn(async move { clone.renew().await });
        entered.await;
        let clone = guard.handle();
        let retain = tokio::spawn(guard.retain_for(HOLD));
        sleep(Duration::from_millis(200)).await;
        // The renewal's reply lands now, after `retain_for` began.
        backend.answer_stalled();
        renewal
            .await
            .expect("renewal task")
            .expect("renewal before the hold");
        retain.await.expect("retain task").expect("retain");
        sleep(TTL + Duration::from_secs(1)).await;
        assert!(clone.is_held(), "the hold is not over yet");
        assert!(
            held_elsewhere(&b).await,
            "a renewal's late reply cut the hold short while the lease said held"
        );
    })
    .await
    .expect("the test finishes within its bound");
}

/// A hold the backend fails to set leaves the lock released (another
/// replica takes it at once), and `Locker::shutdown` has nothing left.
#[tokio::test(start_paused = true)]
async fn a_hold_that_fails_releases_the_lock() {
    timeout(BOUND, async {
        let (backend, a, b) = replicas();
        let guard = take(&a).await;
        let clone = guard.handle();
        backend.refuse_renewals(true);
        let refused = guard.retain_for(HOLD).await;
        assert!(matches!(refused, Err(Error::Backend(_))), "{refused:?}");
        assert!(!clone.is_held());
        assert!(
            !held_elsewhere(&b).await,
            "a failed hold left the lock held"
        );
        a.shutdown(Duration::from_secs(1))
            .await
            .expect("nothing left");
    })
    .await
    .expect("the test finishes within its bound");
}

/// A hold below the backend's minimum TTL is refused and the lock released.
#[tokio::test(start_paused = true)]
async fn a_hold_below_the_minimum_ttl_is_refused_and_released() {
    timeout(BOUND, async {
        let (backend, a, b) = replicas();
        let min = backend.capabilities().min_ttl;
        let guard = take(&a).await;
        let refused = guard.retain_for(min / 2).await;
        assert!(
            matches!(&refused, Err(Error::Config(m)) if m.contains("minimum")),
            "{refused:?}"
        );
        assert!(
            !held_elsewhere(&b).await,
            "a refused hold left the lock held"
        );
    })
    .await
    .expect("the test finishes within its bound");
}
