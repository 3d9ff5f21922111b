//! `redis_sentinel::frozen_sentinel_does_not_stall`: with one of three
//! sentinels frozen (SIGSTOP: it accepts connections and never answers), a
//! new backend finds the primary through the other two and takes a lock
//! within one operation timeout.

use std::time::Duration;

use lock_core::backend::AcquireAttempt;
use lock_core::{LockBackend, LockName, OwnerToken};
use tokio::time::{timeout, Instant};

use super::sentinel::SentinelSet;
use super::{config_for, OP_TIMEOUT};
use crate::BoxError;

/// See the module docs. Starts its own deployment, killed on return.
pub async fn frozen_sentinel_does_not_stall() -> Result<(), BoxError> {
    let set = tokio::task::block_in_place(SentinelSet::start)?;
    let outcome = check(&set).await;
    if let Ok(s) = set.sentinel(0) {
        let _ = s.resume();
    }
    tokio::task::block_in_place(move || drop(set));
    outcome
}

async fn check(set: &SentinelSet) -> Result<(), BoxError> {
    set.sentinel(0)?.pause()?;
    let backend = config_for(&set.url())?.with_key_prefix("frozen:").build()?;
    let name = LockName::new("sentinel/frozen")?;
    let owner = OwnerToken::generate()?;
    let started = Instant::now();
    // The backend bounds the call by its operation timeout; the outer bound
    // only keeps a broken one from hanging the test.
    let attempt = timeout(
        OP_TIMEOUT * 10,
        backend.try_acquire(&name, &owner, Duration::from_secs(5)),
    )
    .await
    .map_err(|_| "the acquire hung past ten operation timeouts")?;
    let took = started.elapsed();
    match attempt {
        Ok(AcquireAttempt::Acquired(_)) => {}
        Ok(other) => return Err(format!("a free lock answered {other:?}").into()),
        Err(e) => {
            return Err(format!(
                "the acquire failed after {took:?} with one sentinel of three frozen: {e}"
            )
            .into())
        }
    }
    backend.release(&name, &owner).await?;
    Ok(())
}
