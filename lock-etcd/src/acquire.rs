//! Acquiring: a put-if-absent transaction on the shared lease of the TTL,
//! sent together with a keep-alive that proves the lease outlives the new
//! lock's local deadline; and taking over the key an unanswered earlier
//! attempt of the same call put.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnResponse};
use lock_core::{
    backend::{AcquireAttempt, Lease},
    BackendError, BackendErrorKind, LockName, OwnerToken,
};
use tokio::time::Instant;
use tracing::debug;

use crate::backend::first_kv;
use crate::connection::{secs, Held, Inner};
use crate::error::{convert, is_lease_not_found, protocol};
use crate::holder::{owned_by, owner_compares};
use crate::lease::lease_seconds;
use crate::members::Attempt;

/// Most shared leases one attempt tries: a lease found lost is replaced once.
const LEASE_TRIES: usize = 2;

impl Inner {
    /// One attempt to take `name` for `owner`: put the key on the shared
    /// lease of `ttl` if it does not exist, while a keep-alive sent after
    /// the attempt started proves that lease lives until at least the
    /// attempt's start plus `ttl`. A put whose answer is lost is deleted
    /// later (see `LockBackend::try_acquire` here); one whose caller went
    /// runs to its answer and is undone then (see `orphan`). `value` is what
    /// the key holds: `owner`'s token, and the holder's data if it named
    /// itself (see `holder`).
    pub(crate) async fn acquire(
        &self,
        at: Attempt,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        value: &str,
    ) -> Result<AcquireAttempt, BackendError> {
        let started = Instant::now();
        if self.shared.has_pending() {
            self.retry_deletes(&at).await;
        }
        let key = self.key(name);
        if self.read_first(name) {
            let existing = at
                .client
                .kv_client()
                .get(key.as_str(), Some(GetOptions::new().with_count_only()))
                .await
                .map_err(|e| convert(&format!("acquire {key}"), e))?;
            if existing.count() > 0 {
                return Ok(AcquireAttempt::HeldElsewhere);
            }
        }
        let seconds = lease_seconds(ttl);
        for _ in 0..LEASE_TRIES {
            let lease = self.shared_lease(&at, seconds).await?;
            if let Some(outcome) = self
                .put_on(&at, name, owner, value, lease, seconds, started)
                .await?
            {
                return Ok(outcome);
            }
        }
        Err(BackendError::new(
            BackendErrorKind::Other,
            format!("acquire {key}: the shared lease was lost twice in a row; try again"),
        ))
    }

    /// Puts the key on `lease`; `None` if that lease turned out to be lost
    /// (the caller tries again on a new one).
    #[allow(clippy::too_many_arguments)] // one attempt's state, passed down once
    async fn put_on(
        &self,
        at: &Attempt,
        name: &LockName,
        owner: &OwnerToken,
        value: &str,
        lease: i64,
        seconds: i64,
        started: Instant,
    ) -> Result<Option<AcquireAttempt>, BackendError> {
        let key = self.key(name);
        let put = TxnOp::put(
            key.as_str(),
            value,
            Some(PutOptions::new().with_lease(lease)),
        );
        let mut txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([put]);
        if at.after_unclear {
            // An earlier attempt of this call may have put the key: read it.
            txn = txn.or_else([TxnOp::get(key.as_str(), None)]);
        }
        // The proof runs beside the put, so a free name costs one round trip.
        let proof = self.prove(at, lease, started, secs(seconds));
        #[cfg(feature = "test-util")]
        let put = self.send_put(name, at.client.kv_client(), txn);
        #[cfg(not(feature = "test-util"))]
        let put = async move { at.client.kv_client().txn(txn).await };
        tokio::pin!(proof, put);
        let mut proved = None;
        let resp: Result<TxnResponse, _> = loop {
            tokio::select! {
                r = &mut put => break r,
                p = &mut proof, if proved.is_none() => proved = Some(p),
            }
        };
        let resp = match resp {
            Ok(resp) => resp,
            Err(e) if is_lease_not_found(&e) => {
                self.shared_lease_ended(lease);
                return Ok(None);
            }
            Err(e) => return Err(convert(&format!("acquire {key}"), e)),
        };
        let (revision, created) = if resp.succeeded() {
            // The put is the only write of the transaction, so the revision
            // it created is the key's create revision: cluster-wide monotonic.
            let revision = header_revision(&resp)?;
            (revision, revision)
        } else {
            match first_kv(&resp.op_responses()) {
                Some(kv) if owned_by(kv.value(), owner) => {
                    match self.adopt(at, name, owner, &kv, lease).await? {
                        Some(revision) => (revision, kv.create_revision()),
                        None => return Ok(None),
                    }
                }
                _ => {
                    self.note_contended(name, true);
                    return Ok(Some(AcquireAttempt::HeldElsewhere));
                }
            }
        };
        let proof = match proved {
            Some(p) => p?,
            None => proof.await?,
        };
        if proof.ttl <= 0 {
            // The lease is gone, and the key with it.
            self.shared_lease_ended(lease);
            return Ok(None);
        }
        self.note_contended(name, false);
        #[cfg(feature = "test-util")]
        self.acquire_pause_point(name).await;
        let held = Held {
            owner: *owner,
            lease,
            seconds,
            revision,
        };
        let taken = self.take(name, held, created, proof.lasts)?;
        #[cfg(feature = "test-util")]
        self.recorded_pause_point(name).await;
        // Whether the lease ended (or was given up here) is asked only once
        // the hold is recorded. `shared_lease_ended` marks the lease dead,
        // then forgets and reports every hold recorded on it: if it forgets
        // this one, the loss is reported to the `Locker`, which keeps it for
        // the lease it is about to hand out. If it ran before the record,
        // the hold is still here on a dead lease whose keys are gone (or
        // going): it is dropped and the attempt goes on with a new lease.
        // Whichever of the two drops the entry answers for it.
        if self.shared.is_dead(lease) && self.forget_lease(name, owner, lease) {
            return Ok(None);
        }
        Ok(Some(taken))
    }

    /// Takes over the key an unanswered earlier attempt of this same call
    /// put with `owner`'s token (`kv`), on `lease`, the shared lease this
    /// attempt uses; a key on an earlier shared lease is moved to it first.
    /// The lock was ours from that put on, which came after the call was
    /// sent, and its create revision is the fencing token. Returns the
    /// revision the key now shows, or `None` if `lease` is lost.
    async fn adopt(
        &self,
        at: &Attempt,
        name: &LockName,
        owner: &OwnerToken,
        kv: &KeyValue,
        lease: i64,
    ) -> Result<Option<i64>, BackendError> {
        if kv.lease() == lease {
            debug!(lock = %name, "an unanswered attempt had put the key");
            return Ok(Some(kv.mod_revision()));
        }
        let key = self.key(name);
        let [lower, upper] = owner_compares(&key, owner);
        // The value (token and holder data) stays as that attempt wrote it.
        let txn = Txn::new()
            .when([
                lower,
                upper,
                Compare::lease(key.as_str(), CompareOp::Equal, kv.lease()),
            ])
            .and_then([TxnOp::put(
                key.as_str(),
                "",
                Some(PutOptions::new().with_lease(lease).with_ignore_value()),
            )]);
        match at.client.kv_client().txn(txn).await {
            Ok(resp) if resp.succeeded() => {
                self.revoke_if_own(kv.lease());
                debug!(lock = %name, "took over the key an unanswered attempt had put");
                header_revision(&resp).map(Some)
            }
            Err(e) if is_lease_not_found(&e) => {
                self.shared_lease_ended(lease);
                Ok(None)
            }
            outcome => {
                let why = match outcome {
                    Err(e) => convert(&format!("acquire {key}"), e).to_string(),
                    Ok(_) => "the key changed meanwhile".to_owned(),
                };
                Err(BackendError::new(
                    BackendErrorKind::Other,
                    format!(
                        "acquire {key}: an unanswered attempt of this call put the key and \
                         taking it over failed ({why}); it is being undone, try again"
                    ),
                ))
            }
        }
    }

    /// Records the hold of `name`, its key created at `created` (the
    /// fencing token) and its lease proven to live `lasts` after the
    /// attempt started (`None`: the whole TTL).
    fn take(
        &self,
        name: &LockName,
        held: Held,
        created: i64,
        lasts: Option<Duration>,
    ) -> Result<AcquireAttempt, BackendError> {
        self.keep_key(name, &held.owner);
        let fence = u64::try_from(created)
            .map_err(|_| protocol("acquire", "negative revision in the answer"))?;
        self.remember(name, held);
        let lease = Lease::new(Some(fence));
        Ok(AcquireAttempt::Acquired(match lasts {
            Some(lasts) => lease.with_lasts_at_least(lasts),
            None => lease,
        }))
    }
}

/// The revision a transaction's answer was made at.
fn header_revision(resp: &TxnResponse) -> Result<i64, BackendError> {
    resp.header()
        .map(|h| h.revision())
        .ok_or_else(|| protocol("acquire", "transaction answer without a header"))
}
