//! [`TickStore`] on etcd: one key per job, raised only, in one transaction.
//! The batch calls (in `tick_batch`) put many jobs in one transaction.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, Txn, TxnOp};
use lock_core::{
    async_trait, BackendError, LockName, TickAnswer, TickRecord, TickStore, TickWrite,
};

use crate::connection::Connected;
use crate::error::{convert, protocol};

/// Tick keys live under the lock prefix (so one RBAC grant covers both) but
/// behind `#`, a character lock names cannot contain, so they never collide.
const TICKS: &str = "#ticks/";

/// Encodes a tick so that byte order is numeric order: the sign bit flipped,
/// then 20 zero-padded decimal digits. etcd compares values as bytes, so the
/// "only raise" rule becomes a single compare in a transaction.
fn encode(tick: i64) -> String {
    format!("{:020}", (tick as u64) ^ (1 << 63))
}

pub(crate) fn decode(raw: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(raw).ok()?;
    if text.len() != 20 {
        return None;
    }
    let biased: u64 = text.parse().ok()?;
    Some((biased ^ (1 << 63)) as i64)
}

/// Marks of single completed ticks: `#marks/<job>#<encoded tick>`. `#`
/// sorts below every character a name may hold, so one job's marks form a
/// contiguous key range that no other job's marks fall into.
const MARKS: &str = "#marks/";

impl Connected {
    pub(crate) fn tick_key(&self, job: &LockName) -> String {
        format!("{}{TICKS}{}", self.inner.prefix, job.as_str())
    }

    pub(crate) fn mark_key(&self, job: &LockName, tick: i64) -> String {
        format!(
            "{}{MARKS}{}#{}",
            self.inner.prefix,
            job.as_str(),
            encode(tick)
        )
    }

    /// The transaction that records `tick` for `job`: raises the job's
    /// latest tick to it (or creates it), marks the tick, and deletes the
    /// job's marks more than `keep` older than it.
    pub(crate) fn record_txn(&self, job: &LockName, tick: i64, keep: Duration) -> Txn {
        let key = self.tick_key(job);
        let value = encode(tick);
        // Raise an existing value, or create a missing key; a compare on the
        // value of a missing key is false, hence the nested transaction.
        let create = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value.as_str(), None)]);
        // The mark, and the deletion of this job's marks more than `keep`
        // older than it, go in the same transaction whatever the compare.
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        let (first, cut) = (
            self.mark_key(job, i64::MIN),
            self.mark_key(job, tick.saturating_sub(keep_ms)),
        );
        let mark = [
            TxnOp::put(self.mark_key(job, tick), "", None),
            TxnOp::delete(first, Some(DeleteOptions::new().with_range(cut))),
        ];
        Txn::new()
            .when([Compare::value(
                key.as_str(),
                CompareOp::Less,
                value.as_str(),
            )])
            .and_then([
                TxnOp::put(key.as_str(), value.as_str(), None),
                mark[0].clone(),
                mark[1].clone(),
            ])
            .or_else([TxnOp::txn(create), mark[0].clone(), mark[1].clone()])
    }
}

#[async_trait]
impl TickStore for Connected {
    async fn last_completed(&self, job: &LockName) -> Result<Option<i64>, BackendError> {
        let key = &self.tick_key(job);
        self.inner
            .members
            .run(self.inner.timeout, "read tick", |at| async move {
                match self.inner.get_for("read", &at, key).await? {
                    None => Ok(None),
                    Some(kv) => decode(kv.value())
                        .map(Some)
                        .ok_or_else(|| protocol(&format!("read {key}"), "not a tick value")),
                }
            })
            .await
    }

    async fn record_completed(
        &self,
        job: &LockName,
        tick: i64,
        keep: Duration,
    ) -> Result<(), BackendError> {
        let what = format!("record {}", self.tick_key(job));
        self.send(&what, self.record_txn(job, tick, keep))
            .await
            .map(|_| ())
    }

    async fn is_completed(&self, job: &LockName, tick: i64) -> Result<bool, BackendError> {
        let key = &self.mark_key(job, tick);
        self.inner
            .members
            .run(self.inner.timeout, "read tick mark", |at| async move {
                let resp = at
                    .client
                    .kv_client()
                    .get(key.as_str(), Some(GetOptions::new().with_count_only()))
                    .await
                    .map_err(|e| convert(&format!("read {key}"), e))?;
                Ok(resp.count() > 0)
            })
            .await
    }

    async fn write_tick(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        self.write_tick_record(job, tick, write, keep).await
    }

    async fn tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        self.read_tick_record(job, tick).await
    }

    async fn write_ticks_many(
        &self,
        writes: &[(LockName, i64, TickWrite)],
        keep: Duration,
    ) -> Vec<Result<TickAnswer, BackendError>> {
        self.write_tick_records_batch(writes, keep).await
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_orders_like_the_numbers() {
        let ticks = [i64::MIN, -5, -1, 0, 1, 1_700_000_000_000, i64::MAX];
        for pair in ticks.windows(2) {
            assert!(encode(pair[0]) < encode(pair[1]), "{pair:?}");
        }
        for t in ticks {
            assert_eq!(decode(encode(t).as_bytes()), Some(t));
        }
        assert_eq!(decode(b"12"), None);
    }
}
