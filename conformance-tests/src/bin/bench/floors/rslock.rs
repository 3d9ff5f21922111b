//! Redis peer: the same uncontended cycle with the `rslock` crate (Redlock
//! over a single server): `LockManager::lock` + `LockManager::unlock`.
//!
//! Not a floor but another library: it draws no fencing token, publishes no
//! release and keeps no heartbeat, so it shows what this library's extras
//! cost next to a plain Redlock client.

use std::time::Duration;

use async_trait::async_trait;
use conformance_tests::BoxError;
use lock_core::LockName;
use rslock::LockManager;

use super::Floor;

pub(super) struct RslockPeer {
    manager: LockManager,
    prefix: String,
    ttl: Duration,
}

impl RslockPeer {
    pub(super) fn new(url: &str, prefix: &str, ttl: Duration) -> Self {
        let mut manager = LockManager::new(vec![url.to_owned()]);
        // One attempt per cycle, as `try_lock`: a refusal is an error here.
        manager.set_retry(1, Duration::from_millis(1));
        Self {
            manager,
            prefix: format!("{prefix}rslock:"),
            ttl,
        }
    }
}

#[async_trait]
impl Floor for RslockPeer {
    fn describe(&self) -> String {
        "peer rslock 0.10 LockManager::lock + unlock, one server, no retry".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let key = format!("{}{}", self.prefix, name.as_str());
        let lock = self
            .manager
            .lock(key.as_bytes(), self.ttl)
            .await
            .map_err(|e| format!("rslock: {key}: {e}"))?;
        self.manager.unlock(&lock).await;
        Ok(())
    }
}
