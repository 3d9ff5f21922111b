//! The [`LockBackend`] implementation.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use etcd_client::{DeleteOptions, EventType, KeyValue, Txn, TxnOp, TxnOpResponse};
use lock_core::backend::LossFeed;
use lock_core::detach::Detachable;
use lock_core::inspect::validate_prefix;
use lock_core::{
    async_trait,
    backend::{AcquireAttempt, Expiry, LeaseStatus, ReleaseOutcome, ReleaseSignal, RenewRequest},
    BackendError, BackendErrorKind, Capabilities, ForceOutcome, Holder, HolderPage, Identity,
    LockBackend, LockName, OwnerToken,
};
use tracing::{debug, warn};

use crate::connection::{classify_marked, Connected, Inner};
use crate::error::{convert, protocol};
use crate::holder::{owner_compares, value_for};
use crate::members::Attempt;
use crate::orphan;

impl Inner {
    pub(crate) async fn get(
        &self,
        at: &Attempt,
        key: &str,
    ) -> Result<Option<KeyValue>, BackendError> {
        self.get_for("get", at, key).await
    }

    /// [`Inner::get`], its error saying `op` (`read`, `get`) of the key.
    pub(crate) async fn get_for(
        &self,
        op: &str,
        at: &Attempt,
        key: &str,
    ) -> Result<Option<KeyValue>, BackendError> {
        let mut resp = at
            .client
            .kv_client()
            .get(key, None)
            .await
            .map_err(|e| convert(&format!("{op} {key}"), e))?;
        Ok(resp.take_kvs().into_iter().next())
    }

    async fn check_one(
        &self,
        at: Attempt,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        let (kv, mark) = self.read_marked(&at, name).await?;
        let lease = kv.as_ref().map_or(0, KeyValue::lease);
        Ok(classify_marked(kv.as_ref(), mark.as_ref(), owner, lease, 1))
    }

    async fn release_one(
        &self,
        at: Attempt,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let key = self.key(name);
        let txn = Txn::new()
            .when(owner_compares(&key, owner))
            .and_then([TxnOp::delete(
                key.as_str(),
                Some(DeleteOptions::new().with_prev_key()),
            )]);
        let resp = at
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| convert(&format!("release {key}"), e))?;
        let remembered = self.forget(name, owner);
        if !resp.succeeded() {
            // Our lease, if we still have one, guards nothing now.
            if let Some(held) = remembered {
                self.revoke_if_own(held.lease);
                if at.after_unclear {
                    // An earlier attempt of this release got no answer, but
                    // the key was ours until then (we still knew its lease):
                    // that attempt deleted it. Reporting `NotHeld` would
                    // count a normal release as a loss.
                    debug!(lock = %name, "an unanswered release attempt had deleted the key");
                    return Ok(ReleaseOutcome::Released);
                }
            }
            return Ok(ReleaseOutcome::NotHeld);
        }
        let deleted_lease = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Delete(del) => del.prev_kvs().first().map(KeyValue::lease),
            _ => None,
        });
        let lease = deleted_lease.or(remembered.map(|h| h.lease)).unwrap_or(0);
        // A shared lease stays: other locks are on it, and new ones will be.
        if lease != 0 && !self.shared.is_shared(lease) {
            if let Err(e) = self.leases.revoke(&at, lease).await {
                warn!(lock = %name, error = %e, "lock released but its lease was not revoked; it will expire");
            }
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn subscribe(
        &self,
        at: Attempt,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let key = self.key(name);
        let mut stream = at
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
        .with_loss_push(true)
}

#[async_trait]
impl LockBackend for Connected {
    fn capabilities(&self) -> Capabilities {
        capabilities_with(self.inner.min_ttl)
    }

    fn loss_feed(&self) -> Option<LossFeed> {
        Some(self.feed())
    }

    async fn try_acquire(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire_with(name, owner, ttl, None).await
    }

    /// Stores `holder` in the key's value beside the owner token, with the
    /// time of the attempt by this process's clock: the same one write.
    async fn try_acquire_as(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: &Identity,
    ) -> Result<AcquireAttempt, BackendError> {
        self.acquire_with(name, owner, ttl, Some(holder)).await
    }

    /// A get of the key and a `LeaseTimeToLive` of its lease: two reads,
    /// no keep-alive. Needs read permission on the key prefix.
    async fn describe(&self, name: &LockName) -> Result<Option<Holder>, BackendError> {
        let inner = &self.inner;
        inner
            .members
            .run(inner.timeout, "describe", |at| inner.describe_one(at, name))
            .await
    }

    /// A range get of the lock keys under `prefix` from the cursor (the
    /// last key of the page before, in hex) and a `LeaseTimeToLive` per
    /// distinct lease on the page. Keys under the prefix that no lock name
    /// can have (the tick store's, the marks of forced releases) are
    /// passed over, so a page may hold fewer than `limit` holders and still
    /// have a next one. Needs read permission on the key prefix.
    async fn list(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<HolderPage, BackendError> {
        validate_prefix(prefix)
            .map_err(|e| BackendError::new(BackendErrorKind::Config, e.to_string()))?;
        let inner = &self.inner;
        inner
            .members
            .run(inner.timeout, "list", |at| {
                inner.list_page(at, prefix, cursor, limit)
            })
            .await
    }

    /// A read of the key, then one transaction comparing its create
    /// revision with `expected_token` that deletes it and leaves a mark on
    /// the holder's lease. Needs read-write permission on the key prefix.
    async fn force_release(
        &self,
        name: &LockName,
        expected_token: u64,
    ) -> Result<ForceOutcome, BackendError> {
        let inner = &self.inner;
        // What an attempt that got no answer tried to free, so that a later
        // attempt can tell its work from a release by someone else.
        let tried = std::sync::Mutex::new(None);
        inner
            .members
            .run(inner.timeout, "force release", |at| {
                inner.force_one(at, name, expected_token, &tried)
            })
            .await
    }

    async fn renew(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
    ) -> Result<LeaseStatus, BackendError> {
        self.inner.check_ttl(ttl)?;
        let inner = &self.inner;
        inner
            .members
            .run(inner.timeout, "renew", |at| {
                inner.renew_one(at, name, owner, ttl)
            })
            .await
    }

    async fn check(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<LeaseStatus, BackendError> {
        let inner = &self.inner;
        inner
            .members
            .run(inner.timeout, "check", |at| {
                inner.check_one(at, name, owner)
            })
            .await
    }

    async fn release(
        &self,
        name: &LockName,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, BackendError> {
        let inner = &self.inner;
        let outcome = inner
            .members
            .run(inner.timeout, "release", |at| {
                inner.release_one(at, name, owner)
            })
            .await;
        if outcome.is_err() {
            inner.release_failed(name, owner);
        }
        outcome
    }

    async fn renew_many(
        &self,
        requests: &[RenewRequest],
    ) -> Result<Vec<LeaseStatus>, BackendError> {
        for r in requests {
            self.inner.check_ttl(r.ttl)?;
        }
        let inner = &self.inner;
        inner
            .members
            .run(inner.timeout, "renew", |at| inner.renew_batch(at, requests))
            .await
    }

    async fn subscribe_release(
        &self,
        name: &LockName,
    ) -> Result<Option<ReleaseSignal>, BackendError> {
        let inner = &self.inner;
        let signal = inner
            .members
            .run(inner.timeout, "watch", |at| inner.subscribe(at, name))
            .await?;
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

impl Connected {
    /// One acquire, writing `owner`'s token and, if given, `holder`'s data.
    async fn acquire_with(
        &self,
        name: &LockName,
        owner: &OwnerToken,
        ttl: Duration,
        holder: Option<&Identity>,
    ) -> Result<AcquireAttempt, BackendError> {
        self.inner.check_ttl(ttl)?;
        let value = value_for(owner, holder, SystemTime::now());
        let (inner, name_, owner_) = (Arc::clone(&self.inner), name.clone(), *owner);
        let acquire = Detachable::new("an acquire", async move {
            let (name, owner, value) = (&name_, &owner_, value.as_str());
            let outcome = inner
                .members
                .run(inner.timeout, "acquire", |at| {
                    inner.acquire(at, name, owner, ttl, value)
                })
                .await;
            if let Err(e) = &outcome {
                // An attempt that got no answer may have put the key on the
                // shared lease, which other locks keep alive: delete it later.
                // A refused configuration or permission wrote nothing.
                if !matches!(e.kind(), BackendErrorKind::Config | BackendErrorKind::Auth) {
                    inner.acquire_failed(name, owner, ttl);
                }
            }
            outcome
        });
        let (backend, name, owner) = (self.clone(), name.clone(), *owner);
        acquire
            .on_orphaned(move |outcome| orphan::undo_if_taken(backend, name, owner, outcome))
            .await
    }
}
