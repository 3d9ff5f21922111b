//! Acquiring: a lease, then a put-if-absent transaction; and taking over
//! the key an unanswered earlier attempt of the same call put.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp};
use lock_core::{
    backend::{AcquireAttempt, Lease},
    BackendError, BackendErrorKind, LockName, OwnerToken,
};
use tracing::debug;

use crate::backend::first_kv;
use crate::connection::{Held, Inner};
use crate::error::{convert, protocol};
use crate::lease::lease_seconds;
use crate::members::Attempt;

impl Inner {
    /// One attempt to take `name` for `owner`: grant a lease, then put the
    /// key if it does not exist.
    pub(crate) async fn acquire(
        &self,
        at: Attempt,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        let key = self.key(name);
        let mut kv = at.client.kv_client();
        if self.read_first(name) {
            let existing = kv
                .get(key.as_str(), Some(GetOptions::new().with_count_only()))
                .await
                .map_err(|e| convert(&format!("acquire {key}"), e))?;
            if existing.count() > 0 {
                return Ok(AcquireAttempt::HeldElsewhere);
            }
        }
        let seconds = lease_seconds(ttl);
        let (lease, granted) = self.leases.grant(&at, seconds).await?;
        if granted != seconds {
            debug!(lock = %name, asked = seconds, granted, "etcd changed the lease TTL");
        }
        let put = TxnOp::put(
            key.as_str(),
            owner.to_hex(),
            Some(PutOptions::new().with_lease(lease)),
        );
        let mut txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([put]);
        if at.after_unclear {
            // An earlier attempt of this call may have put the key: read it.
            txn = txn.or_else([TxnOp::get(key.as_str(), None)]);
        }
        let resp = match kv.txn(txn).await {
            Ok(resp) => resp,
            Err(e) => {
                // Revoking also deletes the key if the put did land: nobody
                // believes they hold it, so that is the safe cleanup.
                self.revoke_in_background(lease);
                return Err(convert(&format!("acquire {key}"), e));
            }
        };
        if !resp.succeeded() {
            match first_kv(&resp.op_responses()) {
                Some(kv) if kv.value() == owner.to_hex().as_bytes() => {
                    return self.adopt(&at, name, owner, &kv, lease, seconds).await;
                }
                _ => {
                    self.revoke_in_background(lease);
                    self.note_contended(name, true);
                    return Ok(AcquireAttempt::HeldElsewhere);
                }
            }
        }
        self.note_contended(name, false);
        // The put is the only write of the transaction, so the revision it
        // created is the key's create revision: cluster-wide monotonic.
        let revision = resp
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| protocol("acquire", "transaction answer without a header"))?;
        self.take(name, owner, lease, seconds, revision, revision)
    }

    /// Takes over the key an unanswered earlier attempt of this same call
    /// put with `owner`'s token (`kv`), moving it to `lease`, which this
    /// attempt granted: the earlier attempt's lease is one nobody renews.
    /// The lock was ours from that put on, which came after the call was
    /// sent, so the caller's deadline (counted from the send) is safe, and
    /// its create revision is the fencing token.
    async fn adopt(
        &self,
        at: &Attempt,
        name: &LockName,
        owner: &OwnerToken,
        kv: &KeyValue,
        lease: i64,
        seconds: i64,
    ) -> Result<AcquireAttempt, BackendError> {
        let key = self.key(name);
        let txn = Txn::new()
            .when([
                Compare::value(key.as_str(), CompareOp::Equal, owner.to_hex()),
                Compare::lease(key.as_str(), CompareOp::Equal, kv.lease()),
            ])
            .and_then([TxnOp::put(
                key.as_str(),
                owner.to_hex(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let moved = at.client.kv_client().txn(txn).await;
        self.revoke_in_background(kv.lease());
        match moved {
            Ok(resp) if resp.succeeded() => {
                let revision = resp
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| protocol("acquire", "transaction answer without a header"))?;
                debug!(lock = %name, "took over the key an unanswered attempt had put");
                self.note_contended(name, false);
                self.take(name, owner, lease, seconds, revision, kv.create_revision())
            }
            outcome => {
                // Revoking the earlier lease deletes the key: the name is
                // free again for the next call.
                self.revoke_in_background(lease);
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

    /// Records `owner`'s hold of `name` on `lease`, its key last written at
    /// `revision` and created at `created` (the fencing token).
    fn take(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        lease: i64,
        seconds: i64,
        revision: i64,
        created: i64,
    ) -> Result<AcquireAttempt, BackendError> {
        let fence = u64::try_from(created)
            .map_err(|_| protocol("acquire", "negative revision in the answer"))?;
        self.remember(
            name,
            Held {
                owner: *owner,
                lease,
                seconds,
                revision,
            },
        );
        Ok(AcquireAttempt::Acquired(Lease::new(Some(fence))))
    }
}
