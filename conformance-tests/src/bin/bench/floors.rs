//! The raw protocol floor of each backend: the same work done with the
//! backend's own client and no library on top, measured in the same run.

use std::sync::Arc;

use async_trait::async_trait;
use conformance_tests::{BackendFactory, BoxError};
use lock_core::{LockBackend, LockName, OwnerToken};

/// One uncontended acquire + release cycle without the library.
#[async_trait]
pub(crate) trait Floor: Send + Sync {
    /// What the floor does, for the table.
    fn describe(&self) -> &'static str;
    async fn cycle(&self, name: &LockName) -> Result<(), BoxError>;
}

/// For backends without a separate client (memory): the backend's own
/// single attempts through the trait, without `Locker`.
struct TraitFloor {
    backend: Arc<dyn LockBackend>,
    ttl: std::time::Duration,
}

#[async_trait]
impl Floor for TraitFloor {
    fn describe(&self) -> &'static str {
        "LockBackend::try_acquire + release, no Locker"
    }

    async fn cycle(&self, name: &LockName) -> Result<(), BoxError> {
        let owner = OwnerToken::generate()?;
        self.backend.try_acquire(name, &owner, self.ttl).await?;
        self.backend.release(name, &owner).await?;
        Ok(())
    }
}

/// The floor for `factory`'s backend.
pub(crate) async fn floor_for(
    factory: &Arc<dyn BackendFactory>,
) -> Result<Arc<dyn Floor>, BoxError> {
    Ok(Arc::new(TraitFloor {
        backend: factory.replica().await?,
        ttl: factory.timing().ttl,
    }))
}
