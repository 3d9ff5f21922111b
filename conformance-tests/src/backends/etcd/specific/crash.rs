//! A holder that dies without releasing: etcd frees the lock when its lease runs out.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Failed;
use lock_core::{Error, Locker};
use tokio::time::{sleep, Instant};

use super::ensure;
use crate::backends::etcd::EtcdFactory;
use crate::Ctx;

/// A holder whose runtime is torn down mid-hold (its tasks and connections
/// vanish, as in a crash; nothing is released) keeps the lock until its
/// lease expires, and no longer than TTL + 1 s after its last renewal.
pub(super) async fn abandoned_lock_frees_after_ttl(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let name = ctx.name("abandoned");
    let opts = ctx.opts();
    let ttl = opts.ttl();
    let (factory, held_name, held_opts) = (Arc::clone(&f), name.clone(), opts.clone());
    // The "process": a runtime of its own, dropped without running any cleanup.
    let crashed = tokio::task::spawn_blocking(move || -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let held = rt.block_on(async {
            let backend = factory.connect().await.map_err(|e| e.to_string())?;
            let locker = Locker::new(backend).map_err(|e| e.to_string())?;
            let guard = locker
                .try_lock(&held_name, &held_opts)
                .await
                .map_err(|e| e.to_string())?;
            // Let one renewal through, then die just after it.
            sleep(held_opts.renew_interval() + Duration::from_millis(100)).await;
            // A crashed process runs no destructor: nothing may release.
            std::mem::forget(guard);
            Ok::<_, String>(())
        });
        rt.shutdown_background();
        held
    });
    crashed.await??;
    let died_at = Instant::now();
    let b = ctx.replica().await;
    let bound = ttl + Duration::from_secs(1) + ctx.timing().tolerance;
    let mut attempts = 0u32;
    let freed_after = loop {
        attempts += 1;
        match b.locker.try_lock(&name, &opts).await {
            Ok(guard) => {
                let after = died_at.elapsed();
                guard.release().await?;
                break after;
            }
            Err(Error::HeldElsewhere { .. }) if died_at.elapsed() < bound => {
                sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(format!("after {:?}: {e}", died_at.elapsed()).into()),
        }
    };
    ensure(attempts > 1, || {
        "the dead holder's lock was free at once".into()
    })?;
    ensure(freed_after <= bound, || {
        format!("freed after {freed_after:?}")
    })?;
    println!("etcd: a crashed holder's lock was free again {freed_after:?} after the crash (TTL {ttl:?})");
    Ok(())
}
