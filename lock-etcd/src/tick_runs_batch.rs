//! The tick records' writes of many ticks at once: per chunk, one
//! transaction reads every record and one writes them all, conditional on
//! none having moved since, instead of a read and a transaction per tick.
//! A chunk whose transaction finds a record moved writes its ticks one by
//! one (`tick_runs.rs`), which reads again.

use std::collections::HashSet;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, Txn, TxnOp};
use futures_util::future::join_all;
use lock_core::tick_record::{decode, encode};
use lock_core::{BackendError, LockName, TickAnswer, TickRecord, TickWrite};

use crate::connection::{Connected, MAX_TXN_OPS};
use crate::error::protocol;

/// Ticks per chunk: each takes a compare and, in the write, a put, a range
/// delete and for a completion the nested record transaction (three
/// operations, and one more below them), all counted against
/// [`MAX_TXN_OPS`].
const TICKS_PER_TXN: usize = MAX_TXN_OPS / 8;

impl Connected {
    /// [`TickStore::write_ticks_many`](lock_core::TickStore::write_ticks_many):
    /// the chunks go together, each answered as its ticks' single writes
    /// would be. A batch naming a job twice is written tick by tick: etcd
    /// refuses a transaction that writes one key twice, and a job's ticks
    /// share its latest-tick key and its prune range. Not cancel safe: a
    /// dropped call may have applied any chunk.
    pub(crate) async fn write_tick_records_batch(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        let mut jobs = HashSet::with_capacity(writes.len());
        if writes.len() < 2 || !writes.iter().all(|(job, _, _)| jobs.insert(job)) {
            return join_all(
                writes
                    .iter()
                    .map(|(job, tick, write)| self.write_tick_record(job, *tick, write, keep)),
            )
            .await;
        }
        let chunks = join_all(
            writes
                .chunks(TICKS_PER_TXN)
                .map(|chunk| self.write_chunk(chunk, keep)),
        )
        .await;
        chunks.into_iter().flatten().collect()
    }

    async fn write_chunk(
        &self,
        chunk: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        let read = self.read_chunk(chunk).await;
        let current = match read {
            Ok(current) => current,
            Err(e) => return e.for_each(chunk.len()),
        };
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let mut compares = Vec::new();
        let mut ops = Vec::new();
        let mut answers = Vec::with_capacity(chunk.len());
        for ((job, tick, write), (record, revision)) in chunk.iter().zip(current) {
            let Some(next) = write.apply(record.as_ref()) else {
                answers.push(write.answer(record));
                continue;
            };
            let key = self.run_key(job, *tick);
            compares.push(if revision == 0 {
                Compare::create_revision(key.as_str(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key.as_str(), CompareOp::Equal, revision)
            });
            let (first, cut) = (
                self.run_key(job, i64::MIN),
                self.run_key(job, tick.saturating_sub(keep_ms)),
            );
            ops.push(TxnOp::put(key.as_str(), encode(&next), None));
            ops.push(TxnOp::delete(
                first,
                Some(DeleteOptions::new().with_range(cut)),
            ));
            if matches!(next, TickRecord::Completed { .. }) {
                ops.push(TxnOp::txn(self.record_txn(job, *tick, keep)));
            }
            answers.push(write.answer(Some(next)));
        }
        if ops.is_empty() {
            return answers.into_iter().map(Ok).collect();
        }
        match self
            .send(
                "write tick records",
                Txn::new().when(compares).and_then(ops),
            )
            .await
        {
            Ok(resp) if resp.succeeded() => answers.into_iter().map(Ok).collect(),
            // A record moved since the read: nothing was written; each tick
            // reads and writes again on its own.
            Ok(_) => {
                join_all(
                    chunk
                        .iter()
                        .map(|(job, tick, write)| self.write_tick_record(job, *tick, write, keep)),
                )
                .await
            }
            Err(e) => e.for_each(chunk.len()),
        }
    }

    /// Every record of `chunk` and its modification revision (0: absent),
    /// in one transaction of gets.
    async fn read_chunk(
        &self,
        chunk: &[(LockName, i64, TickWrite)],
    ) -> Result<Vec<(Option<TickRecord>, i64)>, BackendError> {
        let what = "read tick records";
        let gets: Vec<TxnOp> = chunk
            .iter()
            .map(|(job, tick, _)| TxnOp::get(self.run_key(job, *tick), None))
            .collect();
        let resp = self.send(what, Txn::new().and_then(gets)).await?;
        let gets = crate::tick_batch::gets_of(resp, chunk.len(), what)?;
        gets.iter()
            .map(|got| match got.kvs().first() {
                None => Ok((None, 0)),
                Some(kv) => std::str::from_utf8(kv.value())
                    .ok()
                    .and_then(decode)
                    .map(|r| (Some(r), kv.mod_revision()))
                    .ok_or_else(|| protocol(what, "not a tick record")),
            })
            .collect()
    }
}
