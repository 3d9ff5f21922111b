//! The tick records of the fenced start protocol (lock-core's
//! [`TickWrite`]) on etcd: one key per started tick, each transition one
//! transaction that compares on the record's revision, so it applies only
//! to the record the rule was checked against.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, Txn, TxnOp};
use lock_core::tick_record::{decode, encode};
use lock_core::{BackendError, LockName, TickAnswer, TickRecord, TickWrite};

use crate::connection::Connected;
use crate::error::protocol;

/// Records: `#runs/<job>#<encoded tick>`, a contiguous range per job like
/// the marks, pruned the same way.
const RUNS: &str = "#runs/";

/// How many times a write is checked again after another replica's write
/// moved the record between the read and the transaction. Each retry means
/// the record changed, and a record changes at most three times.
const ATTEMPTS: usize = 5;

impl Connected {
    pub(crate) fn run_key(&self, job: &LockName, tick: i64) -> String {
        format!(
            "{}{RUNS}{}#{:020}",
            self.inner.prefix,
            job.as_str(),
            (tick as u64) ^ (1 << 63)
        )
    }

    /// The record of `tick` and its modification revision (0: absent).
    async fn read_run(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<(Option<TickRecord>, i64), BackendError> {
        let key = &self.run_key(job, tick);
        self.inner
            .members
            .run(self.inner.timeout, "read tick record", |at| async move {
                match self.inner.get_for("read", &at, key).await? {
                    None => Ok((None, 0)),
                    Some(kv) => std::str::from_utf8(kv.value())
                        .ok()
                        .and_then(decode)
                        .map(|r| (Some(r), kv.mod_revision()))
                        .ok_or_else(|| protocol(&format!("read {key}"), "not a tick record")),
                }
            })
            .await
    }

    pub(crate) async fn read_tick_record(
        &self,
        job: &LockName,
        tick: i64,
    ) -> Result<Option<TickRecord>, BackendError> {
        Ok(self.read_run(job, tick).await?.0)
    }

    /// Reads the record, applies the rule, and writes the result in one
    /// transaction conditional on the record's revision being the one read
    /// (and for `Complete`, records the tick as completed in it too).
    pub(crate) async fn write_tick_record(
        &self,
        job: &LockName,
        tick: i64,
        write: &TickWrite,
        keep: Duration,
    ) -> Result<TickAnswer, BackendError> {
        let key = self.run_key(job, tick);
        let what = format!("write {key}");
        for _ in 0..ATTEMPTS {
            let (current, revision) = self.read_run(job, tick).await?;
            let Some(next) = write.apply(current.as_ref()) else {
                return Ok(write.answer(current));
            };
            let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
            let (first, cut) = (
                self.run_key(job, i64::MIN),
                self.run_key(job, tick.saturating_sub(keep_ms)),
            );
            let mut ops = vec![
                TxnOp::put(key.as_str(), encode(&next), None),
                TxnOp::delete(first, Some(DeleteOptions::new().with_range(cut))),
            ];
            if matches!(next, TickRecord::Completed { .. }) {
                ops.push(TxnOp::txn(self.record_txn(job, tick, keep)));
            }
            let unchanged = if revision == 0 {
                Compare::create_revision(key.as_str(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(key.as_str(), CompareOp::Equal, revision)
            };
            let resp = self
                .send(&what, Txn::new().when([unchanged]).and_then(ops))
                .await?;
            if resp.succeeded() {
                return Ok(write.answer(Some(next)));
            }
        }
        Err(protocol(
            &what,
            "the record kept changing under this write; try again",
        ))
    }
}
