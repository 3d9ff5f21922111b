//! `postgres::standby_is_refused`: against a real streaming standby (made
//! by the standby harness), a lock session on the standby's port alone is
//! refused with the read-only error, and a multi-host URL that lists the
//! standby first with `target_session_attrs=read-write` takes its locks on
//! the primary.

use std::sync::Arc;
use std::time::Duration;

use lock_core::backend::AcquireAttempt;
use lock_core::{BackendErrorKind, LockBackend, LockName, OwnerToken};
use lock_postgres::PostgresBuilder;
use tokio::time::timeout;

use super::standby::PgPair;
use super::PostgresFactory;
use crate::BoxError;

/// Longest the refused connect or the acquire through the URL may take.
const WITHIN: Duration = Duration::from_secs(20);

/// See the module docs.
pub(super) async fn standby_is_refused(_: Arc<PostgresFactory>) -> Result<(), BoxError> {
    let pair = tokio::task::block_in_place(PgPair::start)?;
    let outcome = check(&pair).await;
    tokio::task::block_in_place(move || drop(pair));
    outcome
}

async fn check(pair: &PgPair) -> Result<(), BoxError> {
    let name = LockName::new("standby/refused")?;
    let owner = OwnerToken::generate()?;
    let ttl = Duration::from_secs(5);
    let only_standby = PostgresBuilder::from_url(&pair.standby_url()?)?;
    let attempt = timeout(WITHIN, async {
        let backend = only_standby.connect().await?;
        backend.try_acquire(&name, &owner, ttl).await.map(drop)
    })
    .await
    .map_err(|_| format!("connecting to the standby took over {WITHIN:?}"))?;
    let Err(err) = attempt else {
        return Err("a lock was taken on a standby".into());
    };
    if err.kind() != BackendErrorKind::Config {
        return Err(format!("the standby was refused as {:?}: {err}", err.kind()).into());
    }
    let message = err.to_string();
    for needed in [
        "standby",
        "not replicated",
        "target_session_attrs=read-write",
    ] {
        if !message.contains(needed) {
            return Err(format!("the refusal does not say {needed:?}: {message}").into());
        }
    }
    // The standby first: `read-write` must pass over it to the primary.
    let primary = pair.primary()?;
    let standby = pair.standby()?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port(),
        primary.port()
    );
    let backend = timeout(WITHIN, PostgresBuilder::from_url(&url)?.connect())
        .await
        .map_err(|_| format!("the multi-host URL did not connect within {WITHIN:?}"))??;
    let attempt = timeout(WITHIN, backend.try_acquire(&name, &owner, ttl))
        .await
        .map_err(|_| "the acquire through the multi-host URL hung")??;
    if !matches!(attempt, AcquireAttempt::Acquired(_)) {
        return Err("the free lock was refused through the multi-host URL".into());
    }
    let pid = backend.lock_session_pid(&name).await?;
    let on_primary = tokio::task::block_in_place(|| {
        primary.psql(&format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = {pid}"
        ))
    })?;
    if on_primary.trim() != "1" {
        return Err(format!(
            "pg_locks of the primary shows {} advisory locks of session {pid}, not 1",
            on_primary.trim()
        )
        .into());
    }
    Ok(())
}
