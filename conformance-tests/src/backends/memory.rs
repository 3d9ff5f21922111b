//! The memory backend's factory: replicas share one `MemoryBackend`; plus
//! the memory-specific trials.

mod waiters;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{Capabilities, LockBackend, LockName, OwnerToken, TickStore};
use lock_memory::MemoryBackend;

use crate::{BackendFactory, BoxError, Saboteur, Timing};

pub use waiters::add_specific;

/// Replicas are clones of one [`MemoryBackend`], like processes sharing a server.
#[derive(Debug, Default)]
pub struct MemoryFactory {
    backend: MemoryBackend,
}

impl MemoryFactory {
    /// A factory over a fresh backend.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl BackendFactory for MemoryFactory {
    fn name(&self) -> &str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        self.backend.capabilities()
    }

    fn timing(&self) -> Timing {
        Timing {
            ttl: Duration::from_secs(3),
            tolerance: Duration::from_millis(1),
            paused_clock: true,
        }
    }

    async fn replica(&self) -> Result<Arc<dyn LockBackend>, BoxError> {
        Ok(Arc::new(self.backend.clone()))
    }

    async fn tick_store(&self) -> Result<Option<Arc<dyn TickStore>>, BoxError> {
        Ok(Some(Arc::new(self.backend.clone())))
    }

    async fn saboteur(&self) -> Result<Box<dyn Saboteur>, BoxError> {
        Ok(Box::new(MemorySaboteur {
            backend: self.backend.clone(),
            thief: Mutex::new(None),
        }))
    }
}

struct MemorySaboteur {
    backend: MemoryBackend,
    thief: Mutex<Option<OwnerToken>>,
}

#[async_trait]
impl Saboteur for MemorySaboteur {
    async fn steal(&self, name: &LockName, hold: Duration) -> Result<(), BoxError> {
        let thief = self
            .backend
            .steal(name, hold)
            .ok_or("nothing to steal: the lock was free")?;
        *self.thief.lock().map_err(|_| "poisoned")? = Some(thief);
        Ok(())
    }

    async fn expire(&self, name: &LockName) -> Result<(), BoxError> {
        if self.backend.expire(name) {
            Ok(())
        } else {
            Err("nothing to expire: the lock was free".into())
        }
    }

    async fn thief_holds(&self, name: &LockName) -> Result<bool, BoxError> {
        let thief = *self.thief.lock().map_err(|_| "poisoned")?;
        Ok(thief.is_some() && self.backend.holder(name) == thief)
    }

    async fn clear(&self, name: &LockName) -> Result<(), BoxError> {
        self.backend.expire(name);
        Ok(())
    }
}
