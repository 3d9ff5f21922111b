//! etcd floors on one etcd-client channel: a lease per lock (lease grant,
//! put-if-absent txn with the lease, delete, revoke: four round trips), and
//! one long-lived lease shared by every cycle (put-if-absent txn, delete: two
//! round trips), as etcd's `concurrency.Session` and lock-etcd use.

use std::time::Duration;

use async_trait::async_trait;
use conformance_tests::BoxError;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use lock_core::{LockName, OwnerToken};

use super::Floor;

pub(super) struct EtcdFloor {
    client: Client,
    ttl_secs: i64,
}

impl EtcdFloor {
    pub(super) async fn connect(endpoints: &[String], ttl: Duration) -> Result<Self, BoxError> {
        let client = Client::connect(endpoints, None).await?;
        Ok(Self {
            client,
            ttl_secs: i64::try_from(ttl.as_millis().div_ceil(1000).max(1))?,
        })
    }
}

#[async_trait]
impl Floor for EtcdFloor {
    fn describe(&self) -> String {
        "lease grant + put-if-absent txn + delete + revoke, one gRPC channel".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let mut c = self.client.clone();
        let key = format!("{}floor/{}", lock_etcd::DEFAULT_PREFIX, name.as_str());
        let lease = c.lease_grant(self.ttl_secs, None).await?.id();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                OwnerToken::generate()?.to_hex(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if !c.txn(txn).await?.succeeded() {
            return Err(format!("etcd floor: {key} was taken").into());
        }
        c.delete(key.as_str(), None).await?;
        c.lease_revoke(lease).await?;
        Ok(())
    }
}

/// How long the shared-lease floor's lease lives: longer than any bench
/// run, so it needs no keep-alive (which would only add to its cost).
const SHARED_LEASE_SECS: i64 = 600;

pub(super) struct EtcdSharedFloor {
    client: Client,
    lease: i64,
}

impl EtcdSharedFloor {
    pub(super) async fn connect(endpoints: &[String]) -> Result<Self, BoxError> {
        let mut client = Client::connect(endpoints, None).await?;
        let lease = client.lease_grant(SHARED_LEASE_SECS, None).await?.id();
        Ok(Self { client, lease })
    }
}

#[async_trait]
impl Floor for EtcdSharedFloor {
    fn describe(&self) -> String {
        "put-if-absent txn on one long-lived lease + delete, one gRPC channel".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let mut c = self.client.clone();
        let key = format!(
            "{}floor-shared/{}",
            lock_etcd::DEFAULT_PREFIX,
            name.as_str()
        );
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                OwnerToken::generate()?.to_hex(),
                Some(PutOptions::new().with_lease(self.lease)),
            )]);
        if !c.txn(txn).await?.succeeded() {
            return Err(format!("etcd shared-lease floor: {key} was taken").into());
        }
        c.delete(key.as_str(), None).await?;
        Ok(())
    }
}
