//! The batch calls of [`TickStore`](lock_core::TickStore) on Redis: one
//! `MGET` for reads, one pipeline for records.
//!
//! In cluster mode a batch's keys lie in many slots, which one `MGET` cannot
//! span: there the single calls go out concurrently instead.

use std::time::Duration;

use futures_util::future::join_all;
use lock_core::{BackendError, LockName, TickStore};

use crate::error::protocol;
use crate::scripts::RECORD_TICK;
use crate::RedisBackend;

impl RedisBackend {
    /// The latest completed tick of each of `jobs`, in order.
    pub(crate) async fn last_completed_batch(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        let shared = self.shared();
        if jobs.is_empty() {
            return Vec::new();
        }
        if shared.keys.is_cluster() {
            return join_all(jobs.iter().map(|job| self.last_completed(job))).await;
        }
        let keys: Vec<String> = jobs.iter().map(|job| shared.keys.tick(job)).collect();
        match self.mget("read last ticks", keys).await {
            Ok(values) => values
                .into_iter()
                .map(|v| {
                    v.map(|v| {
                        v.parse::<i64>().map_err(|_| {
                            protocol("read last ticks", shared.conn.target(), format!("{v:?}"))
                        })
                    })
                    .transpose()
                })
                .collect(),
            Err(e) => e.for_each(jobs.len()),
        }
    }

    /// Whether each `(job, tick)` is marked, in order.
    pub(crate) async fn is_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        let shared = self.shared();
        if ticks.is_empty() {
            return Vec::new();
        }
        if shared.keys.is_cluster() {
            return join_all(
                ticks
                    .iter()
                    .map(|(job, tick)| self.is_completed(job, *tick)),
            )
            .await;
        }
        let marks: Vec<String> = ticks
            .iter()
            .map(|(job, tick)| shared.keys.tick_mark(job, *tick))
            .collect();
        // A mark is a string key that expires on its own: `MGET` answers
        // nil for an absent one, as `EXISTS` answers 0.
        match self.mget("read tick marks", marks).await {
            Ok(values) => values.into_iter().map(|v| Ok(v.is_some())).collect(),
            Err(e) => e.for_each(ticks.len()),
        }
    }

    /// Records every `(job, tick)`, one script each, in one pipeline.
    pub(crate) async fn record_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        let shared = self.shared();
        if ticks.is_empty() {
            return Vec::new();
        }
        if shared.keys.is_cluster() {
            return join_all(
                ticks
                    .iter()
                    .map(|(job, tick)| self.record_completed(job, *tick, keep)),
            )
            .await;
        }
        let keep_ms = keep.as_millis().max(1).to_string();
        let mut pipe = redis::pipe();
        for (job, tick) in ticks {
            let keys = [shared.keys.tick(job), shared.keys.tick_mark(job, *tick)];
            // The body, not its SHA: a `NOSCRIPT` would fail the whole
            // pipeline (the script takes a max and sets a mark, so a
            // re-sent one would be harmless, but one round trip is the point).
            pipe.add_command(RECORD_TICK.eval(&keys, &[tick.to_string(), keep_ms.clone()]));
        }
        let done: Result<Vec<i64>, BackendError> = shared
            .conn
            .run("record ticks", |mut c| async move {
                pipe.query_async(&mut c).await
            })
            .await;
        match done {
            Ok(_) => ticks.iter().map(|_| Ok(())).collect(),
            Err(e) => e.for_each(ticks.len()),
        }
    }

    /// One `MGET` of `keys`: a value (or nil) per key, in order.
    async fn mget(
        &self,
        what: &'static str,
        keys: Vec<String>,
    ) -> Result<Vec<Option<String>>, BackendError> {
        let conn = &self.shared().conn;
        let len = keys.len();
        let values: Vec<Option<String>> = conn
            .run(what, |mut c| async move {
                redis::cmd("MGET").arg(keys).query_async(&mut c).await
            })
            .await?;
        if values.len() != len {
            return Err(protocol(
                what,
                conn.target(),
                format!("{} values for {len} keys", values.len()),
            ));
        }
        Ok(values)
    }
}
