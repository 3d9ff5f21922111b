//! The [`TickStore`] of the memory backend: completed scheduler ticks, per job.

use std::time::Duration;

use lock_core::{async_trait, BackendError, LockName, TickStore};

use crate::MemoryBackend;

#[async_trait]
impl TickStore for MemoryBackend {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        Ok(self.state().ticks.get(job).copied())
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        let mut st = self.state();
        let slot = st.ticks.entry(job.clone()).or_insert(tick);
        *slot = (*slot).max(tick);
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let marks = st.marks.entry(job.clone()).or_default();
        marks.insert(tick);
        let cut = tick.saturating_sub(keep_ms);
        // Only marks more than `keep` older than this tick go.
        *marks = marks.split_off(&cut);
        Ok(())
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        Ok(self
            .state()
            .marks
            .get(job)
            .is_some_and(|m| m.contains(&tick)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> LockName {
        LockName::new(s).expect("valid name")
    }

    #[tokio::test]
    async fn tick_store_keeps_the_maximum() -> Result<(), BackendError> {
        let b = MemoryBackend::new();
        let job = name("job");
        assert_eq!(b.last_completed(&job).await?, None);
        b.record_completed(&job, 2_000, std::time::Duration::from_secs(60))
            .await?;
        b.record_completed(&job, 1_000, std::time::Duration::from_secs(60))
            .await?;
        assert_eq!(b.last_completed(&job).await?, Some(2_000));
        assert!(
            b.is_completed(&job, 1_000).await?,
            "an earlier tick keeps its mark"
        );
        assert!(
            !b.is_completed(&job, 1_500).await?,
            "no mark for a tick never recorded"
        );
        // A tick more than `keep` later prunes the older marks.
        b.record_completed(&job, 70_000, std::time::Duration::from_secs(60))
            .await?;
        assert!(!b.is_completed(&job, 1_000).await?, "pruned");
        assert!(b.is_completed(&job, 70_000).await?);
        Ok(())
    }
}
