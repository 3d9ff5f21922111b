//! [`TickStore`] on the same Redis as the locks.

use std::time::Duration;

use lock_core::{async_trait, BackendError, LockName, TickStore};

use crate::error::protocol;
use crate::scripts::RECORD_TICK;
use crate::RedisBackend;

/// Ticks live in `<prefix>#tick:<job>` without expiry, one key per job.
/// Values are compared as Lua numbers (doubles), exact for Unix milliseconds
/// for the next quarter of a million years.
#[async_trait]
impl TickStore for RedisBackend {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        let shared = self.shared();
        let key = shared.keys.tick(job);
        let value: Option<String> = shared
            .conn
            .run("read last tick", |mut c| async move {
                redis::cmd("GET").arg(key).query_async(&mut c).await
            })
            .await?;
        value
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| protocol("read last tick", shared.conn.target(), format!("{v:?}")))
            })
            .transpose()
    }

    async fn server_time(&self) -> Result<Option<i64>, BackendError> {
        let shared = self.shared();
        let (secs, micros): (i64, i64) = shared
            .conn
            .run("read the server time", |mut c| async move {
                redis::cmd("TIME").query_async(&mut c).await
            })
            .await?;
        Ok(Some(
            secs.saturating_mul(1_000).saturating_add(micros / 1_000),
        ))
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        let shared = self.shared();
        let (key, mark) = (shared.keys.tick(job), shared.keys.tick_mark(job, tick));
        let keep_ms = keep.as_millis().max(1).to_string();
        shared
            .conn
            .run("record tick", |mut c| async move {
                RECORD_TICK
                    .run::<i64>(&mut c, &[key, mark], &[tick.to_string(), keep_ms])
                    .await
            })
            .await
            .map(|_| ())
    }

    async fn last_completed_many(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        self.last_completed_batch(jobs).await
    }

    async fn is_completed_many(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        self.is_completed_batch(ticks).await
    }

    async fn record_completed_many(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        self.record_completed_batch(ticks, keep).await
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        let shared = self.shared();
        let mark = shared.keys.tick_mark(job, tick);
        shared
            .conn
            .run("read tick mark", |mut c| async move {
                redis::cmd("EXISTS").arg(mark).query_async(&mut c).await
            })
            .await
    }
}
