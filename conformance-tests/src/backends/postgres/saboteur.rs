//! The Postgres saboteur: a session of its own that kills holders' sessions
//! with `pg_terminate_backend` and takes their keys.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use lock_core::LockName;
use lock_postgres::{AdvisoryKey, PostgresConfig};
use tokio::time::{sleep, Instant};
use tokio_postgres::Client;

use crate::{BoxError, Saboteur};

const HOLDER: &str = "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
     AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     AND classid::int8 = $1 AND objid::int8 = $2 AND objsubid = 2";

/// Connects a plain session (no lock backend) with the suite's settings.
pub async fn plain_session(url: &str, app: &str) -> Result<Client, BoxError> {
    let mut cfg: tokio_postgres::Config = url.parse()?;
    cfg.application_name(app)
        .connect_timeout(Duration::from_secs(5));
    let (client, conn) = cfg.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// The pid of the session holding `key`, if any.
pub async fn holder_pid(client: &Client, key: AdvisoryKey) -> Result<Option<i32>, BoxError> {
    let row = client
        .query_opt(HOLDER, &[&key.classid(), &key.objid()])
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Terminates a session and waits (up to 5 s) until it is gone.
pub async fn terminate(client: &Client, pid: i32) -> Result<(), BoxError> {
    let row = client
        .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
        .await?;
    if row.get::<_, bool>(0) {
        Ok(())
    } else {
        Err(format!("pg_terminate_backend({pid}) did not end the session").into())
    }
}

/// Steals, expires and inspects locks from its own session.
#[derive(Debug)]
pub struct PgSaboteur {
    client: Client,
    config: PostgresConfig,
    stolen: Mutex<HashSet<AdvisoryKey>>,
}

impl PgSaboteur {
    /// The answer of `sql`, a one-boolean query over a key's two halves.
    async fn on_key(&self, sql: &str, key: AdvisoryKey) -> Result<bool, BoxError> {
        let row = self.client.query_one(sql, &[&key.key1, &key.key2]).await?;
        Ok(row.get(0))
    }

    /// A saboteur mapping names as `config` does, over `client`.
    pub fn new(client: Client, config: PostgresConfig) -> Self {
        Self {
            client,
            config,
            stolen: Mutex::new(HashSet::new()),
        }
    }

    async fn holder(&self, name: &LockName) -> Result<(AdvisoryKey, i32), BoxError> {
        let key = self.config.key_for(name);
        let pid = holder_pid(&self.client, key)
            .await?
            .ok_or_else(|| format!("nobody holds {name} ({key})"))?;
        Ok((key, pid))
    }
}

#[async_trait]
impl Saboteur for PgSaboteur {
    async fn steal(&self, name: &LockName, _hold: Duration) -> Result<(), BoxError> {
        let (key, pid) = self.holder(name).await?;
        // One statement, so the key is ours before the holder's client can
        // even notice that its session ended.
        let row = self
            .client
            .query_one(
                "SELECT pg_terminate_backend($1, 5000), pg_try_advisory_lock($2, $3)",
                &[&pid, &key.key1, &key.key2],
            )
            .await?;
        let (terminated, mut got): (bool, bool) = (row.get(0), row.get(1));
        if !terminated {
            return Err(format!("pg_terminate_backend({pid}) did not end the session").into());
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while !got && Instant::now() < deadline {
            sleep(Duration::from_millis(5)).await;
            got = self
                .on_key("SELECT pg_try_advisory_lock($1, $2)", key)
                .await?;
        }
        if !got {
            return Err(format!("{name} could not be taken after killing its holder").into());
        }
        self.stolen.lock().map_err(|_| "poisoned")?.insert(key);
        Ok(())
    }

    async fn expire(&self, name: &LockName) -> Result<(), BoxError> {
        let (_, pid) = self.holder(name).await?;
        terminate(&self.client, pid).await
    }

    async fn thief_holds(&self, name: &LockName) -> Result<bool, BoxError> {
        let key = self.config.key_for(name);
        if !self.stolen.lock().map_err(|_| "poisoned")?.contains(&key) {
            return Ok(false);
        }
        let mine: i32 = self
            .client
            .query_one("SELECT pg_backend_pid()", &[])
            .await?
            .get(0);
        Ok(holder_pid(&self.client, key).await? == Some(mine))
    }

    async fn clear(&self, name: &LockName) -> Result<(), BoxError> {
        let key = self.config.key_for(name);
        for _ in 0..10 {
            let unlocked = self
                .on_key(
                    "SELECT pg_advisory_unlock($1, $2) FROM (SELECT set_config('client_min_messages', 'error', false)) s",
                    key,
                )
                .await?;
            if !unlocked {
                break;
            }
        }
        self.stolen.lock().map_err(|_| "poisoned")?.remove(&key);
        Ok(())
    }
}
