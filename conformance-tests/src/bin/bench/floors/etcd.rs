//! etcd floor: lease grant, put-if-absent txn with the lease, delete, revoke
//! (four round trips) on one etcd-client channel, as lock-etcd uses.

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
