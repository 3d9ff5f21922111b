//! Extreme option values on the memory backend, on tokio's paused clock:
//! whatever the TTL, max hold, acquire timeout, renewal interval or retained
//! hold, nothing panics and nothing is left held.

use std::time::Duration;

use lock_core::{LockName, LockOptions, Locker};
use lock_memory::MemoryBackend;
use prometheus::Registry;
use proptest::prelude::*;

fn extreme() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::from_millis(1)),
        Just(Duration::from_secs(1)),
        Just(Duration::from_secs(3600)),
        Just(Duration::from_millis(u64::MAX)),
        Just(Duration::MAX),
        any::<u64>().prop_map(Duration::from_nanos),
    ]
}

fn locker(backend: &MemoryBackend) -> Locker {
    Locker::builder()
        .with_backend(backend.clone())
        .with_registry(&Registry::new())
        .build()
        .expect("locker")
}

/// Runs every entry point with `opts` and the retained `hold`, then checks
/// that a second replica can take the lock once background work settled.
async fn exercise(opts: LockOptions, hold: Duration) {
    let backend = MemoryBackend::new();
    let (a, b) = (locker(&backend), locker(&backend));
    let name = LockName::new("extreme").expect("name");
    if let Ok(g) = a.try_lock(&name, &opts).await {
        let _ = g.assert_held();
        let _ = g.remaining_validity();
        let _ = g.retain_for(hold).await;
    }
    let _ = a
        .with_lock(&name, &opts, |lease| async move { lease.assert_held() })
        .await;
    let wait = opts.clone().with_acquire_timeout(Duration::from_secs(1));
    if let Ok(Ok(g)) = tokio::time::timeout(Duration::from_secs(5), a.lock(&name, &wait)).await {
        drop(g);
    }
    // A retained hold can be up to a year; longer ones are refused. Past it,
    // and past every background release, the lock must be free.
    tokio::time::sleep(Duration::from_secs(366 * 24 * 3600)).await;
    let fresh = LockOptions::new(Duration::from_secs(10));
    let g = b.try_lock(&name, &fresh).await;
    assert!(g.is_ok(), "left held with {opts:?}, hold {hold:?}: {g:?}");
}

/// Runs [`exercise`] on a paused clock in its own thread and fails if it
/// has not finished within ten seconds of real time (all 128 cases
/// together take about one): a background task that
/// spins through paused time (a heartbeat waking every millisecond across a
/// year) would otherwise hang the whole run instead of failing this case.
fn bounded(opts: LockOptions, hold: Duration) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let case = format!("{opts:?}, hold {hold:?}");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(exercise(opts, hold));
        let _ = done_tx.send(());
    });
    match done_rx.recv_timeout(Duration::from_secs(10)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("not finished after ten seconds of real time: {case}")
        }
        // The case panicked; its message is already printed.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("case failed: {case}"),
    }
}

proptest! {
    // Shrinking is bounded in time too: each step of a hanging case costs
    // its ten seconds.
    #![proptest_config(ProptestConfig {
        cases: 128,
        max_shrink_time: 30_000,
        ..ProptestConfig::default()
    })]
    #[test]
    fn no_panic_and_nothing_left_held(
        ttl in extreme(),
        max_hold in proptest::option::of(extreme()),
        timeout in proptest::option::of(extreme()),
        interval in proptest::option::of(extreme()),
        hold in extreme(),
    ) {
        let mut opts = LockOptions::new(ttl);
        if let Some(h) = max_hold { opts = opts.with_max_hold(h); }
        if let Some(t) = timeout { opts = opts.with_acquire_timeout(t); }
        if let Some(i) = interval { opts = opts.with_renew_interval(i); }
        bounded(opts, hold);
    }
}
