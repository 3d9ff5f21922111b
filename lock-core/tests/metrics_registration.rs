//! Registering lock metrics where they already are reuses them: any number of
//! `Locker`s in one process, on the default registry or on one of their own,
//! build and count into the same series.

use std::time::Duration;

use lock_core::{AcquireOutcome, Error, LockMetrics, LockName, LockOptions, Locker};
use prometheus::{IntCounterVec, Opts, Registry};

/// One unlocked acquire of `name` through `locker`, counted as `unlocked`.
async fn acquire_once(locker: &Locker, name: &str) {
    let name = LockName::new(name).expect("valid name");
    let guard = locker
        .try_lock(&name, &LockOptions::new(Duration::from_secs(5)))
        .await
        .expect("an unlocked Locker runs behind the in-process guard");
    guard.release().await.expect("release");
}

/// The value of `distributed_lock_acquisitions_total{lock, outcome}` as the
/// registry exposes it.
fn exposed(registry: &Registry, lock: &str, outcome: &str) -> Option<u64> {
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == "distributed_lock_acquisitions_total")?;
    family.get_metric().iter().find_map(|m| {
        let labels = m.get_label();
        let has = |k: &str, v: &str| labels.iter().any(|l| l.name() == k && l.value() == v);
        (has("lock", lock) && has("outcome", outcome)).then(|| m.get_counter().get_value() as u64)
    })
}

#[tokio::test]
async fn lockers_on_the_default_registry_share_one_series() {
    let explicit = Locker::builder()
        .with_registry(prometheus::default_registry())
        .build()
        .expect("explicit default registry");
    let first = Locker::unlocked().expect("first implicit default registry");
    let second = Locker::unlocked().expect("second implicit default registry");
    let again = Locker::builder()
        .with_registry(&prometheus::default_registry().clone())
        .build()
        .expect("a clone of the default registry");
    for (i, locker) in [&explicit, &first, &second, &again].into_iter().enumerate() {
        acquire_once(locker, &format!("shared/{i}")).await;
    }
    for locker in [&explicit, &first, &second, &again] {
        for i in 0..4 {
            let lock = format!("shared/{i}");
            assert_eq!(
                locker
                    .metrics()
                    .acquisitions(&lock, AcquireOutcome::Unlocked),
                1,
                "{lock}"
            );
        }
    }
    assert_eq!(
        exposed(prometheus::default_registry(), "shared/3", "unlocked"),
        Some(1)
    );
}

#[tokio::test]
async fn a_registry_of_ones_own_is_shared_and_kept_apart() {
    let registry = Registry::new();
    let a = Locker::builder()
        .with_registry(&registry)
        .build()
        .expect("first");
    let b = Locker::builder()
        .with_registry(&registry.clone())
        .build()
        .expect("second, through a clone of the registry");
    acquire_once(&a, "own").await;
    acquire_once(&b, "own").await;
    assert_eq!(a.metrics().acquisitions("own", AcquireOutcome::Unlocked), 2);
    assert_eq!(exposed(&registry, "own", "unlocked"), Some(2));
    let apart = LockMetrics::register(&Registry::new()).expect("another registry");
    assert_eq!(apart.acquisitions("own", AcquireOutcome::Unlocked), 0);
}

#[test]
fn names_taken_by_other_code_are_a_config_error() {
    let registry = Registry::new();
    let foreign = IntCounterVec::new(
        Opts::new(
            "distributed_lock_acquisitions_total",
            "Lock acquisition attempts by outcome.",
        ),
        &["lock", "outcome"],
    )
    .expect("valid metric");
    registry
        .register(Box::new(foreign))
        .expect("foreign metric");
    let err = LockMetrics::register(&registry).expect_err("the names are taken");
    assert!(
        matches!(&err, Error::Config(m) if m.contains("other code")),
        "{err}"
    );
    assert!(registry.gather().is_empty(), "nothing half-registered");
}
