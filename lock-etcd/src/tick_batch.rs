//! The tick store's batch calls: the reads or records of many jobs in one
//! transaction (up to etcd's `--max-txn-ops` items each), not one per job.
//!
//! A thousand jobs firing at the same instant ask the store together (the
//! scheduler coalesces their calls); answered one round trip per job, each
//! record a raft write of its own, they were most of the scheduler's load on
//! etcd. A batch of records is one raft write per transaction.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{GetOptions, GetResponse, Txn, TxnOp, TxnOpResponse, TxnResponse};
use futures_util::future::join_all;
use lock_core::{lane, BackendError, LockName};

use crate::connection::{Connected, MAX_TXN_OPS};
use crate::error::{convert, protocol};
use crate::ticks::decode;

/// The most records one transaction carries. etcd counts a nested
/// transaction's operations against what its parents left of
/// [`MAX_TXN_OPS`]: a record nests three operations, and its creation of a
/// missing key one more below those.
const RECORDS_PER_TXN: usize = MAX_TXN_OPS - 4;

impl Connected {
    /// [`TickStore::last_completed_many`](lock_core::TickStore::last_completed_many):
    /// the jobs' tick keys read in transactions of gets. Cancel safe.
    pub(crate) async fn last_completed_batch(
        &self,
        jobs: &[LockName],
    ) -> Vec<Result<Option<i64>, BackendError>> {
        let get = |job: &LockName| TxnOp::get(self.tick_key(job), None);
        self.read_batch("read ticks", jobs, get, |got| match got.kvs().first() {
            None => Ok(None),
            Some(kv) => decode(kv.value())
                .map(Some)
                .ok_or_else(|| protocol("read ticks", "a tick key holds no tick value")),
        })
        .await
    }

    /// [`TickStore::is_completed_many`](lock_core::TickStore::is_completed_many):
    /// the ticks' marks counted in transactions of gets. Cancel safe.
    pub(crate) async fn is_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
    ) -> Vec<Result<bool, BackendError>> {
        let get = |(job, tick): &(LockName, i64)| {
            TxnOp::get(
                self.mark_key(job, *tick),
                Some(GetOptions::new().with_count_only()),
            )
        };
        self.read_batch("read tick marks", ticks, get, |got| Ok(got.count() > 0))
            .await
    }

    /// [`TickStore::record_completed_many`](lock_core::TickStore::record_completed_many):
    /// each item's own record transaction, nested in one transaction per
    /// chunk. etcd refuses a transaction that writes one key twice, so a job
    /// with several ticks has them in successive rounds, one per round (in
    /// the order given, as single calls would be). The chunks of a round
    /// write disjoint keys and go together. Not cancel safe: a dropped call
    /// may have recorded any of its rounds.
    pub(crate) async fn record_completed_batch(
        &self,
        ticks: &[(LockName, i64)],
        keep: Duration,
    ) -> Vec<Result<(), BackendError>> {
        let mut out: Vec<Option<Result<(), BackendError>>> =
            (0..ticks.len()).map(|_| None).collect();
        for round in rounds(ticks) {
            let chunks: Vec<&[usize]> = round.chunks(RECORDS_PER_TXN).collect();
            let sent = join_all(chunks.iter().map(|chunk| {
                let records: Vec<TxnOp> = chunk
                    .iter()
                    .filter_map(|&i| ticks.get(i))
                    .map(|(job, tick)| TxnOp::txn(self.record_txn(job, *tick, keep)))
                    .collect();
                self.send("record ticks", Txn::new().and_then(records))
            }))
            .await;
            for (chunk, result) in chunks.iter().zip(sent) {
                let answers = lane::each(result.map(|_| vec![(); chunk.len()]), chunk.len());
                for (&i, answer) in chunk.iter().zip(answers) {
                    if let Some(slot) = out.get_mut(i) {
                        *slot = Some(answer);
                    }
                }
            }
        }
        out.into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| Err(protocol("record ticks", "an item was never sent")))
            })
            .collect()
    }

    /// Reads `items` in read-only transactions of at most [`MAX_TXN_OPS`]
    /// gets (`get` builds an item's), all sent together, and answers each
    /// item's get with `answer`, in order. A transaction that fails fails its
    /// own items only.
    async fn read_batch<I, T>(
        &self,
        what: &str,
        items: &[I],
        get: impl Fn(&I) -> TxnOp,
        answer: impl Fn(&GetResponse) -> Result<T, BackendError>,
    ) -> Vec<Result<T, BackendError>> {
        let sent = join_all(items.chunks(MAX_TXN_OPS).map(|chunk| {
            let gets: Vec<TxnOp> = chunk.iter().map(&get).collect();
            async move {
                let n = gets.len();
                let answered = self.send(what, Txn::new().and_then(gets)).await;
                (n, answered.and_then(|resp| gets_of(resp, n, what)))
            }
        }))
        .await;
        let mut out = Vec::with_capacity(items.len());
        for (n, answered) in sent {
            match answered {
                Ok(gets) => out.extend(gets.iter().map(&answer)),
                Err(e) => out.extend(e.for_each(n)),
            }
        }
        out
    }

    /// Sends one transaction through the members, as every call does.
    pub(crate) async fn send(&self, what: &str, txn: Txn) -> Result<TxnResponse, BackendError> {
        let txn = &txn;
        self.inner
            .members
            .run(self.inner.timeout, what, |at| async move {
                at.client
                    .kv_client()
                    .txn(txn.clone())
                    .await
                    .map_err(|e| convert(what, e))
            })
            .await
    }
}

/// The answers of a transaction of `n` gets, in order.
pub(crate) fn gets_of(
    resp: TxnResponse,
    n: usize,
    what: &str,
) -> Result<Vec<GetResponse>, BackendError> {
    let gets: Vec<GetResponse> = resp
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
        .collect();
    if gets.len() != n {
        return Err(protocol(
            what,
            "a batch of reads answered the wrong number of gets",
        ));
    }
    Ok(gets)
}

/// The items' indexes in rounds that hold each job at most once: a job's
/// k-th item goes in round k.
fn rounds(ticks: &[(LockName, i64)]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&LockName, usize> = HashMap::with_capacity(ticks.len());
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, (job, _)) in ticks.iter().enumerate() {
        let k = seen.entry(job).or_insert(0);
        match rounds.get_mut(*k) {
            Some(round) => round.push(i),
            None => rounds.push(vec![i]),
        }
        *k += 1;
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(text: &str) -> LockName {
        LockName::new(text).expect("a valid name")
    }

    #[test]
    fn a_job_appears_once_per_round_in_the_order_given() {
        let (a, b, c) = (name("a"), name("b"), name("c"));
        let ticks = vec![
            (a.clone(), 1),
            (b.clone(), 1),
            (a.clone(), 2),
            (a.clone(), 3),
            (c, 1),
            (b, 2),
        ];
        assert_eq!(rounds(&ticks), vec![vec![0, 1, 4], vec![2, 5], vec![3]]);
        assert!(rounds(&[]).is_empty());
    }
}
