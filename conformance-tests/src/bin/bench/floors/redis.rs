//! Redis floor: `SET key token NX PX ttl`, then a compare-and-delete script,
//! on one `ConnectionManager` (multiplexed) as lock-redis uses.

use std::time::Duration;

use async_trait::async_trait;
use conformance_tests::BoxError;
use lock_core::{LockName, OwnerToken};
use redis::aio::ConnectionManager;

use super::Floor;

const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0";

pub(super) struct RedisFloor {
    conn: ConnectionManager,
    prefix: String,
    ttl_ms: u64,
    cad: redis::Script,
}

impl RedisFloor {
    pub(super) async fn connect(url: &str, prefix: &str, ttl: Duration) -> Result<Self, BoxError> {
        let conn = ConnectionManager::new(redis::Client::open(url)?).await?;
        Ok(Self {
            conn,
            prefix: format!("{prefix}floor:"),
            ttl_ms: u64::try_from(ttl.as_millis())?,
            cad: redis::Script::new(COMPARE_AND_DELETE),
        })
    }
}

#[async_trait]
impl Floor for RedisFloor {
    fn describe(&self) -> String {
        "SET NX PX + compare-and-delete script (EVALSHA), one multiplexed connection".into()
    }

    async fn cycle(&self, _task: usize, name: &LockName) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        let key = format!("{}{}", self.prefix, name.as_str());
        let token = OwnerToken::generate()?.to_hex();
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(self.ttl_ms)
            .query_async(&mut conn)
            .await?;
        if set.is_none() {
            return Err(format!("redis floor: {key} was taken").into());
        }
        let deleted: i64 = self
            .cad
            .key(&key)
            .arg(&token)
            .invoke_async(&mut conn)
            .await?;
        if deleted != 1 {
            return Err(format!("redis floor: {key} was not ours to delete").into());
        }
        Ok(())
    }
}
