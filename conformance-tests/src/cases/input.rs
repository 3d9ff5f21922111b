use std::time::Duration;

use lock_core::{Error, LockName, LockOptions};

use crate::Ctx;

/// Bad names and options are clear errors, and never reach the backend.
pub(super) async fn bad_input_is_rejected(ctx: Ctx) {
    for bad in ["", "has space", "star*", "{tag}", "nul\0", "ünï"] {
        assert!(
            matches!(LockName::new(bad), Err(Error::InvalidName { .. })),
            "{bad:?}"
        );
    }
    assert!(matches!(
        LockName::new("x".repeat(201)),
        Err(Error::InvalidName { .. })
    ));

    let (faulty, a) = super::faulty_replica(&ctx, Duration::ZERO).await;
    let name = ctx.name("input");
    let ttl = ctx.timing().ttl;
    let bad_options = [
        LockOptions::new(Duration::ZERO),
        LockOptions::new(ttl).with_max_hold(ttl / 2),
        LockOptions::new(ttl).with_renew_interval(ttl),
        LockOptions::new(ttl).with_renew_interval(Duration::ZERO),
    ];
    for opts in &bad_options {
        assert!(
            matches!(a.locker.try_lock(&name, opts).await, Err(Error::Config(_))),
            "{opts:?}"
        );
        assert!(
            matches!(a.locker.lock(&name, opts).await, Err(Error::Config(_))),
            "{opts:?}"
        );
        let run = a.locker.with_lock(&name, opts, |_| async {}).await;
        assert!(matches!(run, Err(Error::Config(_))), "{opts:?}");
    }
    assert_eq!(faulty.calls(), 0, "invalid input reached the backend");
    let min = ctx.factory().capabilities().min_ttl;
    if min > Duration::from_millis(1) {
        let below = LockOptions::new(min - Duration::from_millis(1));
        assert!(matches!(
            a.locker.try_lock(&name, &below).await,
            Err(Error::Config(_))
        ));
    }
}
