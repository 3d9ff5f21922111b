//! [`TickStore`] on the same Redis as the locks.

use std::time::Duration;

use lock_core::tick_record::decode;
use lock_core::{
    async_trait, BackendError, LockName, OnStale, TickAnswer, TickRecord, TickStore, TickWrite,
};

use crate::error::protocol;
use crate::scripts::{RECORD_TICK, WRITE_TICK};
use crate::RedisBackend;

/// Ticks live in `<prefix>#tick:<job>` without expiry, one key per job; a
/// tick's mark in `<prefix>#tick:<job>#<tick>` and its record (the fenced
/// start protocol) in `<prefix>#tick:<job>#<tick>#run`, both expiring after
/// `keep`. In cluster mode the job is the hash tag, so one script reaches
/// all three. With replica acknowledgement on, record writes wait for the
/// replicas like acquires do.
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

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        let shared = self.shared();
        let keys = [
            shared.keys.tick_record(job, tick),
            shared.keys.tick(job),
            shared.keys.tick_mark(job, tick),
        ];
        let keep_ms = keep.as_millis().max(1).to_string();
        let args = match write {
            TickWrite::Start {
                token,
                replica,
                at,
                on_stale,
            } => {
                let stale = match on_stale {
                    OnStale::Refuse => "R",
                    OnStale::Abandon => "A",
                    OnStale::TakeOver => "T",
                };
                [
                    "S".to_owned(),
                    token.to_string(),
                    at.to_string(),
                    replica.clone(),
                    stale.to_owned(),
                    keep_ms,
                    tick.to_string(),
                ]
            }
            TickWrite::Complete { token } => [
                "C".to_owned(),
                token.to_string(),
                String::new(),
                String::new(),
                String::new(),
                keep_ms,
                tick.to_string(),
            ],
        };
        let after: Option<String> = match &shared.replica_ack {
            // With replica acknowledgement a record counts only once enough
            // replicas have it: a failover then cannot lose a Started
            // record and let another replica start the tick again.
            Some(ack) => {
                let (after, acked) = crate::ack::eval_and_wait(
                    &shared.conn,
                    ack,
                    "write tick record",
                    &WRITE_TICK,
                    &keys,
                    &args,
                )
                .await?;
                if acked < u64::from(ack.replicas()) {
                    return Err(BackendError::unavailable(format!(
                        "write tick record on {}: {acked} of {} replicas acknowledged it within {:?}; \
                         not counted (check the replicas' link to the primary)",
                        shared.conn.target(),
                        ack.replicas(),
                        ack.timeout()
                    )));
                }
                after
            }
            None => {
                shared
                    .conn
                    .run("write tick record", |mut c| async move {
                        WRITE_TICK.run(&mut c, &keys, &args).await
                    })
                    .await?
            }
        };
        Ok(write.answer(parse_record(shared.conn.target(), after)?))
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        let shared = self.shared();
        let key = shared.keys.tick_record(job, tick);
        let value: Option<String> = shared
            .conn
            .run("read tick record", |mut c| async move {
                redis::cmd("GET").arg(key).query_async(&mut c).await
            })
            .await?;
        parse_record(shared.conn.target(), value)
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

fn parse_record(target: &str, value: Option<String>) -> Result<Option<TickRecord>, BackendError> {
    value
        .map(|v| decode(&v).ok_or_else(|| protocol("read tick record", target, format!("{v:?}"))))
        .transpose()
}
