use std::sync::Arc;
use std::time::Duration;

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
