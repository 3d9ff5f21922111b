//! A store whose failures a test switches on and off.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use super::{Store, StoreDecision, StoreRequest};
use crate::error::{StoreError, StoreErrorKind};

const UP: u8 = 0;
const REFUSING: u8 = 1;
const HANGING: u8 = 2;

/// Wraps a store; [`refuse`](Self::refuse) makes every call fail at once as
/// a refused connection, [`hang`](Self::hang) makes every call wait forever
/// (a paused server), [`restore`](Self::restore) passes calls through again.
#[derive(Debug, Clone)]
pub struct SwitchStore {
    inner: Arc<dyn Store>,
    state: Arc<AtomicU8>,
}

impl SwitchStore {
    /// Wraps `inner`, passing calls through.
    #[must_use]
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            state: Arc::new(AtomicU8::new(UP)),
        }
    }

    /// Fails every call as a refused connection.
    pub fn refuse(&self) {
        self.state.store(REFUSING, Ordering::SeqCst);
    }

    /// Makes every call wait until dropped.
    pub fn hang(&self) {
        self.state.store(HANGING, Ordering::SeqCst);
    }

    /// Passes calls through again.
    pub fn restore(&self) {
        self.state.store(UP, Ordering::SeqCst);
    }
}

#[async_trait]
impl Store for SwitchStore {
    async fn decide(&self, request: &StoreRequest<'_>) -> Result<StoreDecision, StoreError> {
        match self.state.load(Ordering::SeqCst) {
            REFUSING => Err(StoreError::new(
                StoreErrorKind::Connection,
                "connection refused (switched off by the test)",
            )),
            HANGING => std::future::pending().await,
            _ => self.inner.decide(request).await,
        }
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}
