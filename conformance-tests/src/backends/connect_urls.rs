//! `scheduler::connect(url)` against the servers named in the environment:
//! the URL path a service uses builds a working lock backend and tick store.

use std::time::Duration;

use libtest_mimic::{Failed, Trial};
use lock_core::redact::redact_url;
use lock_core::{LockName, LockOptions};
use prometheus::Registry;

/// One trial per server URL in the environment (`REDIS_URL`, `DATABASE_URL`,
/// `ETCD_ENDPOINTS`), named `connect::<variable>`.
pub fn trials(run_id: &str) -> Vec<Trial> {
    let mut urls = Vec::new();
    for var in ["REDIS_URL", "DATABASE_URL"] {
        if let Ok(url) = std::env::var(var) {
            urls.push((var, url));
        }
    }
    if let Ok(endpoints) = std::env::var("ETCD_ENDPOINTS") {
        let hosts: Vec<&str> = endpoints
            .split(',')
            .map(|e| e.trim().trim_start_matches("http://"))
            .collect();
        urls.push(("ETCD_ENDPOINTS", format!("etcd://{}", hosts.join(","))));
    }
    urls.into_iter()
        .map(|(var, url)| {
            let name = format!("ct-{run_id}/connect-{}", var.to_ascii_lowercase());
            Trial::test(
                format!("connect::{}", var.to_ascii_lowercase()),
                move || round_trip(&url, &name),
            )
        })
        .collect()
}

fn round_trip(url: &str, name: &str) -> Result<(), Failed> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let backend = scheduler::connect(url)
            .await
            .map_err(|e| format!("connect({}): {e}", redact_url(url)))?;
        let locker = backend.locker(&Registry::new())?;
        let name = LockName::new(name)?;
        let opts = LockOptions::new(Duration::from_secs(2));
        let guard = locker.try_lock(&name, &opts).await?;
        guard.assert_held()?;
        guard.release().await?;
        let ticks = backend.tick_store();
        ticks
            .record_completed(&name, 2_000, std::time::Duration::from_secs(60))
            .await?;
        ticks
            .record_completed(&name, 1_000, std::time::Duration::from_secs(60))
            .await?;
        let last = ticks.last_completed(&name).await?;
        if last != Some(2_000) {
            return Err(Failed::from(format!(
                "tick store kept {last:?}, expected Some(2000)"
            )));
        }
        // The earlier tick is marked on its own, though it is not the latest.
        let marks = (
            ticks.is_completed(&name, 1_000).await?,
            ticks.is_completed(&name, 1_500).await?,
        );
        if marks != (true, false) {
            return Err(Failed::from(format!(
                "tick marks for 1000 and 1500: {marks:?}, expected (true, false)"
            )));
        }
        Ok(())
    })
}
