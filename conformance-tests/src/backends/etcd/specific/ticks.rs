//! The etcd `TickStore`: per-job maximum, raised atomically by competing replicas.

use std::sync::Arc;

use libtest_mimic::Failed;
use lock_core::TickStore;

use super::ensure;
use crate::backends::etcd::EtcdFactory;
use crate::Ctx;

/// Two replicas record interleaved ticks at once: the stored tick only
/// rises and ends at the largest; negative ticks and separate jobs work.
pub(super) async fn tick_store_keeps_the_maximum(
    f: Arc<EtcdFactory>,
    ctx: Ctx,
) -> Result<(), Failed> {
    let (a, b) = (f.connect().await?, f.connect().await?);
    let job = ctx.name("job");
    let other = ctx.name("other-job");
    ensure(a.last_completed(&job).await?.is_none(), || {
        "a fresh job has a tick".into()
    })?;
    a.record_completed(&job, -5, std::time::Duration::from_secs(60))
        .await?;
    ensure(a.last_completed(&job).await? == Some(-5), || {
        "negative tick lost".into()
    })?;
    let writers: Vec<_> = [(a.clone(), 0i64), (b.clone(), 1i64)]
        .into_iter()
        .map(|(store, parity)| {
            let job = job.clone();
            tokio::spawn(async move {
                // Each writer goes down as well as up, so a lost race would show.
                for i in 0..40i64 {
                    let tick = 1_000 * (2 * i + parity) * if i % 3 == 0 { -1 } else { 1 };
                    store
                        .record_completed(&job, tick, std::time::Duration::from_secs(60))
                        .await?;
                }
                Ok::<_, lock_core::BackendError>(())
            })
        })
        .collect();
    for w in writers {
        w.await??;
    }
    let max = (0..40i64)
        .flat_map(|i| [0, 1].map(|p| 1_000 * (2 * i + p) * if i % 3 == 0 { -1 } else { 1 }))
        .max()
        .unwrap_or_default();
    let stored = b.last_completed(&job).await?;
    ensure(stored == Some(max), || {
        format!("stored {stored:?}, largest recorded {max}")
    })?;
    a.record_completed(&job, max - 1, std::time::Duration::from_secs(60))
        .await?;
    ensure(a.last_completed(&job).await? == Some(max), || {
        "an older tick lowered it".into()
    })?;
    ensure(b.last_completed(&other).await?.is_none(), || {
        "jobs share ticks".into()
    })?;
    Ok(())
}
