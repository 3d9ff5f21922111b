//! The [`TickStore`] of the memory backend: lock-core's in-process one,
//! shared by every clone of the backend.

use std::time::Duration;

use lock_core::{
    async_trait, BackendError, LockName, TickAnswer, TickRecord, TickStore, TickWrite,
};

use crate::MemoryBackend;

#[async_trait]
impl TickStore for MemoryBackend {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        self.shared.ticks.last_completed(job).await
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        self.shared.ticks.record_completed(job, tick, keep).await
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        self.shared.ticks.is_completed(job, tick).await
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        self.shared.ticks.write_tick(job, tick, write, keep).await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        self.shared.ticks.tick_record(job, tick).await
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        self.shared.ticks.write_ticks_many(writes, keep).await
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        self.shared.ticks.last_completed_many(jobs).await
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        self.shared.ticks.is_completed_many(ticks).await
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        self.shared.ticks.record_completed_many(ticks, keep).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn clones_share_one_tick_store() -> Result<(), Box<dyn std::error::Error>> {
        let (a, other) = (MemoryBackend::new(), MemoryBackend::new());
        let b = a.clone();
        let job = LockName::new("job")?;
        let keep = Duration::from_secs(60);
        a.record_completed(&job, 2_000, keep).await?;
        b.record_completed(&job, 1_000, keep).await?;
        assert_eq!(
            b.last_completed(&job).await?,
            Some(2_000),
            "the maximum, seen by both"
        );
        assert!(a.is_completed(&job, 1_000).await?, "a clone's mark is seen");
        assert_eq!(
            other.last_completed(&job).await?,
            None,
            "backends are apart"
        );
        Ok(())
    }
}
