//! The [`LockBackend`] implementation.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, DeleteOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use lock_core::{
    async_trait,
    backend::{
        AcquireAttempt, Expiry, Lease, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest,
    },
    BackendError, Capabilities, LockBackend, LockName, OwnerToken,
};
use tracing::{debug, warn};

use crate::connection::{classify, Connected, Held, Inner};
use crate::error::{bounded_retry, convert, protocol};
use crate::lease::lease_seconds;

impl Inner {
    pub(crate) async fn get(&self, key: &str) -> Result<Option<KeyValue>, BackendError> {
        let mut resp = self
            .client
            .kv_client()
            .get(key, None)
            .await
            .map_err(|e| convert(&format!("get {key}"), e))?;
        Ok(resp.take_kvs().into_iter().next())
    }

    async fn acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        let key = self.key(name);
        let mut kv = self.client.kv_client();
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
        let (lease, granted) = self.leases.grant(seconds).await?;
        if granted != seconds {
            debug!(lock = %name, asked = seconds, granted, "etcd changed the lease TTL");
        }
        let put = TxnOp::put(
            key.as_str(),
            owner.to_hex(),
            Some(PutOptions::new().with_lease(lease)),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([put]);
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
            self.revoke_in_background(lease);
            self.note_contended(name, true);
            return Ok(AcquireAttempt::HeldElsewhere);
        }
        self.note_contended(name, false);
        // The put is the only write of the transaction, so the revision it
        // created is the key's create revision: cluster-wide monotonic.
        let revision = resp
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| protocol("acquire", "transaction answer without a header"))?;
        let fence = u64::try_from(revision)
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

    async fn check_one(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        let kv = self.get(&self.key(name)).await?;
        let lease = kv.as_ref().map_or(0, KeyValue::lease);
        Ok(classify(kv.as_ref(), owner, lease, 1))
    }

    async fn release_one(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let key = self.key(name);
        let txn = Txn::new()
            .when([Compare::value(
                key.as_str(),
                CompareOp::Equal,
                owner.to_hex(),
            )])
            .and_then([TxnOp::delete(
                key.as_str(),
                Some(DeleteOptions::new().with_prev_key()),
            )]);
        let resp = self
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| convert(&format!("release {key}"), e))?;
        let remembered = self.forget(name, owner);
        if !resp.succeeded() {
            // Our lease, if we still have one, guards nothing now.
            if let Some(held) = remembered {
                self.revoke_in_background(held.lease);
            }
            return Ok(ReleaseOutcome::NotHeld);
        }
        let deleted_lease = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Delete(del) => del.prev_kvs().first().map(KeyValue::lease),
            _ => None,
        });
        let lease = deleted_lease.or(remembered.map(|h| h.lease)).unwrap_or(0);
        if lease != 0 {
            if let Err(e) = self.leases.revoke(lease).await {
                warn!(lock = %name, error = %e, "lock released but its lease was not revoked; it will expire");
            }
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn subscribe(&self, name: &LockName) -> Result<Option<ReleaseSignal>, BackendError> {
        let key = self.key(name);
        let mut stream = self
            .client
            .watch_client()
            .watch(key.as_str(), None)
            .await
            .map_err(|e| convert(&format!("watch {key}"), e))?;
        // The watch only sees deletes after the server created it.
        match stream.message().await {
            Ok(Some(resp)) if resp.created() && !resp.canceled() => {}
            Ok(Some(resp)) => {
                return Err(protocol(
                    &format!("watch {key}"),
                    &format!("not created: {}", resp.cancel_reason()),
                ))
            }
            Ok(None) => {
                return Err(BackendError::unavailable(format!(
                    "watch {key}: stream closed"
                )))
            }
            Err(e) => return Err(convert(&format!("watch {key}"), e)),
        }
        Ok(Some(ReleaseSignal::new(async move {
            // Any end of the stream wakes the waiter too: it just tries again.
            while let Ok(Some(resp)) = stream.message().await {
                let deleted = resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete);
                if deleted || resp.canceled() {
                    break;
                }
            }
        })))
    }
}

pub(crate) fn first_kv(ops: &[TxnOpResponse]) -> Option<KeyValue> {
    ops.iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    })
}

/// What a backend with the minimum lease TTL `min_ttl` can do.
pub(crate) fn capabilities_with(min_ttl: Duration) -> Capabilities {
    Capabilities::new(Expiry::Ttl)
        .with_fencing(true)
        .with_batch_renew(true)
        .with_release_notify(true)
        .with_min_ttl(min_ttl)
}

#[async_trait]
impl LockBackend for Connected {
    fn capabilities(&self) -> Capabilities {
        capabilities_with(self.inner.min_ttl)
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.inner.check_ttl(ttl)?;
        let inner = &self.inner;
        bounded_retry(inner.timeout, "acquire", || inner.acquire(name, owner, ttl)).await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.inner.check_ttl(ttl)?;
        let inner = &self.inner;
        bounded_retry(inner.timeout, "renew", || inner.renew_one(name, owner, ttl)).await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        let inner = &self.inner;
        bounded_retry(inner.timeout, "check", || inner.check_one(name, owner)).await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let inner = &self.inner;
        bounded_retry(inner.timeout, "release", || inner.release_one(name, owner)).await
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        for r in requests {
            self.inner.check_ttl(r.ttl)?;
        }
        let inner = &self.inner;
        bounded_retry(inner.timeout, "renew", || inner.renew_batch(requests)).await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let inner = &self.inner;
        let signal = bounded_retry(inner.timeout, "watch", || inner.subscribe(name)).await?;
        Ok(signal.map(|released| {
            // A waiter woken by a release goes straight to the lease grant:
            // the name is most likely free now, so a read first would only
            // delay the handoff by a round trip.
            let (inner, name) = (Arc::clone(&self.inner), name.clone());
            ReleaseSignal::new(async move {
                released.await;
                inner.note_contended(&name, false);
            })
        }))
    }
}
