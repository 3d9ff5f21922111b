//! [`LocalTicks`]: completed scheduler ticks kept in this process.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::tick_record::{TickAnswer, TickRecord, TickWrite};
use crate::{async_trait, BackendError, LockName, TickStore};

/// A [`TickStore`] kept in this process: the latest completed tick of each
/// job and the marks of recent ones, for the memory backend and for a
/// scheduler running unlocked. Nothing is shared with other processes and
/// nothing outlives this one.
#[derive(Debug, Default)]
pub struct LocalTicks {
    jobs: Mutex<HashMap<LockName, Job>>,
}

#[derive(Debug, Default)]
struct Job {
    latest: Option<i64>,
    marks: BTreeSet<i64>,
    runs: BTreeMap<i64, TickRecord>,
}

impl LocalTicks {
    fn jobs(&self) -> MutexGuard<'_, HashMap<LockName, Job>> {
        // Each critical section leaves the map whole: poison carries no half-state.
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl TickStore for LocalTicks {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        Ok(self.jobs().get(job).and_then(|j| j.latest))
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        record(&mut self.jobs(), job, tick, keep);
        Ok(())
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        Ok(write_one(&mut self.jobs(), job, tick, write, keep))
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        Ok(self
            .jobs()
            .get(job)
            .and_then(|j| j.runs.get(&tick).cloned()))
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        let mut map = self.jobs();
        writes
            .iter()
            .map(|(job, tick, write)| Ok(write_one(&mut map, job, *tick, write, keep)))
            .collect()
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        Ok(self
            .jobs()
            .get(job)
            .is_some_and(|j| j.marks.contains(&tick)))
    }

    // The batch calls take the map's lock once for the whole batch.
    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        let map = self.jobs();
        jobs.iter()
            .map(|job| Ok(map.get(job).and_then(|j| j.latest)))
            .collect()
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        let map = self.jobs();
        ticks
            .iter()
            .map(|(job, tick)| Ok(map.get(job).is_some_and(|j| j.marks.contains(tick))))
            .collect()
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        let mut map = self.jobs();
        ticks
            .iter()
            .map(|(job, tick)| {
                record(&mut map, job, *tick, keep);
                Ok(())
            })
            .collect()
    }
}

/// Raises `job`'s latest tick to `tick`, marks it, and drops the marks more
/// than `keep` older than it.
fn record(jobs: &mut HashMap<LockName, Job>, job: &LockName, tick: i64, keep: Duration) {
    let entry = jobs.entry(job.clone()).or_default();
    entry.latest = Some(entry.latest.map_or(tick, |t| t.max(tick)));
    entry.marks.insert(tick);
    // Marks more than `keep` older than this tick may go; the set stays
    // bounded by the ticks of one `keep` window.
    let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
    entry.marks = entry.marks.split_off(&tick.saturating_sub(keep_ms));
}

/// Applies `write` to the record of `tick` under the map's lock (one step),
/// records the tick as completed when it completes, and drops records more
/// than `keep` older than `tick`.
fn write_one(
    jobs: &mut HashMap<LockName, Job>,
    job: &LockName,
    tick: i64,
    write: &TickWrite,
    keep: Duration,
) -> TickAnswer {
    let entry = jobs.entry(job.clone()).or_default();
    if let Some(next) = write.apply(entry.runs.get(&tick)) {
        let completed = matches!(next, TickRecord::Completed { .. });
        entry.runs.insert(tick, next);
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        entry.runs = entry.runs.split_off(&tick.saturating_sub(keep_ms));
        if completed {
            record(jobs, job, tick, keep);
        }
    }
    let after = jobs.get(job).and_then(|j| j.runs.get(&tick).cloned());
    write.answer(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keeps_the_latest_tick_and_recent_marks() -> Result<(), Box<dyn std::error::Error>> {
        let store = LocalTicks::default();
        let (job, other) = (LockName::new("job")?, LockName::new("other")?);
        let keep = Duration::from_millis(100);
        assert_eq!(store.last_completed(&job).await?, None);
        store.record_completed(&job, 1_000, keep).await?;
        store.record_completed(&job, 900, keep).await?;
        assert_eq!(
            store.last_completed(&job).await?,
            Some(1_000),
            "keeps the maximum"
        );
        assert!(
            store.is_completed(&job, 900).await?,
            "an older tick is marked on its own"
        );
        assert!(!store.is_completed(&job, 950).await?);
        assert_eq!(store.last_completed(&other).await?, None, "jobs are apart");
        store.record_completed(&job, 1_200, keep).await?;
        assert!(
            !store.is_completed(&job, 900).await?,
            "marks older than keep go"
        );
        assert!(store.is_completed(&job, 1_200).await?);
        store
            .record_completed(&job, i64::MIN, Duration::MAX)
            .await?;
        assert_eq!(store.last_completed(&job).await?, Some(1_200));
        Ok(())
    }
}
