//! Changes etcd locks from a second client, as another process or an operator would.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use lock_core::{LockName, OwnerToken};

use crate::{BoxError, Saboteur};

/// A plain etcd client that steals, expires and inspects lock keys.
pub struct EtcdSaboteur {
    client: Client,
    prefix: String,
    /// Per name, the thief's token and lease.
    thieves: Mutex<HashMap<LockName, (OwnerToken, i64)>>,
}

impl std::fmt::Debug for EtcdSaboteur {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdSaboteur")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdSaboteur {
    /// Connects its own client to `endpoints`; lock keys are `prefix` + name.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is left behind.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, BoxError> {
        let client = tokio::time::timeout(Duration::from_secs(5), Client::connect(endpoints, None))
            .await??;
        Ok(Self {
            client,
            prefix: prefix.to_owned(),
            thieves: Mutex::new(HashMap::new()),
        })
    }

    /// [`EtcdSaboteur::connect`] with the library's default key prefix, the
    /// one every backend of the suite locks under.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is left behind.
    pub async fn connect_default(endpoints: &[String]) -> Result<Self, BoxError> {
        Self::connect(endpoints, lock_etcd::DEFAULT_PREFIX).await
    }

    /// The raw client, for etcd-specific tests.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    fn key(&self, name: &LockName) -> String {
        format!("{}{}", self.prefix, name.as_str())
    }

    /// The kinds of the changes to `name`'s key from now on, in order
    /// (`true` for a put, `false` for a delete), as a channel fed by a
    /// watch that ends when the receiver is dropped.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call leaves no watch behind.
    pub async fn watch_changes(
        &self,
        name: &LockName,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<bool>, BoxError> {
        let mut stream = self
            .client
            .watch_client()
            .watch(self.key(name), None)
            .await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                for event in resp.events() {
                    let put = event.event_type() == etcd_client::EventType::Put;
                    if tx.send(put).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }

    /// The lease attached to the lock key, if the key exists.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn lease_of(&self, name: &LockName) -> Result<Option<i64>, BoxError> {
        let resp = self.client.kv_client().get(self.key(name), None).await?;
        Ok(resp.kvs().first().map(|kv| kv.lease()))
    }

    /// Overwrites the lock key's value and keeps the lease it is on, as
    /// `etcdctl put --ignore-lease` does: the key stays on the holder's
    /// lease, so only its value (and revision) shows the change.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a cancelled call may or may not have written.
    pub async fn overwrite_keeping_lease(
        &self,
        name: &LockName,
        value: &str,
    ) -> Result<(), BoxError> {
        self.client
            .kv_client()
            .put(
                self.key(name),
                value,
                Some(PutOptions::new().with_ignore_lease()),
            )
            .await?;
        Ok(())
    }
}

#[async_trait]
impl Saboteur for EtcdSaboteur {
    /// Puts a thief token on a new lease over the holder's key in one
    /// transaction: the holder only ever sees another token, never a gap.
    /// The holder's lease is left alone: it is shared with its other locks.
    async fn steal(&self, name: &LockName, hold: Duration) -> Result<(), BoxError> {
        let key = self.key(name);
        let thief = OwnerToken::generate()?;
        let seconds = i64::try_from(hold.as_secs().max(1))?;
        let lease = self.client.lease_client().grant(seconds, None).await?.id();
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Greater, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                thief.to_hex(),
                Some(PutOptions::new().with_lease(lease).with_prev_key()),
            )]);
        let resp = self.client.kv_client().txn(txn).await?;
        if !resp.succeeded() {
            self.client.lease_client().revoke(lease).await?;
            return Err("nothing to steal: the lock was free".into());
        }
        self.thieves
            .lock()
            .map_err(|_| "poisoned")?
            .insert(name.clone(), (thief, lease));
        Ok(())
    }

    /// Deletes the key: what the expiry of a lease carrying only this lock
    /// would do. The holder's lease is shared with its other locks, so it is
    /// not revoked (see `etcd::theft_by_lease_revoke` for that).
    async fn expire(&self, name: &LockName) -> Result<(), BoxError> {
        let resp = self.client.kv_client().delete(self.key(name), None).await?;
        if resp.deleted() == 0 {
            return Err("nothing to expire: the lock was free".into());
        }
        Ok(())
    }

    async fn thief_holds(&self, name: &LockName) -> Result<bool, BoxError> {
        let thief = self
            .thieves
            .lock()
            .map_err(|_| "poisoned")?
            .get(name)
            .map(|(t, _)| *t);
        let Some(thief) = thief else {
            return Ok(false);
        };
        let resp = self.client.kv_client().get(self.key(name), None).await?;
        Ok(resp
            .kvs()
            .first()
            .is_some_and(|kv| kv.value() == thief.to_hex().as_bytes()))
    }

    async fn clear(&self, name: &LockName) -> Result<(), BoxError> {
        let entry = self.thieves.lock().map_err(|_| "poisoned")?.remove(name);
        if let Some((thief, lease)) = entry {
            let key = self.key(name);
            let txn = Txn::new()
                .when([Compare::value(
                    key.as_str(),
                    CompareOp::Equal,
                    thief.to_hex(),
                )])
                .and_then([TxnOp::delete(key.as_str(), None)]);
            self.client.kv_client().txn(txn).await?;
            match self.client.lease_client().revoke(lease).await {
                Ok(_) => {}
                Err(e) if e.to_string().contains("not found") => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
