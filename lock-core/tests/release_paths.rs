//! Ending a lease before the heartbeat has seen it: a short hold is taken
//! back out of the heartbeat's queue instead of being entered into its table
//! and removed again. These cases check that the lease contract holds on
//! that path as on the long one: every handle sees the end at once, the lock
//! is freed on the server, a loss is still reported, and nothing released is
//! ever renewed. All run on tokio's paused clock.

use std::time::Duration;

use lock_core::{Error, LockName, LockOptions, Locker, LossReason, RenewalOutcome};
use lock_memory::{Counting, Intercepted};
use prometheus::Registry;
use tokio::time::{sleep, timeout};

mod common;
use common::{locker, BOUND};

/// The in-process backend, counting the renewals and releases that reach
/// it.
type Counted = Intercepted<Counting>;

fn name(text: &str) -> LockName {
    LockName::new(text).expect("a valid name")
}

/// 3 s TTL: renewed every second.
fn opts() -> LockOptions {
    LockOptions::new(Duration::from_secs(3))
}

#[tokio::test(start_paused = true)]
async fn a_lease_released_before_the_heartbeat_saw_it_ends_for_every_handle() {
    timeout(BOUND, async {
        let backend = Counted::default();
        let locker = locker(&backend);
        let job = name("short/release");
        // No await between the grant and the release: the heartbeat task
        // cannot have run, so the lease is still in its queue.
        let guard = locker.try_lock(&job, &opts()).await.expect("uncontended");
        let (a, b) = (guard.handle(), guard.handle());
        let token = a.cancellation_token();
        guard.release().await.expect("held until now");

        for handle in [&a, &b] {
            assert!(!handle.is_held(), "a clone still reports the lease held");
            assert_eq!(handle.loss_reason(), Some(LossReason::Released));
            assert!(matches!(
                handle.assert_held(),
                Err(Error::LockLost {
                    reason: LossReason::Released,
                    ..
                })
            ));
        }
        assert!(token.is_cancelled());
        assert_eq!(b.lost().await, LossReason::Released);
        assert_eq!(
            backend.memory().holder(&job),
            None,
            "still held on the server"
        );
        assert_eq!(backend.releases(), 1);

        // Well past several renewal intervals: nothing released is renewed,
        // released again or counted as a loss.
        sleep(Duration::from_secs(10)).await;
        assert_eq!(backend.renewals(), 0);
        assert_eq!(backend.releases(), 1);
        let m = locker.metrics();
        assert_eq!(m.losses("short/release", LossReason::Expired), 0);
        assert_eq!(m.held("short/release"), 0);
        assert_eq!(m.holds_ended("short/release"), 1);
        // The name is free here and on the server.
        let again = locker.try_lock(&job, &opts()).await.expect("free again");
        again.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_guard_dropped_before_the_heartbeat_saw_it_is_still_released() {
    timeout(BOUND, async {
        let backend = Counted::default();
        let locker = locker(&backend);
        let job = name("short/drop");
        let guard = locker.try_lock(&job, &opts()).await.expect("uncontended");
        let handle = guard.handle();
        drop(guard);
        assert_eq!(handle.loss_reason(), Some(LossReason::Released));
        assert!(!handle.is_held());
        // The release runs in the background; give it the turn it needs.
        while backend.memory().holder(&job).is_some() {
            sleep(Duration::from_millis(1)).await;
        }
        sleep(Duration::from_secs(10)).await;
        assert_eq!(backend.releases(), 1, "released once, by the drop");
        assert_eq!(backend.renewals(), 0);
        assert_eq!(locker.metrics().held("short/drop"), 0);
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_lease_lost_on_the_server_before_the_heartbeat_saw_it_is_still_reported() {
    timeout(BOUND, async {
        let backend = Counted::default();
        let locker = locker(&backend);

        // Found by the heartbeat's first renewal: stolen.
        let stolen = name("short/stolen");
        let guard = locker
            .try_lock(&stolen, &opts())
            .await
            .expect("uncontended");
        backend.memory().steal(&stolen, Duration::from_secs(60));
        let handle = guard.handle();
        assert_eq!(handle.lost().await, LossReason::Stolen);
        assert!(!handle.is_held());
        let m = locker.metrics();
        assert_eq!(m.losses("short/stolen", LossReason::Stolen), 1);
        assert_eq!(m.renewals("short/stolen", RenewalOutcome::Stolen), 1);
        assert!(matches!(
            guard.release().await,
            Err(Error::LockLost {
                reason: LossReason::Stolen,
                ..
            })
        ));

        // Found only at the release: the server forgot the lease while it was
        // valid here, before any renewal.
        let forgotten = name("short/forgotten");
        let guard = locker
            .try_lock(&forgotten, &opts())
            .await
            .expect("uncontended");
        assert!(backend.memory().expire(&forgotten));
        assert!(matches!(
            guard.release().await,
            Err(Error::LockLost {
                reason: LossReason::Expired,
                ..
            })
        ));
        assert_eq!(m.losses("short/forgotten", LossReason::Expired), 1);
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn leases_released_in_the_order_taken_are_never_renewed() {
    timeout(BOUND, async {
        let backend = Counted::default();
        let locker = locker(&backend);
        let take = |i: usize| {
            let locker = locker.clone();
            async move {
                let n = name(&format!("many/{i}"));
                locker.try_lock(&n, &opts()).await.expect("uncontended")
            }
        };
        // More than a release looks back through the queue for its lease:
        // the first ones are forgotten the long way, all the same.
        let mut first = Vec::new();
        for i in 0..300 {
            first.push(take(i).await);
        }
        // One lease held throughout, queued among short holds that are taken
        // back out of the queue around it, in no particular order; the
        // heartbeat must still find it and keep renewing it.
        let mut around = Vec::new();
        for i in 300..320 {
            around.push(Some(take(i).await));
        }
        let long = locker
            .try_lock(&name("long"), &opts())
            .await
            .expect("uncontended");
        for i in 320..340 {
            around.push(Some(take(i).await));
        }
        for i in (0..around.len()).step_by(3).chain((0..around.len()).rev()) {
            if let Some(g) = around[i].take() {
                g.release().await.expect("held");
            }
        }
        for g in first {
            g.release().await.expect("held");
        }
        assert_eq!(backend.releases(), 340);
        assert_eq!(
            backend.memory().live_leases(),
            1,
            "only the long lease is left"
        );
        for round in 0..50 {
            let g = locker
                .try_lock(&name("many/0"), &opts())
                .await
                .expect("free again");
            g.release().await.expect("held");
            sleep(Duration::from_millis(100 + round)).await;
        }
        assert!(long.is_held());
        assert_eq!(
            backend.renewals(),
            locker
                .metrics()
                .renewals("long", RenewalOutcome::Renewed)
                .try_into()
                .unwrap_or(usize::MAX),
            "only the long lease was renewed"
        );
        assert!(
            backend.renewals() >= 5,
            "the long lease is renewed every second"
        );
        long.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}

/// The sum of `distributed_lock_held_seconds` over every label.
fn held_seconds(registry: &Registry) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == "distributed_lock_held_seconds")
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_histogram().get_sample_sum())
        .sum()
}

#[tokio::test(start_paused = true)]
async fn the_held_time_runs_from_the_grant_to_the_release() {
    timeout(BOUND, async {
        let registry = Registry::new();
        let locker = Locker::builder()
            .with_backend(Counted::default())
            .with_registry(&registry)
            .build()
            .expect("a fresh registry takes the metrics");
        let released = locker
            .try_lock(&name("held/released"), &opts())
            .await
            .expect("uncontended");
        sleep(Duration::from_millis(2_500)).await;
        released.release().await.expect("held");
        assert_eq!(held_seconds(&registry), 2.5);

        let dropped = locker
            .try_lock(&name("held/dropped"), &opts())
            .await
            .expect("uncontended");
        sleep(Duration::from_millis(1_250)).await;
        drop(dropped);
        assert_eq!(held_seconds(&registry), 3.75);
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_lease_due_before_the_heartbeat_would_wake_wakes_it() {
    timeout(BOUND, async {
        let backend = Counted::default();
        let locker = locker(&backend);
        // The heartbeat settles into sleeping until this lease's first
        // renewal, ten seconds out.
        let long = locker
            .try_lock(
                &name("wake/long"),
                &LockOptions::new(Duration::from_secs(30)),
            )
            .await
            .expect("uncontended");
        sleep(Duration::from_secs(1)).await;
        // Due every 100 ms: only a wake-up by the tracking call renews it.
        let short = locker
            .try_lock(
                &name("wake/short"),
                &LockOptions::new(Duration::from_millis(300)),
            )
            .await
            .expect("uncontended");
        sleep(Duration::from_secs(1)).await;
        assert!(short.is_held(), "the short lease ran out unrenewed");
        assert!(backend.renewals() >= 9, "{} renewals", backend.renewals());
        short.release().await.expect("held");
        long.release().await.expect("held");
    })
    .await
    .expect("the test ran past its bound");
}
