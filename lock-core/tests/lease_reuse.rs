//! A released guard that held the last reference to its lease leaves the
//! allocation for the next acquire on its thread. These cases check that
//! the lease built in it is a new lease in every respect, and that a lease
//! someone still holds a handle to is never reused. All run on tokio's
//! paused clock, on one thread (so every acquire finds the spare).

use std::time::Duration;

use lock_core::{Error, LockName, LockOptions, LossReason, RenewalOutcome};
use lock_memory::MemoryBackend;
use tokio::time::{sleep, timeout};

mod common;
use common::{locker, BOUND};

fn name(text: &str) -> LockName {
    LockName::new(text).expect("a valid name")
}

#[tokio::test(start_paused = true)]
async fn a_lease_after_a_released_one_starts_fresh() {
    timeout(BOUND, async {
        let backend = MemoryBackend::new();
        let locker = locker(&backend);
        let (first, second) = (name("reuse/first"), name("reuse/second"));

        // Ended with a token asked for, a release and its hold counted:
        // everything a reused allocation must not carry over.
        let guard = locker
            .try_lock(&first, &LockOptions::new(Duration::from_secs(3)))
            .await
            .expect("uncontended");
        drop(guard.cancellation_token());
        guard.release().await.expect("held until now");

        // Other name, label, TTL and a max_hold this time.
        let opts = LockOptions::new(Duration::from_secs(30)).with_max_hold(Duration::from_secs(45));
        let guard = locker.try_lock(&second, &opts).await.expect("uncontended");
        assert_eq!(guard.name(), &second);
        assert_eq!(guard.loss_reason(), None);
        guard.assert_held().expect("a new lease is held");
        let token = guard.cancellation_token();
        assert!(!token.is_cancelled(), "the old lease's token carried over");
        let left = guard.remaining_validity().expect("a backend lease ends");
        assert!(
            left > Duration::from_secs(20) && left <= Duration::from_secs(30),
            "valid for {left:?}: not the new 30 s TTL's validity"
        );
        assert!(backend.holder(&second).is_some(), "not held on the server");
        let m = locker.metrics();
        assert_eq!(m.held("reuse/first"), 0);
        assert_eq!(m.held("reuse/second"), 1);

        // Renewed on its own schedule (every 10 s: the 3 s lease's would
        // have renewed it every second), then ended by its own max_hold,
        // counted once against its own label.
        let handle = guard.handle();
        assert_eq!(handle.lost().await, LossReason::MaxHoldExceeded);
        assert!(token.is_cancelled());
        assert_eq!(m.renewals("reuse/second", RenewalOutcome::Renewed), 4);
        assert_eq!(m.renewals("reuse/first", RenewalOutcome::Renewed), 0);
        assert_eq!(m.losses("reuse/second", LossReason::MaxHoldExceeded), 1);
        assert_eq!(m.losses("reuse/first", LossReason::MaxHoldExceeded), 0);
        assert!(matches!(
            guard.release().await,
            Err(Error::LockLost {
                reason: LossReason::MaxHoldExceeded,
                ..
            })
        ));
        assert_eq!(m.held("reuse/second"), 0);
        assert_eq!(m.holds_ended("reuse/first"), 1);
        assert_eq!(m.holds_ended("reuse/second"), 1);
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_lease_still_seen_by_a_handle_is_not_reused() {
    timeout(BOUND, async {
        let backend = MemoryBackend::new();
        let locker = locker(&backend);
        let job = name("reuse/kept");
        let opts = LockOptions::new(Duration::from_secs(3));

        let guard = locker.try_lock(&job, &opts).await.expect("uncontended");
        let old = guard.handle();
        guard.release().await.expect("held until now");

        // Many acquires of the same name later, and well past renewals,
        // the old handle still sees its own, released lease.
        for _ in 0..8 {
            let guard = locker.try_lock(&job, &opts).await.expect("free again");
            guard.assert_held().expect("a new lease is held");
            assert_eq!(old.loss_reason(), Some(LossReason::Released));
            assert!(!old.is_held());
            sleep(Duration::from_secs(2)).await;
            guard.assert_held().expect("renewed while held");
            guard.release().await.expect("held until now");
        }
        assert_eq!(old.loss_reason(), Some(LossReason::Released));
        assert_eq!(old.lost().await, LossReason::Released);
        assert_eq!(locker.metrics().holds_ended("reuse/kept"), 9);
    })
    .await
    .expect("the test ran past its bound");
}
