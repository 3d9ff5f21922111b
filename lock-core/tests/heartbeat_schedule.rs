//! The heartbeat among thousands of leases, on tokio's paused clock: every
//! lease renewed on its own schedule, none early, and deadlines enforced at
//! their instant, whatever else is held.

use std::time::Duration;

use lock_core::{LockGuard, LockName, LockOptions, Locker, LossReason, RenewalOutcome};
use lock_memory::MemoryBackend;
use tokio::time::{sleep, sleep_until, timeout, Instant};

mod common;
use common::{locker, BOUND};

async fn take(locker: &Locker, prefix: &str, count: usize, opts: &LockOptions) -> Vec<LockGuard> {
    let mut guards = Vec::with_capacity(count);
    for i in 0..count {
        let name = LockName::new(format!("{prefix}/{i}")).expect("a valid name");
        guards.push(locker.try_lock(&name, opts).await.expect("uncontended"));
    }
    guards
}

#[tokio::test(start_paused = true)]
async fn each_lease_is_renewed_on_its_own_schedule_among_thousands() {
    timeout(BOUND, async {
        let locker = locker(&MemoryBackend::new());
        let start = Instant::now();
        // Interval 1 s (a third of the TTL) and 10 s.
        let short = LockOptions::new(Duration::from_secs(3)).with_metric_label("short");
        let long = LockOptions::new(Duration::from_secs(30)).with_metric_label("long");
        let short_guards = take(&locker, "short", 5_000, &short).await;
        let long_guards = take(&locker, "long", 10, &long).await;
        let renewed = |label| locker.metrics().renewals(label, RenewalOutcome::Renewed);

        // Past the short leases' fifth renewal, before the long ones' first.
        sleep_until(start + Duration::from_millis(5_500)).await;
        assert_eq!(renewed("short"), 5 * 5_000, "five renewals per short lease");
        assert_eq!(
            renewed("long"),
            0,
            "no long lease renewed before its interval"
        );
        assert!(short_guards.iter().all(|g| g.is_held()));

        // Past the long leases' first renewal.
        sleep_until(start + Duration::from_millis(10_500)).await;
        assert_eq!(renewed("long"), 10);
        assert_eq!(renewed("short"), 10 * 5_000);
        assert!(long_guards.iter().chain(&short_guards).all(|g| g.is_held()));
        for g in short_guards.into_iter().chain(long_guards) {
            g.release().await.expect("held");
        }
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn a_max_hold_among_thousands_of_leases_ends_at_its_instant() {
    timeout(BOUND, async {
        let locker = locker(&MemoryBackend::new());
        let opts = LockOptions::new(Duration::from_secs(3));
        let others = take(
            &locker,
            "other",
            5_000,
            &opts.clone().with_metric_label("other"),
        )
        .await;
        let start = Instant::now();
        let watched = opts.clone().with_max_hold(Duration::from_millis(4_500));
        let name = LockName::new("watched").expect("a valid name");
        let guard = locker.try_lock(&name, &watched).await.expect("uncontended");
        let reason = guard.lost().await;
        assert_eq!(reason, LossReason::MaxHoldExceeded);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(4_500),
            "ended at its max_hold"
        );
        assert!(
            others.iter().all(|g| g.is_held()),
            "the others are untouched"
        );
        drop(guard);
        for g in others {
            g.release().await.expect("held");
        }
    })
    .await
    .expect("the test ran past its bound");
}

#[tokio::test(start_paused = true)]
async fn leases_released_before_their_renewal_leave_the_rest_on_schedule() {
    timeout(BOUND, async {
        let locker = locker(&MemoryBackend::new());
        let opts = LockOptions::new(Duration::from_secs(3)).with_metric_label("kept");
        let kept = take(&locker, "kept", 100, &opts).await;
        let start = Instant::now();
        // Many short holds, each released long before its first renewal:
        // each leaves a stale deadline behind.
        let brief = LockOptions::new(Duration::from_secs(3)).with_metric_label("brief");
        for round in 0..20u32 {
            for g in take(&locker, &format!("brief-{round}"), 1_000, &brief).await {
                g.release().await.expect("held");
            }
            sleep(Duration::from_millis(100)).await;
        }
        sleep_until(start + Duration::from_millis(4_500)).await;
        let renewed = |label| locker.metrics().renewals(label, RenewalOutcome::Renewed);
        assert_eq!(renewed("brief"), 0, "a released lease is never renewed");
        assert_eq!(renewed("kept"), 4 * 100);
        assert!(kept.iter().all(|g| g.is_held()));
    })
    .await
    .expect("the test ran past its bound");
}
