use std::sync::{Arc, Mutex};

use crate::Ctx;

/// Fencing tokens strictly increase across holders on different replicas.
pub(super) async fn fencing_tokens_increase(ctx: Ctx) {
    let name = ctx.name("fenced");
    let opts = ctx.opts().with_acquire_timeout(ctx.timing().ttl * 30);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let replica = ctx.replica().await;
        let (name, opts, seen) = (name.clone(), opts.clone(), Arc::clone(&seen));
        workers.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = replica.locker.lock(&name, &opts).await.expect("acquire");
                let token = guard
                    .fencing_token()
                    .expect("a fencing backend issues tokens");
                // Pushed while holding the lock, so the order is the order of holders.
                seen.lock().expect("lock").push(token);
                guard.release().await.expect("release");
            }
        }));
    }
    for w in workers {
        w.await.expect("worker");
    }
    let seen = seen.lock().expect("lock");
    assert_eq!(seen.len(), 80);
    for pair in seen.windows(2) {
        assert!(
            pair[1] > pair[0],
            "fencing token went from {} to {}",
            pair[0],
            pair[1]
        );
    }
}

/// A lease carries a fencing token exactly when the backend declares them,
/// and a backend that declares them also declares them on the lease (the
/// capability is what users branch on).
pub(super) async fn fencing_declared_matches_tokens(ctx: Ctx) {
    let replica = ctx.replica().await;
    let declared = replica.backend.capabilities().fencing;
    assert_eq!(
        declared,
        ctx.factory().capabilities().fencing,
        "the factory's capabilities disagree with its replicas'"
    );
    let name = ctx.name("declared");
    for _ in 0..2 {
        let guard = replica
            .locker
            .lock(&name, &ctx.opts())
            .await
            .expect("acquire");
        assert_eq!(
            guard.fencing_token().is_some(),
            declared,
            "fencing declared {declared}, token {:?}",
            guard.fencing_token()
        );
        guard.release().await.expect("release");
    }
}
