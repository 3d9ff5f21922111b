//! `redis::resent_acquire_is_granted_again`: an acquire re-sent after a lost
//! reply (same owner token) is granted, with fencing tokens on and off, and
//! without tokens the fencing counter is never touched.

use std::sync::Arc;

use lock_core::backend::AcquireAttempt;
use lock_core::{LockBackend, LockName, OwnerToken};
use redis::AsyncCommands;

use super::specific::{ensure, plain};
use super::{RedisFactory, TTL};
use crate::BoxError;

pub(super) async fn resent_acquire_is_granted_again(
    factory: Arc<RedisFactory>,
) -> Result<(), BoxError> {
    let mut raw = plain(factory.url()).await?;
    for fenced in [true, false] {
        // A key prefix of its own: every lock under a prefix shares one
        // fencing counter, and other cases take fenced locks on this server
        // meanwhile, so under the suite's prefix the counter moves anyway.
        let backend = factory
            .config()?
            .with_key_prefix(format!("{}resent-{fenced}:", factory.prefix()))
            .with_fencing_tokens(fenced)
            .build()?;
        ensure(
            backend.capabilities().fencing == fenced,
            format!(
                "fencing {fenced}: declared {}",
                backend.capabilities().fencing
            ),
        )?;
        let name = LockName::new(format!("resent-{fenced}-{}", std::process::id()))?;
        let fence_key = backend.fence_key_for(&name);
        let counter_before: Option<i64> = raw.get(&fence_key).await?;
        let (owner, other) = (OwnerToken::generate()?, OwnerToken::generate()?);
        let first = backend.try_acquire(&name, &owner, TTL).await?;
        let again = backend.try_acquire(&name, &owner, TTL).await?;
        let rival = backend.try_acquire(&name, &other, TTL).await?;
        let counter_after: Option<i64> = raw.get(&fence_key).await?;
        backend.release(&name, &owner).await?;
        match (first, again, rival) {
            (
                AcquireAttempt::Acquired(a),
                AcquireAttempt::Acquired(b),
                AcquireAttempt::HeldElsewhere,
            ) => {
                ensure(
                    a.fencing_token.is_some() == fenced && b.fencing_token.is_some() == fenced,
                    format!("fencing {fenced}: tokens {a:?} then {b:?}"),
                )?;
                ensure(
                    a.fencing_token < b.fencing_token || !fenced,
                    format!("the re-sent acquire's token {b:?} is not above {a:?}"),
                )?;
            }
            other => {
                return Err(format!(
                    "fencing {fenced}: first, re-sent and rival acquires gave {other:?}"
                )
                .into())
            }
        }
        ensure(
            fenced || counter_before == counter_after,
            format!("without tokens the counter moved: {counter_before:?} -> {counter_after:?}"),
        )?;
    }
    Ok(())
}
