//! `redis_sentinel::replica_refused`: a sentinel that names a replica (it
//! monitors a server that is in fact a replica) must not get a lock taken
//! there: connecting and acquiring are refused as `Unavailable`, and the
//! replica never sees the lock key.

use std::time::Duration;

use lock_core::{BackendErrorKind, LockBackend, LockName, OwnerToken};
use tokio::time::timeout;

use super::sentinel::{start_sentinel, MASTER_NAME};
use super::{config_for, server};
use crate::BoxError;

/// Longest the refused connect or acquire may take.
const WITHIN: Duration = Duration::from_secs(10);

/// See the module docs. Starts its own primary, replica and sentinel, all
/// killed on return (failed or not).
pub async fn replica_refused() -> Result<(), BoxError> {
    let configs = tempfile::Builder::new()
        .prefix("lock-test-sentinel-")
        .tempdir()?;
    let primary = server::start_plain()?;
    let replica = server::start_replica_of(primary.port())?;
    server::replica_link_up(replica.port(), WITHIN).await?;
    let sentinel = start_sentinel(&configs.path().join("sentinel.conf"), replica.port(), 1)?;
    let url = format!(
        "redis+sentinel://127.0.0.1:{}/{MASTER_NAME}",
        sentinel.port()
    );
    let refused = timeout(WITHIN, config_for(&url)?.connect())
        .await
        .map_err(|_| format!("the refused connect took over {WITHIN:?}"))?;
    let Err(err) = refused else {
        return Err("a backend connected to a replica named by a sentinel".into());
    };
    if err.kind() != BackendErrorKind::Unavailable || !err.to_string().contains("not a primary") {
        return Err(format!("the replica was refused as {:?}: {err}", err.kind()).into());
    }
    let backend = config_for(&url)?.with_key_prefix("refused:").build()?;
    let name = LockName::new("sentinel/replica")?;
    let attempt = timeout(
        WITHIN,
        backend.try_acquire(&name, &OwnerToken::generate()?, Duration::from_secs(5)),
    )
    .await
    .map_err(|_| format!("the refused acquire took over {WITHIN:?}"))?;
    match attempt {
        Err(e) if e.kind() == BackendErrorKind::Unavailable => {}
        Err(e) => return Err(format!("the acquire was refused as {:?}: {e}", e.kind()).into()),
        Ok(a) => return Err(format!("an acquire on a replica answered {a:?}").into()),
    }
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{}", replica.port()))?
        .get_multiplexed_async_connection()
        .await?;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("refused:*")
        .query_async(&mut c)
        .await?;
    if !keys.is_empty() {
        return Err(format!("the replica holds lock keys {keys:?}").into());
    }
    drop((sentinel, replica, primary));
    Ok(())
}
