//! The Redis saboteur: a second, plain client that changes lock keys the way
//! another program or an operator could.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use lock_core::{LockName, OwnerToken};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::{BoxError, Saboteur};

const CLEAR_IF_THIEF: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0";

/// A plain client's connection: to one server, or to a cluster (which
/// routes each command by its key).
#[derive(Clone)]
enum Conn {
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Plain(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Plain(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Plain(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Acts on `<prefix><name>` keys through its own connection.
pub struct RedisSaboteur {
    conn: Conn,
    prefix: String,
    thieves: Mutex<HashMap<LockName, String>>,
}

impl std::fmt::Debug for RedisSaboteur {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSaboteur")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisSaboteur {
    /// Connects a plain client to `url`; keys are `prefix` + lock name.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, BoxError> {
        let client = redis::Client::open(url)?;
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            client.get_multiplexed_async_connection(),
        )
        .await
        .map_err(|_| "saboteur: connect timed out")??;
        Ok(Self {
            conn: Conn::Plain(conn),
            prefix: prefix.to_owned(),
            thieves: Mutex::new(HashMap::new()),
        })
    }

    /// Connects a plain cluster client through the seed `nodes`
    /// (`redis://host:port` each).
    pub async fn connect_cluster(nodes: &[String], prefix: &str) -> Result<Self, BoxError> {
        let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(2))
            .build()?;
        let conn = tokio::time::timeout(Duration::from_secs(5), client.get_async_connection())
            .await
            .map_err(|_| "saboteur: cluster connect timed out")??;
        Ok(Self {
            conn: Conn::Cluster(conn),
            prefix: prefix.to_owned(),
            thieves: Mutex::new(HashMap::new()),
        })
    }

    fn key(&self, name: &LockName) -> String {
        format!("{}{}", self.prefix, name.as_str())
    }

    fn thief(&self, name: &LockName) -> Result<Option<String>, BoxError> {
        Ok(self
            .thieves
            .lock()
            .map_err(|_| "poisoned")?
            .get(name)
            .cloned())
    }
}

#[async_trait]
impl Saboteur for RedisSaboteur {
    async fn steal(&self, name: &LockName, hold: Duration) -> Result<(), BoxError> {
        let thief = OwnerToken::generate()?.to_hex();
        let ms = u64::try_from(hold.as_millis())?.max(1);
        // XX: only overwrite a lock that exists, as the memory saboteur does.
        let set: Option<String> = redis::cmd("SET")
            .arg(self.key(name))
            .arg(&thief)
            .arg("XX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut self.conn.clone())
            .await?;
        if set.is_none() {
            return Err("nothing to steal: the lock was free".into());
        }
        self.thieves
            .lock()
            .map_err(|_| "poisoned")?
            .insert(name.clone(), thief);
        Ok(())
    }

    async fn expire(&self, name: &LockName) -> Result<(), BoxError> {
        let removed: i64 = redis::cmd("DEL")
            .arg(self.key(name))
            .query_async(&mut self.conn.clone())
            .await?;
        if removed == 1 {
            Ok(())
        } else {
            Err("nothing to expire: the lock was free".into())
        }
    }

    async fn thief_holds(&self, name: &LockName) -> Result<bool, BoxError> {
        let Some(thief) = self.thief(name)? else {
            return Ok(false);
        };
        let value: Option<String> = redis::cmd("GET")
            .arg(self.key(name))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(value.as_deref() == Some(thief.as_str()))
    }

    async fn clear(&self, name: &LockName) -> Result<(), BoxError> {
        let Some(thief) = self.thief(name)? else {
            return Ok(());
        };
        let _: i64 = redis::cmd("EVAL")
            .arg(CLEAR_IF_THIEF)
            .arg(1)
            .arg(self.key(name))
            .arg(thief)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}
