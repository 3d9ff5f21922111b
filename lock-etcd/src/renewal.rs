//! Renewal: keep-alive then a revision check of the keys, one lease or many,
//! and re-leasing for a new TTL.
//!
//! Locks on a shared lease cost one keep-alive for all of them; the keys are
//! still checked (one transaction per 128), since only the key shows a theft:
//! first by comparing each key's revision with the write remembered, which
//! answers with one flag, and only if something changed by reading them.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use etcd_client::proto::PbTxnOpResponse;
use etcd_client::{Compare, CompareOp, KeyValue, KvClient, PutOptions, Txn, TxnOp, TxnResponse};
use futures_util::future::try_join_all;
use lock_core::{
    backend::{LeaseStatus, RenewRequest},
    BackendError, BackendErrorKind, LockName, OwnerToken,
};

use crate::connection::{classify_marked, Held, Inner, MAX_TXN_OPS};
use crate::error::{convert, protocol};
use crate::holder::{owned_by, owner_compares};
use crate::inspect::two_kvs;
use crate::lease::lease_seconds;
use crate::members::Attempt;

/// The first key-value of each get in a read-only transaction's answer,
/// moved out of it: a renewal sweep reads thousands, and the client's own
/// accessor would copy every one.
fn first_kvs(mut resp: TxnResponse) -> Result<Vec<Option<KeyValue>>, BackendError> {
    std::mem::take(&mut resp.0.responses)
        .into_iter()
        .map(|op| match op.response {
            Some(PbTxnOpResponse::ResponseRange(range)) => {
                Ok(range.kvs.into_iter().next().map(KeyValue))
            }
            _ => Err(protocol("renew", "batch read answered a non-get")),
        })
        .collect()
}

/// Most attempts to move a key to a new lease while concurrent renewals of
/// the same owner keep moving it.
const RELET_ATTEMPTS: usize = 3;

impl Inner {
    /// The lease behind `owner`'s hold on `name`: remembered, or read from the key.
    async fn resolve(
        &self,
        at: &Attempt,
        name: &LockName,
        owner: &OwnerToken,
        seconds: i64,
    ) -> Result<Result<Held, LeaseStatus>, BackendError> {
        if let Some(held) = self.lease_of(name, owner) {
            return Ok(Ok(held));
        }
        let (kv, mark) = self.read_marked(at, name).await?;
        match classify_marked(
            kv.as_ref(),
            mark.as_ref(),
            owner,
            kv.as_ref().map_or(0, KeyValue::lease),
            1,
        ) {
            LeaseStatus::Held => Ok(Ok(Held {
                owner: *owner,
                lease: kv.as_ref().map_or(0, KeyValue::lease),
                seconds,
                revision: kv.as_ref().map_or(0, KeyValue::mod_revision),
            })),
            status => Ok(Err(status)),
        }
    }

    pub(crate) async fn renew_one(
        &self,
        at: Attempt,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        let seconds = lease_seconds(ttl);
        let held = match self.resolve(&at, name, owner, seconds).await? {
            Ok(held) => held,
            Err(status) => return Ok(status),
        };
        if held.seconds != seconds {
            return self.relet(&at, name, owner, held, seconds).await;
        }
        self.before_sweep(&at).await;
        let ttls = self.keep_alive_leases(&at, &[held.lease]).await?;
        let ttl = ttls.first().copied().unwrap_or(0);
        #[cfg(feature = "test-util")]
        self.renewal_pause_point().await;
        let (kv, mark) = self.read_marked(&at, name).await?;
        let status = classify_marked(kv.as_ref(), mark.as_ref(), owner, held.lease, ttl);
        self.settle(name, owner, held.lease, status);
        Ok(status)
    }

    /// Moves the key to a new lease of `seconds`: keep-alive can only restart
    /// a lease's own TTL, and `retain_for` asks for a different one.
    ///
    /// The move compares the owner token and the lease the key is on, so the
    /// old lease revoked afterwards is always the one the key was read on. If
    /// a concurrent renewal of the same owner moved the key first, the move
    /// starts again from the lease the key is on now.
    async fn relet(
        &self,
        at: &Attempt,
        name: &LockName,
        owner: &OwnerToken,
        held: Held,
        seconds: i64,
    ) -> Result<LeaseStatus, BackendError> {
        let key = self.key(name);
        let (lease, _) = self.leases.grant(at, seconds).await?;
        let mut from = held.lease;
        for _ in 0..RELET_ATTEMPTS {
            let [lower, upper] = owner_compares(&key, owner);
            // The value (token and holder data) stays; only the lease changes.
            let txn = Txn::new()
                .when([
                    lower,
                    upper,
                    Compare::lease(key.as_str(), CompareOp::Equal, from),
                ])
                .and_then([TxnOp::put(
                    key.as_str(),
                    "",
                    Some(PutOptions::new().with_lease(lease).with_ignore_value()),
                )])
                .or_else([
                    TxnOp::get(key.as_str(), None),
                    TxnOp::get(self.mark_key(name), None),
                ]);
            let resp = match at.client.kv_client().txn(txn).await {
                Ok(resp) => resp,
                Err(e) => {
                    self.revoke_in_background(lease);
                    return Err(convert(&format!("renew {key}"), e));
                }
            };
            if resp.succeeded() {
                let revision = resp
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| protocol("renew", "transaction answer without a header"))?;
                let moved = Held {
                    owner: *owner,
                    lease,
                    seconds,
                    revision,
                };
                self.remember(name, moved);
                // The compare proved the key was on `from` until this put;
                // a shared lease stays for the other locks on it.
                self.revoke_if_own(from);
                return Ok(LeaseStatus::Held);
            }
            let (kv, mark) = two_kvs(resp)?;
            match kv {
                Some(kv) if owned_by(kv.value(), owner) => from = kv.lease(),
                kv => {
                    self.revoke_in_background(lease);
                    let status = match classify_marked(kv.as_ref(), mark.as_ref(), owner, from, 0) {
                        LeaseStatus::Held => LeaseStatus::Expired,
                        status => status,
                    };
                    self.settle(name, owner, held.lease, status);
                    return Ok(status);
                }
            }
        }
        self.revoke_in_background(lease);
        Err(BackendError::new(
            BackendErrorKind::Other,
            format!(
                "renew {key}: the key kept moving to other leases of this owner; \
                 concurrent renewals of one lock with different TTLs race, renew again"
            ),
        ))
    }

    /// After a renewal found the lease it judged lost, drops it here and on
    /// the server (a lease of its own; never a shared one). Only if it is still the lease remembered for the lock:
    /// one that a concurrent renewal moved the key to is not this one's to
    /// revoke. The judged lease carries no key of ours (the key is gone,
    /// another owner's, or on this dead lease), so revoking it deletes
    /// nothing anyone holds.
    fn settle(&self, name: &LockName, owner: &OwnerToken, judged: i64, status: LeaseStatus) {
        if status != LeaseStatus::Held && self.forget_lease(name, owner, judged) {
            self.revoke_if_own(judged);
        }
    }

    pub(crate) async fn renew_batch(
        &self,
        at: Attempt,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        let mut out: Vec<Option<LeaseStatus>> = vec![None; requests.len()];
        let mut batch: Vec<(usize, Held)> = Vec::with_capacity(requests.len());
        for (i, (r, held)) in requests.iter().zip(self.leases_of(requests)).enumerate() {
            match held {
                Some(h) if h.seconds == lease_seconds(r.ttl) => batch.push((i, h)),
                // Unknown here or a new TTL: rare, renewed on its own.
                _ => out[i] = Some(self.renew_one(at.clone(), &r.name, &r.owner, r.ttl).await?),
            }
        }
        self.before_sweep(&at).await;
        let ids: Vec<i64> = batch.iter().map(|(_, h)| h.lease).collect();
        let ttls = self.keep_alive_leases(&at, &ids).await?;
        #[cfg(feature = "test-util")]
        self.renewal_pause_point().await;
        // The compares go out together: one wake-up for their answers
        // instead of one per chunk.
        let unchanged = try_join_all(batch.chunks(MAX_TXN_OPS).map(|chunk| {
            let mut kv = at.client.kv_client();
            async move { self.unchanged(&mut kv, requests, chunk).await }
        }))
        .await?;
        let mut kv = at.client.kv_client();
        for (chunk_no, chunk) in batch.chunks(MAX_TXN_OPS).enumerate() {
            let ttl_of = |j: usize| ttls.get(chunk_no * MAX_TXN_OPS + j).copied().unwrap_or(0);
            if unchanged.get(chunk_no).copied().unwrap_or(false) {
                for (j, (i, held)) in chunk.iter().enumerate() {
                    if ttl_of(j) > 0 {
                        out[*i] = Some(LeaseStatus::Held);
                    } else {
                        // Our key on the lease we kept alive, but the lease is gone.
                        let r = &requests[*i];
                        self.settle(&r.name, &r.owner, held.lease, LeaseStatus::Expired);
                        out[*i] = Some(LeaseStatus::Expired);
                    }
                }
                continue;
            }
            let gets: Vec<TxnOp> = chunk
                .iter()
                .map(|(i, _)| TxnOp::get(self.key(&requests[*i].name), None))
                .collect();
            let resp = kv
                .txn(Txn::new().and_then(gets))
                .await
                .map_err(|e| convert("renew (batch read)", e))?;
            let answers = first_kvs(resp)?;
            if answers.len() != chunk.len() {
                return Err(protocol(
                    "renew",
                    "batch read answered the wrong number of gets",
                ));
            }
            let marks = self
                .marks_of_lost(&mut kv, requests, chunk, &answers)
                .await?;
            for (j, (((i, held), kv), mark)) in chunk.iter().zip(answers).zip(marks).enumerate() {
                let r = &requests[*i];
                let status =
                    classify_marked(kv.as_ref(), mark.as_ref(), &r.owner, held.lease, ttl_of(j));
                self.settle(&r.name, &r.owner, held.lease, status);
                if let Some(kv) =
                    kv.filter(|kv| status == LeaseStatus::Held && kv.lease() == held.lease)
                {
                    // Still ours on the same lease but rewritten (an earlier
                    // attempt's put answered late): compare with that write
                    // next time, or this chunk would be read at every sweep.
                    self.advance_revision(&r.name, held, kv.mod_revision());
                }
                out[*i] = Some(status);
            }
        }
        out.into_iter()
            .map(|s| s.ok_or_else(|| protocol("renew", "a lease got no status")))
            .collect()
    }

    /// The marks of forced releases for the keys of `chunk` whose batch read
    /// (`answers`) shows them gone or another owner's, in one more read-only
    /// transaction, sent only when some are: a lost lock is then reported
    /// `forced` if an operator freed it. `None` for every other key.
    async fn marks_of_lost(
        &self,
        kv: &mut KvClient,
        requests: &[RenewRequest],
        chunk: &[(usize, Held)],
        answers: &[Option<KeyValue>],
    ) -> Result<Vec<Option<KeyValue>>, BackendError> {
        let lost: Vec<usize> = chunk
            .iter()
            .zip(answers)
            .enumerate()
            .filter(|(_, ((i, _), kv))| {
                !kv.as_ref()
                    .is_some_and(|kv| owned_by(kv.value(), &requests[*i].owner))
            })
            .map(|(j, _)| j)
            .collect();
        let mut marks = vec![None; chunk.len()];
        if lost.is_empty() {
            return Ok(marks);
        }
        let gets: Vec<TxnOp> = lost
            .iter()
            .map(|j| TxnOp::get(self.mark_key(&requests[chunk[*j].0].name), None))
            .collect();
        let resp = kv
            .txn(Txn::new().and_then(gets))
            .await
            .map_err(|e| convert("renew (read the marks of forced releases)", e))?;
        let found = first_kvs(resp)?;
        if found.len() != lost.len() {
            return Err(protocol(
                "renew",
                "the read of marks answered the wrong number of gets",
            ));
        }
        for (j, mark) in lost.into_iter().zip(found) {
            marks[j] = mark;
        }
        Ok(marks)
    }

    /// Whether every key of `chunk` still shows the write this instance
    /// remembers for it: one transaction of revision compares and no reads,
    /// so its answer carries no key-values. A key's mod revision changes
    /// with any write to it and a deleted key has none, so an unchanged
    /// revision means the key is still ours, on the lease remembered. Most
    /// sweeps stop here; a chunk with any change is read key by key.
    async fn unchanged(
        &self,
        kv: &mut KvClient,
        requests: &[RenewRequest],
        chunk: &[(usize, Held)],
    ) -> Result<bool, BackendError> {
        let compares: Vec<Compare> = chunk
            .iter()
            .map(|(i, held)| {
                Compare::mod_revision(
                    self.key(&requests[*i].name),
                    CompareOp::Equal,
                    held.revision,
                )
            })
            .collect();
        let resp = kv
            .txn(Txn::new().when(compares))
            .await
            .map_err(|e| convert("renew (batch compare)", e))?;
        Ok(resp.succeeded())
    }

    /// Before a sweep keeps leases alive: retries the deletes of releases
    /// that got no answer, and gives up the shared lease of any that stayed
    /// undeleted for a third of its TTL, so this sweep does not keep it alive.
    async fn before_sweep(&self, at: &Attempt) {
        if self.shared.has_pending() {
            self.retry_deletes(at).await;
        }
    }

    /// Keeps `ids` alive, one keep-alive per distinct lease however many
    /// locks share it, and returns each id's TTL in order (0: gone). A
    /// shared lease found gone ends every lock on it at once, through the
    /// loss feed; a lease given up here is not kept alive and counts as gone.
    async fn keep_alive_leases(&self, at: &Attempt, ids: &[i64]) -> Result<Vec<i64>, BackendError> {
        let mut distinct: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| !self.shared.is_dead(*id))
            .collect();
        distinct.sort_unstable();
        distinct.dedup();
        self.abort_rounds_elsewhere(at.member);
        let sent_at = Instant::now();
        let ttls = self.leases.keep_alive(at, &distinct).await?;
        let by_lease: HashMap<i64, i64> = distinct.into_iter().zip(ttls).collect();
        for (&lease, &ttl) in &by_lease {
            if !self.shared.is_shared(lease) {
                continue;
            }
            if ttl > 0 {
                self.note_kept_alive(lease, sent_at, ttl);
            } else {
                self.shared_lease_ended(lease);
            }
        }
        Ok(ids
            .iter()
            .map(|id| by_lease.get(id).copied().unwrap_or(0))
            .collect())
    }
}
