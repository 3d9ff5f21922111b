use std::sync::Arc;
use std::time::Duration;

use lock_core::{Error, LockGuard, LockName, LockOptions};
use tokio::task::JoinHandle;

use crate::factory::Replica;

use crate::observe::{OverlapObserver, RacyCounter};
use crate::Ctx;

const REPLICAS: usize = 8;
const ROUNDS: usize = 100;

/// 8 replicas × 100 acquisitions of one name: no two critical sections
/// overlap, and a read-pause-write counter ends exact.
pub(super) async fn mutual_exclusion(ctx: Ctx) {
    let name = ctx.name("contended");
    let opts = ctx.opts().with_acquire_timeout(ctx.timing().ttl * 60);
    let observer = Arc::new(OverlapObserver::default());
    let counter = Arc::new(RacyCounter::default());
    let mut workers = Vec::new();
    for _ in 0..REPLICAS {
        let replica = ctx.replica().await;
        let (name, opts) = (name.clone(), opts.clone());
        let (observer, counter) = (Arc::clone(&observer), Arc::clone(&counter));
        workers.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = replica
                    .locker
                    .lock(&name, &opts)
                    .await
                    .expect("acquire within the timeout");
                observer.enter();
                counter.increment(Duration::from_millis(1)).await;
                guard.assert_held().expect("held throughout a 1 ms section");
                observer.exit();
                guard.release().await.expect("release");
            }
        }));
    }
    for w in workers {
        w.await.expect("worker finished");
    }
    let total = (REPLICAS * ROUNDS) as u64;
    assert_eq!(observer.sections(), total);
    assert_eq!(observer.overlaps(), 0, "critical sections overlapped");
    assert_eq!(counter.value(), total, "the racy counter lost updates");
}

/// How many names a burst takes at once.
const BURST: usize = 100;

/// The names of a burst.
fn burst_names(ctx: &Ctx, what: &str) -> Vec<LockName> {
    (0..BURST)
        .map(|i| ctx.name(&format!("{what}-{i}")))
        .collect()
}

/// `replica` tries every one of `names` at once, each attempt its own task
/// (as when many jobs fire at the same instant).
fn try_all(
    replica: &Replica,
    names: &[LockName],
    opts: &LockOptions,
) -> Vec<JoinHandle<lock_core::Result<LockGuard>>> {
    names
        .iter()
        .map(|name| {
            let (locker, name, opts) = (replica.locker.clone(), name.clone(), opts.clone());
            tokio::spawn(async move { locker.try_lock(&name, &opts).await })
        })
        .collect()
}

/// Whether an attempt won; panics on anything but a win or "held elsewhere".
fn won(name: &LockName, attempt: lock_core::Result<LockGuard>) -> Option<LockGuard> {
    match attempt {
        Ok(guard) => Some(guard),
        Err(Error::HeldElsewhere { .. }) => None,
        Err(e) => panic!("{name}: unexpected error: {e}"),
    }
}

/// Two replicas try all of 100 names at once: each name is won by exactly
/// one of them, the loser's second burst finds every name held, and once
/// the winners release, the losers take every name. A backend that joins
/// concurrent attempts into one request must still answer each attempt for
/// its own name.
pub(super) async fn burst_of_acquires_grants_each_name_once(ctx: Ctx) {
    let replicas = [ctx.replica().await, ctx.replica().await];
    let names = burst_names(&ctx, "burst");
    let opts = ctx.opts();
    let tries = [
        try_all(&replicas[0], &names, &opts),
        try_all(&replicas[1], &names, &opts),
    ];
    let mut guards = Vec::new();
    let mut lost: [Vec<LockName>; 2] = [Vec::new(), Vec::new()];
    let [tries_a, tries_b] = tries;
    for ((name, a), b) in names.iter().zip(tries_a).zip(tries_b) {
        let a = won(name, a.await.expect("attempt task finished"));
        let b = won(name, b.await.expect("attempt task finished"));
        match (a, b) {
            (Some(g), None) => {
                guards.push(g);
                lost[1].push(name.clone());
            }
            (None, Some(g)) => {
                guards.push(g);
                lost[0].push(name.clone());
            }
            (Some(_), Some(_)) => panic!("{name}: both replicas won it"),
            (None, None) => panic!("{name}: neither replica won it"),
        }
    }
    for (replica, names) in replicas.iter().zip(&lost) {
        for (name, again) in names.iter().zip(try_all(replica, names, &opts)) {
            let again = won(name, again.await.expect("attempt task finished"));
            assert!(again.is_none(), "{name}: taken again while held");
        }
    }
    for g in guards {
        g.release().await.expect("release");
    }
    for (replica, names) in replicas.iter().zip(&lost) {
        for (name, again) in names.iter().zip(try_all(replica, names, &opts)) {
            let g = won(name, again.await.expect("attempt task finished"))
                .unwrap_or_else(|| panic!("{name}: still held after its release"));
            g.release().await.expect("release");
        }
    }
}

/// A burst of 100 attempts each given up after 0 to 2 ms (some before they
/// were sent, some in flight, some after their grant) leaves nothing held:
/// another replica then takes every name within half a TTL. A grant that
/// landed after its `Locker` gave up and released would hold its name for
/// a TTL, and for ever on a backend whose locks last as long as a session.
pub(super) async fn cancelled_burst_leaves_nothing(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let names = burst_names(&ctx, "given-up");
    let opts = ctx.opts();
    let tries: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (locker, name, opts) = (a.locker.clone(), name.clone(), opts.clone());
            let patience = Duration::from_micros(20 * i as u64);
            tokio::spawn(async move {
                // A guard won in time is dropped here, which releases it.
                drop(tokio::time::timeout(patience, locker.try_lock(&name, &opts)).await);
            })
        })
        .collect();
    for t in tries {
        t.await.expect("attempt task finished");
    }
    takes_all_within_half_a_ttl(&ctx, &b, &names, &opts, "a given-up attempt").await;
    super::no_warnings_after(&a, &names, "a given-up attempt").await;
}

/// A burst of 100 held locks whose releases are each given up after 0 to
/// 2 ms (some before the release was sent, some in flight, some after it
/// answered) leaves nothing held: another replica then takes every name
/// within half a TTL. A release must go on to its end whether or not its
/// caller waits (a backend that runs the release in its caller's task hands
/// the rest to a task of its own when the caller goes).
pub(super) async fn cancelled_releases_leave_nothing(ctx: Ctx) {
    let (a, b) = (ctx.replica().await, ctx.replica().await);
    let names = burst_names(&ctx, "release-given-up");
    let opts = ctx.opts();
    let mut guards = Vec::with_capacity(names.len());
    for name in &names {
        let g = a.locker.try_lock(name, &opts).await;
        guards.push(g.unwrap_or_else(|e| panic!("{name}: not acquired: {e}")));
    }
    let releases: Vec<_> = guards
        .into_iter()
        .enumerate()
        .map(|(i, guard)| {
            let patience = Duration::from_micros(20 * i as u64);
            tokio::spawn(async move {
                drop(tokio::time::timeout(patience, guard.release()).await);
            })
        })
        .collect();
    for r in releases {
        r.await.expect("release task finished");
    }
    takes_all_within_half_a_ttl(&ctx, &b, &names, &opts, "a given-up release").await;
    super::no_warnings_after(&a, &names, "a given-up release").await;
}

/// `replica` takes every one of `names` (each waiting at most half a TTL)
/// and releases it; a name it cannot take was left held by `cause`.
async fn takes_all_within_half_a_ttl(
    ctx: &Ctx,
    replica: &Replica,
    names: &[LockName],
    opts: &LockOptions,
    cause: &str,
) {
    let wait = opts.clone().with_acquire_timeout(ctx.timing().ttl / 2);
    let takes: Vec<_> = names
        .iter()
        .map(|name| {
            let (locker, name, wait) = (replica.locker.clone(), name.clone(), wait.clone());
            tokio::spawn(async move { (locker.lock(&name, &wait).await, name) })
        })
        .collect();
    for t in takes {
        let (taken, name) = t.await.expect("acquire task finished");
        let g = match taken {
            Ok(g) => g,
            Err(e) => {
                // Tells a lock left held from a waiter that missed its
                // release: one more try, at once.
                let now = match replica.locker.try_lock(&name, opts).await {
                    Ok(g) => {
                        let _ = g.release().await;
                        "free a moment later: the waiter missed its release".to_owned()
                    }
                    Err(again) => format!("still not free: {again}"),
                };
                panic!("{name}: left held by {cause}: {e}; {now}");
            }
        };
        g.release().await.expect("release");
    }
}
