//! [`TickStore`] on the same Redis as the locks.

use std::time::Duration;

use redis::FromRedisValue;

use lock_core::tick_record::decode;
use lock_core::{
    async_trait, start_checked_apart, write_ticks_apart, BackendError, LockName, OnStale,
    StartCheck, StartVerdict, TickAnswer, TickRecord, TickStore, TickWrite,
};

use crate::backend::Shared;
use crate::error::protocol;
use crate::scripts::{Lua, RECORD_TICK, WRITE_TICK};
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
        let keep_ms = keep_ms(keep);
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
        let keys = self.record_keys(job, tick);
        let args = write_args(write, keep_ms(keep), tick);
        let after: Option<String> =
            run_write(shared, "write tick record", &WRITE_TICK, &keys, &args).await?;
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

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        if writes.is_empty() {
            return Vec::new();
        }
        if !self.writes_ticks_in_one_call() {
            return write_ticks_apart(self, writes, keep).await;
        }
        self.write_ticks_batch(writes, keep).await
    }

    /// One script over the batch's keys, so not in cluster mode.
    fn checks_starts_in_one_step(&self) -> bool {
        self.writes_ticks_in_one_call()
    }

    async fn start_checked_many(
        &self,
        starts: &[(LockName, i64, TickWrite, StartCheck)],
        keep: Duration,
    ) -> Vec<Result<StartVerdict, BackendError>> {
        if starts.is_empty() {
            return Vec::new();
        }
        if !self.writes_ticks_in_one_call() {
            return start_checked_apart(self, starts, keep).await;
        }
        self.start_checked_batch(starts, keep).await
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

/// `keep` in whole milliseconds, at least 1, as a script argument.
pub(crate) fn keep_ms(keep: Duration) -> String {
    keep.as_millis().max(1).to_string()
}

/// The stale policy as the tick scripts spell it.
fn stale_arg(on_stale: OnStale) -> &'static str {
    match on_stale {
        OnStale::Refuse => "R",
        OnStale::Abandon => "A",
        OnStale::TakeOver => "T",
    }
}

/// The seven arguments of one tick-record write (see `WRITE_TICK`).
pub(crate) fn write_args(write: &TickWrite, keep_ms: String, tick: i64) -> [String; 7] {
    match write {
        TickWrite::Start {
            token,
            replica,
            at,
            on_stale,
        } => [
            "S".to_owned(),
            token.to_string(),
            at.to_string(),
            replica.clone(),
            stale_arg(*on_stale).to_owned(),
            keep_ms,
            tick.to_string(),
        ],
        TickWrite::Complete { token } => [
            "C".to_owned(),
            token.to_string(),
            String::new(),
            String::new(),
            String::new(),
            keep_ms,
            tick.to_string(),
        ],
    }
}

/// Runs a script that writes tick records. With replica acknowledgement a
/// write counts only once enough replicas have it: a failover then cannot
/// lose a `Started` record and let another replica start the tick again.
pub(crate) async fn run_write<T: FromRedisValue + Send + 'static>(
    shared: &Shared,
    op: &'static str,
    script: &'static Lua,
    keys: &[String],
    args: &[String],
) -> Result<T, BackendError> {
    let Some(ack) = &shared.replica_ack else {
        return shared
            .conn
            .run(
                op,
                |mut c| async move { script.run(&mut c, keys, args).await },
            )
            .await;
    };
    let (after, acked) =
        crate::ack::eval_and_wait(&shared.conn, ack, op, script, keys, args).await?;
    if acked < u64::from(ack.replicas()) {
        return Err(BackendError::unavailable(format!(
            "{op} on {}: {acked} of {} replicas acknowledged it within {:?}; \
             not counted (check the replicas' link to the primary)",
            shared.conn.target(),
            ack.replicas(),
            ack.timeout()
        )));
    }
    Ok(after)
}

pub(crate) fn parse_record(
    target: &str,
    value: Option<String>,
) -> Result<Option<TickRecord>, BackendError> {
    value
        .map(|v| decode(&v).ok_or_else(|| protocol("read tick record", target, format!("{v:?}"))))
        .transpose()
}
